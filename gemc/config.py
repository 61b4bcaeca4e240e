"""One compile's options: what ``gemc compile`` parses and ``gemc.compile`` takes.

Why one typed object: the CLI and the API used to pass the same options through different
channels (keyword arguments, a context variable for the precision options, ``ctx.options``
read with ``getattr``). Now the CLI builds a :class:`CompileConfig`, the API reads one, and
a pass gets its options as its own dataclass fields from the pipeline the driver builds
(``ChoosePrecision(options=config.precision)``, ``Parallelize(planner, solver, ...)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from gemc.errors import GemcUserError
from gemc.exchange_precision import EXCHANGE_MODES
from gemc.host_randomness import MODES as HOST_RANDOMNESS_MODES
from gemc.passes.precision import PrecisionOptions
from gemc.plan import FP32_MATMUL, PLANNERS, TABLE_OPTIMIZERS


@dataclass(frozen=True)
class CompileConfig:
    """Every option of one compile (the model and where the plan goes are not options).

    ``calibration``: "auto" (the file gemc ships for the topology's GPU, if any), "none"
    or None (roofline only), or a file written by ``gemc calibrate``.
    ``planner``: cpsat (the CP-SAT solver), greedy, naive, or default (place-default).
    ``solver``: the planners' settings (``gemc.solver.problem.SolverSettings`` fields,
    e.g. ``{"time_limit_s": 10}``).
    ``table_optimizer``: one of ``gemc.plan.TABLE_OPTIMIZERS`` or "auto" (adam where it
    fits, else rowwise_adagrad); priced, written to the plan and run by the runner.
    None: the runner's default (``StepOptions.table_optimizer``, row-wise Adagrad), priced
    and recorded the same way.
    ``table_precision``: the tables' storage precision, chosen with their sharding
    (``gemc.solver.precision_choice``): fp32 (None: the default), bf16 / fp8 (the lowest
    allowed; the fastest plan that fits), or auto (lower only tables that must be lowered
    to fit); recorded per table in the plan with the reason. Needs a solver planner.
    ``exchange_precision``: the wire precision of the sharded tables' pooled exchange
    (``gemc.solver.exchange_choice``): fp32 (None: the default), bf16, fp8 (forward; the
    gradients go back bf16), or auto (a lower one where its SQNR holds and the plan
    predicts faster; needs a solver planner); recorded in the plan's ``exchange`` block.
    ``precision``: the choose-precision pass's options (mode, SQNR bounds, probe budget).
    ``passes``: a pass-spec string (``gemc.pipeline.pipeline_from_spec``:
    ``"classify-ops,...,fuse{max_outputs=2},..."``) choosing the pipeline's passes and their
    options; None: the default pipeline.
    ``fp32_matmul``: how the run executes fp32 GEMMs (the precision sites kept fp32, a
    model without autocast): "ieee" (PyTorch's default) or "tf32"; priced so and written
    to the plan, whose runner sets ``torch.backends.cuda.matmul.allow_tf32`` from it.
    ``host_randomness``: a forward that draws from Python's or NumPy's generator while
    traced is refused ("error") or compiled with the drawn values as constants, listed in
    the plan's warnings ("freeze"): :mod:`gemc.host_randomness`.
    """

    topology: str = "h200:1x8"
    planner: str = "default"
    calibration: str | None = "auto"
    solver: Mapping[str, Any] = field(default_factory=dict)
    table_optimizer: str | None = None
    table_precision: str | None = None
    exchange_precision: str | None = None
    precision: PrecisionOptions = field(default_factory=PrecisionOptions)
    disabled_passes: tuple[str, ...] = ()
    passes: str | None = None
    dump_dir: str | Path | None = None
    dump_mode: str = "all"
    fp32_matmul: str = "ieee"
    host_randomness: str = "error"

    def validate(self) -> None:
        """Raise GemcUserError naming the first bad option (before any capture)."""
        if self.host_randomness not in HOST_RANDOMNESS_MODES:
            raise GemcUserError(f"unknown host randomness mode {self.host_randomness!r}",
                                where="--host-randomness (CompileConfig.host_randomness)",
                                fix=f"use one of: {', '.join(HOST_RANDOMNESS_MODES)}")
        if self.planner not in PLANNERS:
            raise GemcUserError(f"unknown planner {self.planner!r}", where="planner",
                                fix=f"use one of: {', '.join(PLANNERS)}")
        if self.table_optimizer is not None \
                and self.table_optimizer not in (*TABLE_OPTIMIZERS, "auto"):
            raise GemcUserError(f"unknown table optimizer {self.table_optimizer!r}",
                                where="table_optimizer",
                                fix=f"use one of: {', '.join((*TABLE_OPTIMIZERS, 'auto'))}")
        if self.table_precision is not None:
            from gemc.solver.precision_choice import TABLE_PRECISION_MODES

            if self.table_precision not in TABLE_PRECISION_MODES:
                raise GemcUserError(f"unknown table precision {self.table_precision!r}",
                                    where="table_precision",
                                    fix=f"use one of: {', '.join(TABLE_PRECISION_MODES)}")
            if self.table_precision != "fp32" and self.planner == "default":
                raise GemcUserError(
                    f"table precision {self.table_precision!r} is chosen by the solver, "
                    "which the default planner (place-default) does not run",
                    where="table_precision", fix="add --planner cpsat (or greedy / naive)")
        if self.exchange_precision is not None:
            where = "--exchange-precision (CompileConfig.exchange_precision)"
            if self.exchange_precision not in EXCHANGE_MODES:
                raise GemcUserError(
                    f"unknown exchange precision {self.exchange_precision!r}", where=where,
                    fix=f"use one of: {', '.join(EXCHANGE_MODES)} (fp8 sends the pooled rows "
                    "fp8 with a scale per row and their gradients bf16)")
            if self.exchange_precision == "auto" and self.planner == "default":
                raise GemcUserError(
                    "exchange precision 'auto' is chosen by the solver, which the default "
                    "planner (place-default) does not run", where=where,
                    fix="add --planner cpsat (or greedy / naive), or fix it: "
                    "--exchange-precision bf16")
        if self.fp32_matmul not in FP32_MATMUL:
            raise GemcUserError(f"unknown fp32 matmul mode {self.fp32_matmul!r}",
                                where="--fp32-matmul (CompileConfig.fp32_matmul)",
                                fix=f"use one of: {', '.join(FP32_MATMUL)}")
        if not isinstance(self.precision, PrecisionOptions):
            raise GemcUserError(f"precision is a {type(self.precision).__name__}",
                                where="precision",
                                fix="pass gemc.passes.precision.PrecisionOptions(...)")
        self.precision.validate()
        if "emit-plan" in self.disabled_passes:
            raise GemcUserError("pass 'emit-plan' cannot be disabled: it writes the plan, "
                                "which is what a compile makes", where="--disable-pass",
                                fix="disable the passes before it (e.g. --disable-pass fuse); "
                                "to stop after a pass, read its dump (--dump-dir)")
        self.pipeline()  # a bad pass spec is named before any capture

    def pipeline(self) -> list[Any]:
        """The passes this compile runs: the default pipeline, or the one ``passes`` names;
        both end with emit-plan (:meth:`emission_pass`)."""
        from gemc.pipeline import default_pipeline, pipeline_from_spec

        if self.passes is None:
            return default_pipeline(self.planner, self.precision, self.placement_pass(),
                                    self.emission_pass())
        return pipeline_from_spec(self.passes, self.planner, self.precision,
                                  self.placement_pass(), self.emission_pass())

    def emission_pass(self) -> Any:
        """emit-plan with what this compile's plan records: the planner, the table
        optimizer and exchange precision (where no planner chooses them), and whether the
        step is priced (not when predict-time is disabled)."""
        from gemc.plan_builder import EmitPlan

        return EmitPlan(self.planner, self.table_optimizer, self.exchange_precision,
                        predict="predict-time" not in self.disabled_passes)

    def placement_pass(self) -> Any:
        """The placement pass with this compile's planner options as its fields (a bad
        solver setting is a GemcUserError naming it)."""
        from gemc.passes.parallelize import settings_from
        from gemc.pipeline import placement_pass

        return placement_pass(self.planner, settings_from(self.solver), self.table_optimizer,
                              self.table_precision, self.exchange_precision)

    def with_options(self, **options: Any) -> CompileConfig:
        """A copy with ``options`` (field names) replaced; an unknown name is a user error."""
        names = [f.name for f in fields(self)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise GemcUserError(f"unknown compile option(s) {unknown}", where="gemc.compile",
                                fix=f"use CompileConfig's fields: {', '.join(names)}")
        if "disabled_passes" in options:
            options["disabled_passes"] = tuple(options["disabled_passes"])
        return replace(self, **options)
