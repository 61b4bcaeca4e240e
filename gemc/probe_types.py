"""What the precision probe measures, as the precision pass reads it.

The probe (:mod:`gemc.probe`) builds and runs the model: a measurement, like calibration,
that the driver provides. The pass (``choose-precision``) consumes its results through the
types and the :class:`PrecisionProbe` protocol below, handed to it in the pass context
(``PassContext.precision_probe``), so the pass never re-enters the API or imports the runner.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from gemc.fp8_recipe import Fp8Recipe

SiteKey = tuple[str, str, int]  # (innermost module path, op name, call index in that module)


@dataclass(frozen=True)
class ProbeConfig:
    """How much CPU the probe may spend. The batch is cut to what ``max_fwd_flops`` allows
    (at least ``min_batch`` samples, at most ``max_batch``): a GEM h200 step probes 8 samples
    (2048 sequence tokens), a tiny preset its whole batch."""

    steps: int = 2
    min_batch: int = 8
    max_batch: int = 32
    fold_rows: int = 4096
    max_dense_bytes: float = 2e9  # fp32 weights outside embedding tables
    max_fwd_flops: float = 8e9  # forward FLOPs of one probe step
    seed: int = 0


class ProbeSkipped(Exception):
    """The model cannot be probed on this machine; the message says why."""


@dataclass
class Energy:
    """Signal and error energy, pooled over calls: SQNR = 10 log10(signal / noise)."""

    signal: float = 0.0
    noise: float = 0.0

    def add(self, ref: torch.Tensor, test: torch.Tensor) -> None:
        ref = ref.double()
        self.signal += float((ref * ref).sum())
        self.noise += float(((ref - test.double()) ** 2).sum())

    @property
    def db(self) -> float:
        if self.noise == 0.0:
            return math.inf
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """SQNR in dB of ``test`` against ``ref`` (inf when equal): the one definition the
    precision probe and the exchange precision's bound share."""
    e = Energy()
    e.add(ref, test)
    return e.db


@dataclass
class SiteStats:
    """What the probe measured for one GEMM site (pooled over its calls)."""

    key: SiteKey
    module_type: str
    calls: int = 0
    energy: dict[str, dict[str, Energy]] = field(default_factory=dict)  # gemm -> label
    outliers: dict[str, float] = field(default_factory=dict)  # gemm -> worst ratio

    def sqnr(self, gemm: str, label: str) -> float | None:
        e = self.energy.get(gemm, {}).get(label)
        return None if e is None else e.db

    def add(self, gemm: str, label: str, ref: torch.Tensor, test: torch.Tensor) -> None:
        self.energy.setdefault(gemm, {}).setdefault(label, Energy()).add(ref, test)

    def add_outlier(self, gemm: str, ratio: float) -> None:
        self.outliers[gemm] = max(self.outliers.get(gemm, 1.0), ratio)


Assignment = Mapping[str, "str | Fp8Recipe"]  # module fqn -> "bf16" | "fp32" | recipe


@dataclass(frozen=True)
class BlockResult:
    """A region run alone in a candidate assignment vs fp32 (SQNR dB, pooled over calls)."""

    region: str
    outputs_db: float
    input_grads_db: float
    param_grads_db: float

    @property
    def db(self) -> float:
        return min(self.outputs_db, self.input_grads_db, self.param_grads_db)


class PrecisionProbe(Protocol):
    """A model measured on representative tensors (what :class:`gemc.probe.Probe` is)."""

    info: dict[str, Any]
    sites: dict[SiteKey, SiteStats]

    def is_linear(self, fqn: str) -> bool:
        """Whether ``fqn`` is an nn.Linear (the only module fp8 can replace)."""
        ...

    def check_block(self, region: str, assignment: Assignment) -> BlockResult | None:
        """SQNR of ``region`` run alone with ``assignment`` applied, vs fp32."""
        ...


class ProbeOpener(Protocol):
    """Builds and measures the compiled model: the driver binds it to the entrypoint and
    its arguments (:func:`gemc.probe.opener`); the pass says which regions and sites.
    Raises :class:`ProbeSkipped` when the model cannot be probed on this machine."""

    def __call__(self, regions: Sequence[str], config: ProbeConfig, *, fwd_flops: float,
                 fp8_sites: set[SiteKey] | None) -> PrecisionProbe: ...
