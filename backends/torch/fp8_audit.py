"""The fp8 audit: every N steps, each fp8 site's GEMMs measured against high precision on
the step's own operands; a GEMM that fell under the precision pass's bound runs bf16 after.

Why: the precision pass chooses fp8 per GEMM from the SQNR its probe measures at compile
time, on the initial weights (steps 0-1). That is the wrong moment for the weight gradient:
on Wukong it measures 38-45 dB at initialisation and 6.7-20 dB after 100 training steps
(BENCHMARKS.md, "fp8 loss against bf16 on Wukong, on the CPU"): once the model fits the
mean, the per-token terms of ``dW = dy^T x`` cancel while the rounding errors of ``dy``
do not. Nothing measured it during training; the loss safeguard (:mod:`.divergence`) only
sees a blow-up, long after the gradient went bad.

What it measures (:func:`gemm_sqnr`): for a site's input ``x``, weight ``W`` and output
gradient ``dy``, each GEMM the site runs in fp8 (``fwd``: ``x W^T``, ``dgrad``: ``dy W``,
``wgrad``: ``dy^T x``) as the site computes it (:func:`gemc.backends.torch.fp8._op_gemm`:
the same quantisation and GEMM the fp8 linear's op and backward formula call) against the
same GEMM of the unquantised operands with fp32 accumulation (TF32 off), SQNR in dB
(:class:`gemc.probe_types.Energy`, the probe's own definition), pooled over the site's
calls in the step.

The bound is the one the precision pass chose the GEMM by: the ``min_sqnr_db`` of the
rule the plan records on its ``"*"`` entry, else :data:`gemc.fp8_recipe.MIN_SQNR_DB` (its
default; a plan without the pass's rule, or sites forced by ``--fp8-linears``). A GEMM
under it runs bf16 for the rest of the run: a warning names the site, the GEMM, the step
and the dB; the run report's ``fp8_audit`` keeps every site's series and switches. The
switch takes effect at the step after the audited one, whose numerics are the audit-off
run's: the reference GEMMs are side computations without autograd, their tensors freed
when the site is measured.

Two ways to get the operands (:attr:`Fp8Audit.mode`):

``step``    the model runs eagerly (module mode, not compiled): hooks on each
            :class:`~gemc.backends.torch.fp8.Fp8Linear` keep the step's own ``x`` (a
            reference: the op saves it for its backward anyway) and measure when ``dy``
            arrives in the backward, before the optimizer step;
``shadow``  the step runs compiled (graph mode, or module mode under torch.compile), where
            a hook cannot see inside: before the step, the eager model runs the same batch
            from the same RNG state and weights (buffers restored after), and the hooks
            measure during ``torch.autograd.grad`` of its loss to the sites' outputs (no
            parameter gradient is written). Its operands are the compiled step's up to the
            compiled kernels' rounding; it costs an extra forward and backward per audit.
            One rank only: on several, the eager forward would run the tables' exchange
            and the regions' wrappers outside the step (the audit is off there, said so).

How a switch reaches the GEMM: module mode reads ``Fp8Linear.recipe`` at every call; under
torch.compile Dynamo guards on it and recompiles; graph mode bakes the recipe into the
captured graph's site calls (:mod:`.graph_fp8`), so the runner re-targets them and drops
its compiled graphs (:meth:`~gemc.backends.torch.graph_mode.GraphExecutor.set_fp8_recipes`).
A resumed run starts from the plan's recipes again (switches are not checkpointed) and is
audited again.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from gemc.backends.torch import fp8
from gemc.backends.torch.fp8_audit_cadence import DEFAULT_EVERY, FLAG
from torch import nn

from gemc.errors import GemcUserError
from gemc.fp8_recipe import BF16, GEMMS, MIN_SQNR_DB, Fp8Recipe
from gemc.probe_types import Energy

MAX_DB = 200.0  # plans and reports are JSON: no infinities (as the precision pass clamps)
STEP, SHADOW = "step", "shadow"


def check_every(value: Any) -> int:
    """``value`` if it is an integer >= 0 (0: the audit is off)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GemcUserError(f"the fp8 audit interval {value!r} is not an integer >= 0",
                            where=FLAG,
                            fix=f"give the steps between audits, e.g. {FLAG} {DEFAULT_EVERY} "
                            f"(the default), or {FLAG} 0 to turn the audit off")
    return value


def plan_bound(entries: Sequence[dict[str, Any]]) -> tuple[float, str]:
    """(bound in dB, where it comes from): the rule the plan's precision pass recorded, else
    its default."""
    for entry in entries:
        rule = entry.get("rule") if isinstance(entry, dict) else None
        if entry.get("target") in ("*", "") and isinstance(rule, dict) \
                and isinstance(rule.get("min_sqnr_db"), int | float):
            return float(rule["min_sqnr_db"]), "the plan's precision rule (min_sqnr_db)"
    return MIN_SQNR_DB, "gemc.fp8_recipe.MIN_SQNR_DB (the plan records no precision rule)"


# ----------------------------------------------------------------------------- measuring


def _operands(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor
              ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each GEMM's (a, b) of ``a @ b``, as the fp8 linear's op and backward form them."""
    x2, dy2 = x.detach().flatten(0, -2), dy.detach().flatten(0, -2)
    w = w.detach()
    return {"fwd": (x2, w.t()), "dgrad": (dy2, w), "wgrad": (dy2.t(), x2)}


@contextlib.contextmanager
def _full_precision() -> Iterator[None]:
    """No autograd, no autocast, fp32 GEMMs without TF32 (a reference is not a TF32 one)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad(), torch.autocast("cuda", enabled=False), \
                torch.autocast("cpu", enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def recipe_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, recipe: Fp8Recipe, *,
                 quantizer: str = fp8.ATEN_QUANT, emulate: bool | None = None,
                 out_dtype: torch.dtype | None = None, gemms: Sequence[str] = GEMMS
                 ) -> dict[str, torch.Tensor]:
    """The ``gemms`` of a linear as ``recipe`` runs them, in the dtypes the linear returns
    (``fwd`` in ``out_dtype``, default x's; ``dgrad`` in x's; ``wgrad`` in W's)."""
    emulate = (not fp8.hardware_fp8(x.device)) if emulate is None else emulate
    dtypes = {"fwd": out_dtype or x.dtype, "dgrad": x.dtype, "wgrad": w.dtype}
    choices = recipe.choices()
    with _full_precision():
        return {g: fp8._op_gemm(a, b, choices[g], dtypes[g], emulate, quantizer)
                for g, (a, b) in _operands(x, w, dy).items() if g in gemms}


def reference_gemms(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                    dtype: torch.dtype = torch.float32, gemms: Sequence[str] = GEMMS
                    ) -> dict[str, torch.Tensor]:
    """The ``gemms`` of the unquantised operands in ``dtype`` (fp32: fp32 accumulation of
    the bf16 / fp32 operands as they are; float64 for a benchmark's yardstick)."""
    with _full_precision():
        return {g: a.to(dtype) @ b.to(dtype) for g, (a, b) in _operands(x, w, dy).items()
                if g in gemms}


def _energy(ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """[signal, noise] in float64, on the device (read once per audit, not per GEMM)."""
    ref = ref.double()
    return torch.stack([(ref * ref).sum(), ((ref - test.double()) ** 2).sum()])


def gemm_energies(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, recipe: Fp8Recipe, *,
                  quantizer: str = fp8.ATEN_QUANT, emulate: bool | None = None,
                  out_dtype: torch.dtype | None = None, reference: torch.dtype = torch.float32,
                  gemms: Sequence[str] = GEMMS) -> dict[str, torch.Tensor]:
    """Per GEMM of ``gemms``, [signal, noise] of ``recipe``'s result against the reference:
    one GEMM at a time, so at most two results are alive."""
    out = {}
    for g in gemms:
        test = recipe_gemms(x, w, dy, recipe, quantizer=quantizer, emulate=emulate,
                            out_dtype=out_dtype, gemms=(g,))[g]
        ref = reference_gemms(x, w, dy, reference, gemms=(g,))[g]
        with torch.no_grad():
            out[g] = _energy(ref, test)
        del test, ref
    return out


def db_of(energy: torch.Tensor) -> float:
    """SQNR dB of a [signal, noise] pair (:class:`gemc.probe_types.Energy`'s formula)."""
    signal, noise = (float(v) for v in energy.tolist())
    return Energy(signal, noise).db


def gemm_sqnr(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, recipe: Fp8Recipe, *,
              quantizer: str = fp8.ATEN_QUANT, emulate: bool | None = None,
              out_dtype: torch.dtype | None = None, reference: torch.dtype = torch.float32,
              gemms: Sequence[str] = GEMMS) -> dict[str, float]:
    """SQNR (dB) of each of a linear's ``gemms`` as ``recipe`` runs them, against the same
    GEMM of the unquantised operands in ``reference``."""
    return {g: db_of(e) for g, e in gemm_energies(
        x, w, dy, recipe, quantizer=quantizer, emulate=emulate, out_dtype=out_dtype,
        reference=reference, gemms=gemms).items()}


def wgrad_by_operand(x: torch.Tensor, dy: torch.Tensor) -> dict[str, float]:
    """SQNR (dB vs float64) of ``dW = dy^T x`` with only ``dy`` or only ``x`` row-wise e4m3
    (each scaled along the tokens, as gemc's wgrad does): which operand's rounding the
    weight gradient's error comes from."""
    xd, dyd = x.detach().flatten(0, -2), dy.detach().flatten(0, -2)
    ref = dyd.double().t() @ xd.double()

    def rounded(t: torch.Tensor) -> torch.Tensor:  # along the tokens (dim 0)
        return fp8.dequantize(*fp8.quantize(t, fp8.ROWWISE, dim=0)).double()

    return {"dy": db_of(_energy(ref, rounded(dyd).t() @ xd.double())),
            "x": db_of(_energy(ref, dyd.double().t() @ rounded(xd)))}


def coherence_db(x: torch.Tensor, dy: torch.Tensor) -> float:
    """``10 log10(|dy^T x|^2 / sum_t |dy_t|^2 |x_t|^2)``: how the weight gradient's per-token
    terms add up. About 0 dB for independent terms; positive where they point one way
    (early training); negative where they cancel (a gradient of label noise around a
    fitted mean): the rounding errors of the operands do not cancel with them, so a
    GEMM's SQNR drops by about that much below its operands'."""
    xd, dyd = x.detach().double().flatten(0, -2), dy.detach().double().flatten(0, -2)
    terms = float(((dyd ** 2).sum(1) * (xd ** 2).sum(1)).sum())
    total = float(((dyd.t() @ xd) ** 2).sum())
    return float("-inf") if total == 0 else 10 * math.log10(total / terms)


def _json_db(db: float) -> float:
    return round(max(min(db, MAX_DB), -MAX_DB), 2)


# ----------------------------------------------------------------------------- the audit


class Fp8Audit:
    """The run's audit (see the module doc). ``sites``: fqn -> the model's Fp8Linear;
    ``on_switch``: called with {fqn: new recipe} after the modules' recipes changed (graph
    mode re-targets its graph); ``mode``: :data:`STEP` or :data:`SHADOW`; ``off``: why the
    audit does not run (None: it runs when ``every`` > 0); ``not_audited``: fp8 sites left
    out, fqn -> why (reported)."""

    def __init__(self, sites: dict[str, fp8.Fp8Linear], *, every: int, bound_db: float,
                 bound_source: str, mode: str = STEP, off: str | None = None,
                 on_switch: Callable[[dict[str, Fp8Recipe]], None] | None = None,
                 world_size: int = 1, quiet: bool = False,
                 not_audited: dict[str, str] | None = None) -> None:
        self.every = check_every(every)
        self.bound_db, self.bound_source = bound_db, bound_source
        self.mode = mode
        self.off = off if off is not None else (
            f"{FLAG} 0" if every == 0 else None if sites else "no fp8 site in this run")
        self.sites = dict(sorted(sites.items()))
        self.on_switch = on_switch
        self.world_size, self.quiet = world_size, quiet
        self.not_audited = dict(sorted((not_audited or {}).items()))  # fqn -> why
        self.initial = {n: m.recipe for n, m in self.sites.items()}
        self.series: dict[str, list[dict[str, Any]]] = {n: [] for n in self.sites}
        self.switches: list[dict[str, Any]] = []
        self.audits = 0
        self.seconds = 0.0
        self._armed: int | None = None  # the step being audited (1-based)
        self._energy: dict[str, dict[str, torch.Tensor]] = {}
        self._outputs: list[torch.Tensor] = []
        self._handles: list[Any] = []  # the forward hooks, only while a step is audited

    # -- when ----------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based, as the run counts them) is audited."""
        return self.off is None and step % self.every == 0 and any(
            m.recipe.any_fp8 for m in self.sites.values())

    def begin(self, step: int) -> None:
        """Arm the hooks for step ``step`` (the ``step`` mode: its own forward and backward)."""
        if self.due(step):
            self._armed = step
            self._attach()

    def shadow(self, step: int, model: nn.Module, batch: Sequence[Any],
               autocast: Callable[[], contextlib.AbstractContextManager]) -> None:
        """The ``shadow`` mode: measure step ``step``'s sites on an eager run of ``model``
        on ``batch``, from the RNG state the step will start from, before the step."""
        if not self.due(step):
            return
        _sync(next(model.parameters()).device)
        t0 = time.perf_counter()
        self._armed = step
        self._attach()
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        devices = sorted({b.device.index or 0 for b in model.parameters()
                          if b.device.type == "cuda"})
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                with autocast():
                    loss = model(*batch)
                outs = [o for o in self._outputs if o.requires_grad]
                if outs:
                    torch.autograd.grad(loss, outs, allow_unused=True)
                del loss, outs
        finally:
            self._detach()
            self._outputs.clear()
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            _sync(next(model.parameters()).device)
            self.seconds += time.perf_counter() - t0

    # -- the hooks -----------------------------------------------------------------------

    def _attach(self) -> None:
        """Forward hooks on the sites, for one audited step: none on the other steps (and
        none that a compiled forward would trace and guard on)."""
        self._detach()
        self._handles = [m.register_forward_hook(self._forward_hook(n))
                         for n, m in self.sites.items()]

    def _detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _forward_hook(self, name: str) -> Callable[..., None]:
        def hook(module: fp8.Fp8Linear, args: tuple[Any, ...], out: torch.Tensor) -> None:
            if self._armed is None or not isinstance(out, torch.Tensor) \
                    or not out.requires_grad or not module.recipe.any_fp8:
                return
            x = args[0].detach()
            dev = x.device.type
            out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) \
                else x.dtype
            if self.mode == SHADOW:
                self._outputs.append(out)
            out.register_hook(self._grad_hook(name, module, x, out_dtype))
        return hook

    def _grad_hook(self, name: str, module: fp8.Fp8Linear, x: torch.Tensor,
                   out_dtype: torch.dtype) -> Callable[[torch.Tensor], None]:
        held = [x]  # released when measured

        def hook(dy: torch.Tensor) -> None:
            if self._armed is None or not held:
                return
            _sync(dy.device)  # the audit's own time (a GPU runs it after the queued work)
            t0 = time.perf_counter()
            x = held.pop()
            recipe = module.recipe
            gemms = [g for g, c in recipe.choices().items() if c.dtype == "fp8"]
            got = gemm_energies(x, module.weight, dy, recipe, quantizer=module.quantizer,
                                emulate=module.emulate, out_dtype=out_dtype, gemms=gemms)
            acc = self._energy.setdefault(name, {})
            for g, e in got.items():
                acc[g] = acc[g] + e if g in acc else e
            _sync(dy.device)
            self.seconds += time.perf_counter() - t0
        return hook

    # -- deciding ------------------------------------------------------------------------

    def finish(self, step: int) -> dict[str, Fp8Recipe]:
        """After step ``step``'s backward: record its measurements, switch every fp8 GEMM
        under the bound to bf16 (all ranks alike: the lowest dB over ranks decides); returns
        the sites whose recipe changed."""
        if self._armed != step:
            return {}
        t0 = time.perf_counter()
        self._armed = None
        self._detach()
        measured = {n: {g: db_of(e) for g, e in gemms.items()}
                    for n, gemms in sorted(self._energy.items())}
        self._energy.clear()
        measured = self._lowest_over_ranks(measured)
        self.audits += 1
        changed: dict[str, Fp8Recipe] = {}
        for name, dbs in measured.items():
            if not dbs:
                continue
            self.series[name].append({"step": step, **{g: _json_db(v) for g, v in dbs.items()}})
            module = self.sites[name]
            low = [g for g in GEMMS if g in dbs and dbs[g] < self.bound_db]
            if not low:
                continue
            module.recipe = changed[name] = replace(module.recipe, **dict.fromkeys(low, BF16))
            for g in low:
                self.switches.append({"site": name, "gemm": g, "step": step,
                                      "sqnr_db": _json_db(dbs[g])})
                if not self.quiet:
                    warnings.warn(
                        f"gemc: WARNING fp8 audit: site {name}: its {g} GEMM measured "
                        f"{dbs[g]:.1f} dB at step {step}, under the {self.bound_db:g} dB "
                        f"bound the precision pass chose it by; it runs bf16 from step "
                        f"{step + 1} on (the run report's fp8_audit)", stacklevel=2)
        if changed and self.on_switch is not None:
            self.on_switch(changed)
        self.seconds += time.perf_counter() - t0
        return changed

    def _lowest_over_ranks(self, measured: dict[str, dict[str, float]]
                           ) -> dict[str, dict[str, float]]:
        """Every rank's decision the same: the lowest dB of each GEMM over the ranks (one a
        rank did not measure is +inf there; a measured one is at most :data:`MAX_DB`)."""
        if self.world_size == 1 or not dist.is_initialized():
            return measured
        names = list(self.sites)
        table = torch.full((len(names), len(GEMMS)), math.inf, dtype=torch.float64)
        for i, n in enumerate(names):
            for j, g in enumerate(GEMMS):
                if g in measured.get(n, {}):
                    table[i, j] = min(measured[n][g], MAX_DB)
        device = next(iter(self.sites.values())).weight.device
        table = table.to(device)
        dist.all_reduce(table, dist.ReduceOp.MIN)
        rows = table.cpu().tolist()
        return {n: {g: v for g, v in zip(GEMMS, row) if v != math.inf}
                for n, row in zip(names, rows)}

    # -- the report ----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The run report's ``fp8_audit``: per site its recipe at the start and now, the
        series of audited dB and its switches (each also in ``switches``, in order)."""
        return {
            "every": self.every, "off": self.off, "mode": None if self.off else self.mode,
            "bound_db": self.bound_db, "bound_source": self.bound_source,
            "audits": self.audits, "seconds": round(self.seconds, 3),
            "switched": len(self.switches), "switches": list(self.switches),
            "not_audited": self.not_audited,
            "sites": {n: {"recipe": _labels(self.initial[n]),
                          "recipe_now": _labels(m.recipe),
                          "series": self.series[n],
                          "switches": [s for s in self.switches if s["site"] == n]}
                      for n, m in self.sites.items()},
        }

    def close(self) -> None:
        self._detach()


def _sync(device: torch.device) -> None:
    """Wait for the device: ``seconds`` is what the audit costs, not host enqueue time
    (audited steps only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _labels(recipe: Fp8Recipe) -> dict[str, str]:
    return {g: c.label for g, c in recipe.choices().items()}


def fp8_sites(model: nn.Module) -> dict[str, fp8.Fp8Linear]:
    """The model's fp8 linears by fqn (what :func:`.precision.install` swapped in)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, fp8.Fp8Linear)}
