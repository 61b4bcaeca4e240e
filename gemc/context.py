"""What every pass may read besides the graph: the model's facts, the topology, the measured
inputs (a pass's options are its own dataclass fields, set by the driver)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gemc.probe_types import ProbeOpener

if TYPE_CHECKING:  # the context sits above the cost model (pyproject's stack contract)
    from gemc.cost_model.calibration import Calibration
    from gemc.cost_model.topology import Topology


@dataclass
class PassContext:
    """Read-mostly state shared by a pipeline's passes.

    Passes record results on nodes (``node.meta`` under gemc.ir keys), not here; the only
    thing a pass appends to is ``warnings`` (loud fallbacks the user must see).
    """

    entrypoint: str = "model"
    args: dict[str, Any] = field(default_factory=dict)
    param_fqns: dict[str, str] = field(default_factory=dict)  # placeholder -> FQN
    param_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    param_dtypes: dict[str, str] = field(default_factory=dict)
    param_aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # tied weights
    # placeholder -> lifted tensor constant (torch.export's inputs_to_lifted_tensor_constants)
    constant_fqns: dict[str, str] = field(default_factory=dict)
    # the capture's fingerprint of graph and parameter shapes (the plan names its model by
    # it) and the batch size the model states (None: none stated), both in the plan
    fingerprint: str | None = None
    batch_size: int | None = None
    # None: a pipeline without costs (annotation only); the pricing passes refuse it
    topology: Topology | None = None
    calibration: Calibration | None = None  # None: the cost model's uncalibrated curves
    # a measured input, like calibration: the driver binds the precision probe to the model
    # (gemc.probe.opener); None: choose-precision measures nothing and keeps GEMMs bf16
    precision_probe: ProbeOpener | None = None
    # the entrypoint's example batch (ModelSpec.example_inputs, real wherever the author
    # built it): a sample of what is data at compile time, e.g. a guarded packed region's
    # fill (gemc.guard_sample); None: priced padded, with a warning
    sample_inputs: tuple[Any, ...] | None = None
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
