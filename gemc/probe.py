"""The precision probe: measured error of every GEMM site on representative tensors.

The precision pass needs to know how much a GEMM loses in bf16 or fp8 *on this model's
tensors*: activations with outlier tokens, gradients concentrated on few samples and
weights at their initial scale behave nothing like Gaussian test matrices. So the probe:

1. **builds the model on the CPU** through its entrypoint: on meta first, then big embedding
   tables are *folded* (rows beyond ``fold_rows`` alias ``id % fold_rows``; every row is
   i.i.d. N(0, 1) at init -- the runner's init too -- so the pooled activations have the same
   distribution), then ``to_empty`` and a deterministic init: each module's own
   ``reset_parameters`` under a seed derived from its FQN (the runner's recipe);
2. **scales the batch down** to what a FLOP budget allows (8 samples for GEM h200) when
   the entrypoint takes ``batch_size``: GEMM error depends on the distribution of rows more
   than on their count, so M can shrink (the real M, N, K still price the gain). The one
   exception is the weight-gradient GEMM, which contracts over tokens: its row-wise scales
   see fewer tokens than at full batch, so its measured SQNR is mildly optimistic;
3. **runs a few fp32 training steps** (forward + backward, on ``make_batch(0..steps-1)``) and
   records, for every GEMM call (``F.linear``, einsum, bmm, matmul, mm, addmm, baddbmm),
   its operands and the gradient of its output, keyed by ``(innermost module path, op,
   index of that op's call in that module)`` -- the key the pass computes from the graph;
4. **measures SQNR** of each of the site's three GEMMs (forward, input gradient, weight
   gradient) in bf16 and, for the sites the pass asks about, in fp8 (row-wise and
   tensor-wise, through the very quantization code the runner executes,
   :mod:`gemc.backends.torch.fp8`), against fp32 (whose own error, ~140 dB, is far below
   anything measured), pooled over all calls: ``10 log10(sum ref^2 / sum (ref - test)^2)``;
5. keeps every region's inputs and output gradients so the pass can **check a block**: run
   the region alone, once in fp32 and once with a candidate assignment applied the way the
   runner applies a plan (bf16 autocast around it, fp32 scopes, fp8 linear swaps), and
   compare its outputs, input gradients and parameter gradients.

When the model cannot be materialised on a CPU in reasonable time (gem-xl's dense part
alone is 6 GB of fp32 weights) the probe raises :class:`ProbeSkipped` with the reason, and
the pass falls back to bf16 everywhere with a loud warning: fp8 is never chosen unmeasured.

The probe is a measured input of the compile, like calibration: the driver binds it to the
model (:func:`opener`) and hands it to the pass as ``PassContext.precision_probe``; the pass
reads it through :mod:`gemc.probe_types` and never rebuilds the model itself.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gemc import fp8_recipe
from gemc.backends.torch import fp8
from gemc.backends.torch.init import init_dense_
from gemc.entrypoint import AuthorBuild, load_entrypoint, load_model
from gemc.probe_types import (
    Assignment,
    BlockResult,
    Energy,
    ProbeConfig,
    ProbeOpener,
    ProbeSkipped,
    SiteKey,
    SiteStats,
)
from gemc.spec import ModelSpec, batch_size_of

GEMM_OPS = {
    "linear": "linear",
    "einsum": "einsum",
    "bmm": "bmm",
    "matmul": "matmul",
    "__matmul__": "matmul",
    "mm": "mm",
    "addmm": "addmm",
    "baddbmm": "baddbmm",
}
CANDIDATES = {"bf16": fp8_recipe.BF16, "fp8-row": fp8_recipe.FP8_ROW,
              "fp8-tensor": fp8_recipe.FP8_TENSOR}


# ----------------------------------------------------------------------------- energies


def outlier_ratio(t: torch.Tensor, dim: int) -> float:
    """max over slices of the slice amax, over their median (amax taken along ``dim``).

    1 for evenly scaled rows; large when a few tokens or features dominate -- then one
    tensor-wise scale leaves the other rows in e4m3's subnormals."""
    amax = torch.linalg.vector_norm(t.float(), ord=math.inf, dim=dim)
    if amax.numel() == 0:
        return 1.0
    med = float(amax.median())
    top = float(amax.max())
    if top == 0.0:
        return 1.0
    return math.inf if med == 0.0 else top / med


# ----------------------------------------------------------------------------- materialise


def derive_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}\x1fprobe\x1f{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class _FoldedEmbeddingBag(nn.EmbeddingBag):
    """An EmbeddingBag of fewer rows; ids wrap around (see the module doc)."""

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,  # noqa: A002
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(input % self.num_embeddings, offsets, per_sample_weights)


class _FoldedEmbedding(nn.Embedding):
    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return super().forward(input % self.num_embeddings)


def _fold(module: nn.Module, rows: int) -> nn.Module:
    dim = module.embedding_dim
    pad = module.padding_idx if module.padding_idx is not None and module.padding_idx < rows \
        else None
    common = {"max_norm": module.max_norm, "norm_type": module.norm_type,
              "scale_grad_by_freq": module.scale_grad_by_freq, "sparse": module.sparse,
              "padding_idx": pad, "device": "meta"}
    if isinstance(module, nn.EmbeddingBag):
        return _FoldedEmbeddingBag(rows, dim, mode=module.mode,
                                   include_last_offset=module.include_last_offset, **common)
    return _FoldedEmbedding(rows, dim, **common)


def _tables(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]


def _dense_params(model: nn.Module) -> int:
    table_params = {id(p) for n in _tables(model) for p in model.get_submodule(n).parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in table_params)


def _reset_fn(module: nn.Module) -> Callable[[], None] | None:
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def _batch_of(spec: ModelSpec) -> int | None:
    """The batch the model states (never a tensor's first dimension: see batch_size_of)."""
    return batch_size_of(spec)[0]


def _why_not_shrunk(
    batch: int | None, probe_batch: int | None, target: int, takes_batch: bool, smallest: int
) -> str:
    """The true reason the probe's batch stayed too large, for the skip message."""
    if batch is None:
        return ("the model states no batch size (ModelSpec.batch_size), so the probe "
                "cannot tell how many samples to keep")
    if not takes_batch:
        return f"the entrypoint takes no batch_size argument to shrink its batch of {batch}"
    if probe_batch is not None and probe_batch > target:
        return (f"rebuilt with batch_size={target}, the model still states a batch of "
                f"{probe_batch}")
    return (f"the batch is already {probe_batch or batch} samples (the probe keeps at least "
            f"{smallest}): one sample's forward is too large for a CPU probe")


def build_probe_model(
    entrypoint: str, args: Mapping[str, Any], config: ProbeConfig, *, fwd_flops: float = 0.0
) -> tuple[ModelSpec, dict[str, Any]]:
    """The model on the CPU with folded tables and deterministic weights, at the probe batch.

    ``fwd_flops``: the compiled graph's forward FLOPs at its own batch (to scale the
    budget check); raises :class:`ProbeSkipped` when over a budget."""
    args = dict(args)
    spec = load_model(entrypoint, args, device="meta")
    info: dict[str, Any] = {"batch": _batch_of(spec), "probe_batch": _batch_of(spec)}
    dense_bytes = 4 * _dense_params(spec.model)
    if dense_bytes > config.max_dense_bytes:
        raise ProbeSkipped(
            f"the dense weights ({dense_bytes / 1e9:.1f} GB fp32) exceed the probe's CPU "
            f"budget ({config.max_dense_bytes / 1e9:.1f} GB)"
        )
    batch = info["batch"]
    per_sample = fwd_flops / (batch or 1)
    target = config.max_batch
    if per_sample > 0:
        target = int(min(config.max_batch, max(config.min_batch,
                                               config.max_fwd_flops // per_sample)))
    takes_batch = "batch_size" in inspect.signature(load_entrypoint(entrypoint)).parameters
    if batch is not None and batch > target and takes_batch:
        spec = load_model(entrypoint, {**args, "batch_size": target}, device="meta")
        info["probe_batch"] = _batch_of(spec)
    probe_batch = info["probe_batch"] or batch or 1
    probe_flops = per_sample * probe_batch
    info["probe_fwd_flops"] = int(probe_flops)
    if probe_flops > 4 * config.max_fwd_flops:
        raise ProbeSkipped(
            f"one probe step would run {probe_flops:.2g} forward FLOPs on the CPU (budget "
            f"{config.max_fwd_flops:.2g}): "
            f"{_why_not_shrunk(batch, info['probe_batch'], target, takes_batch, config.min_batch)}"
        )
    model = spec.model
    # the tables' shapes as the entrypoint builds them (before folding): the author's
    # build below leaves exactly these on meta
    shapes = {(int(m.num_embeddings), int(m.embedding_dim))
              for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    # ... so the author's values of a table's weight are not there (the probe resets it)
    every_table = {n for n, m in model.named_modules()
                   if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    folded = []
    for name in _tables(model):
        module = model.get_submodule(name)
        if module.num_embeddings > config.fold_rows:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    _fold(module, config.fold_rows))
            folded.append(name)
    info["folded_tables"] = len(folded)
    # dense modules and folded tables: their reset_parameters under the probe's seed;
    # what no reset writes, the author's values (see init_dense_)
    model.to_empty(device="cpu")
    author = (AuthorBuild(spec.origin, shapes, derive_seed(config.seed, "author-build"))
              if spec.origin is not None else None)
    report = init_dense_(model, config.seed, author_build=author,
                         seed_for=lambda name: derive_seed(config.seed, name),
                         author_init={f for f, r in spec.init_recipes.items() if r.by_author
                                      and f.removesuffix(".weight") not in every_table})
    if report.author_tensors:
        info["author_init"] = report.author_tensors
    model.train()
    return spec, info


# ----------------------------------------------------------------------------- recording


@dataclass
class _GemmCall:
    key: SiteKey
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    module: nn.Module | None
    dy: torch.Tensor | None = None


@dataclass
class _RegionCall:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    return []


class _Recorder(TorchFunctionMode):
    """Records every GEMM call with the module that made it; hooks its output gradient."""

    def __init__(self, paths: Mapping[int, str], modules: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.paths, self.modules = paths, modules
        self.stack: list[str] = []
        self.counts: Counter[tuple[str, str]] = Counter()
        self.calls: list[_GemmCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = GEMM_OPS.get(getattr(func, "__name__", ""))
        if op is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return out
        path = self.stack[-1] if self.stack else ""
        index = self.counts[(path, op)]
        self.counts[(path, op)] += 1
        call = _GemmCall((path, op, index), func, _detach(args), _detach(kwargs),
                         self.modules.get(path))
        out.register_hook(lambda g, c=call: setattr(c, "dy", g.detach()))
        self.calls.append(call)
        return out


# ----------------------------------------------------------------------------- measuring


def _linear_operands(call: _GemmCall) -> tuple[torch.Tensor, torch.Tensor] | None:
    args = list(call.args) + [call.kwargs.get(k) for k in ("input", "weight")]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return (tensors[0], tensors[1]) if len(tensors) >= 2 else None


def _measure_linear(call: _GemmCall, stats: SiteStats, with_fp8: bool) -> None:
    """The three GEMMs of ``y = x W^T`` computed the way Fp8Linear computes them."""
    ops = _linear_operands(call)
    if ops is None or call.dy is None:
        return
    x, w = ops
    n, k = w.shape
    x2 = x.reshape(-1, k).float()
    dy2 = call.dy.reshape(-1, n).float()
    w = w.float()
    problems = {
        "fwd": (x2, w.t(), x2 @ w.t()),
        "dgrad": (dy2, w, dy2 @ w),
        "wgrad": (dy2.t(), x2, dy2.t() @ x2),
    }
    fp8_ok = with_fp8 and k % fp8_recipe.ALIGN == 0 and n % fp8_recipe.ALIGN == 0
    for gemm, (a, b, ref) in problems.items():
        for label, choice in CANDIDATES.items():
            if choice.dtype == "fp8" and not fp8_ok:
                continue
            stats.add(gemm, label, ref, fp8.gemm(a, b, choice, torch.float32, emulate=True))
        stats.add_outlier(gemm, max(outlier_ratio(a, 1), outlier_ratio(b, 0)))
    stats.calls += 1


def _gemm_operand_slots(call: _GemmCall) -> list[int]:
    """Positions (in the flattened floating tensors) of the two GEMM operands."""
    floats = [i for i, t in enumerate(_flat_tensors((call.args, call.kwargs)))
              if t.is_floating_point()]
    return floats[-2:] if call.key[1] in ("addmm", "baddbmm") else floats[:2]


def _replace_tensors(value: Any, new: Iterator[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return next(new)
    if isinstance(value, (list, tuple)):
        return type(value)(_replace_tensors(v, new) for v in value)
    if isinstance(value, dict):
        return {k: _replace_tensors(v, new) for k, v in value.items()}
    return value


def _round_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _run_generic(call: _GemmCall, bf16: bool) -> tuple[torch.Tensor, list[Any]]:
    """The op and its operand gradients in fp32, or as bf16 GEMMs compute them: operands
    and results rounded to bf16, products accumulated in fp32 (emulated: CPUs' native bf16
    matmul is slow, and its results are the same up to summation order)."""
    tensors = _flat_tensors((call.args, call.kwargs))
    slots = _gemm_operand_slots(call)
    rnd = _round_bf16 if bf16 else (lambda t: t)
    leaves = [rnd(t.detach().float()).requires_grad_(i in slots) if t.is_floating_point()
              else t for i, t in enumerate(tensors)]
    args, kwargs = _replace_tensors((call.args, call.kwargs), iter(leaves))
    with torch.enable_grad():
        out = call.func(*args, **kwargs)
        grads = torch.autograd.grad(out, [leaves[i] for i in slots], rnd(call.dy.float()),
                                    allow_unused=True)
    return rnd(out.detach()), [None if g is None else rnd(g) for g in grads]


def _measure_generic(call: _GemmCall, stats: SiteStats) -> None:
    """bf16 error of any other GEMM op, through autograd (fp8 runs only as nn.Linear)."""
    if call.dy is None or len(_gemm_operand_slots(call)) < 2:
        return
    ref_out, ref_grads = _run_generic(call, bf16=False)
    out, grads = _run_generic(call, bf16=True)
    stats.add("fwd", "bf16", ref_out, out)
    for gemm, ref, test in zip(("dgrad", "wgrad"), ref_grads, grads):
        if ref is not None and test is not None:
            stats.add(gemm, "bf16", ref, test)
    stats.calls += 1


# ----------------------------------------------------------------------------- blocks

@contextlib.contextmanager
def _autocast_scope(module: nn.Module, dtype: str) -> Iterator[None]:
    """The runner's per-module scope: fp32 turns autocast off inside (lifting bf16 inputs to
    fp32, as nothing casts there), bf16 turns it on."""
    stack: list[contextlib.AbstractContextManager] = []

    def pre(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if dtype == "fp32":
            ctx = torch.autocast("cpu", enabled=False)
            args = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                         else a for a in args)
        else:
            ctx = torch.autocast("cpu", dtype=torch.bfloat16)
        ctx.__enter__()
        stack.append(ctx)
        return args

    def post(_m: nn.Module, _a: Any, _o: Any) -> None:
        stack.pop().__exit__(None, None, None)

    handles = [module.register_forward_pre_hook(pre),
               module.register_forward_hook(post, always_call=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def applied(model: nn.Module, assignment: Assignment) -> Iterator[None]:
    """Apply an assignment to ``model`` as the runner would (undone on exit): fp8 recipes
    swap the linear for an emulated Fp8Linear, "bf16"/"fp32" add autocast scopes."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    with contextlib.ExitStack() as stack:
        try:
            for fqn in sorted(assignment):
                choice = assignment[fqn]
                if isinstance(choice, fp8_recipe.Fp8Recipe):
                    if not choice.any_fp8:
                        continue
                    parent_name, _, child = fqn.rpartition(".")
                    parent = model.get_submodule(parent_name) if parent_name else model
                    original = getattr(parent, child)
                    fp8.swap_linear(model, fqn, choice, emulate=True)
                    swapped.append((parent, child, original))
                else:
                    stack.enter_context(_autocast_scope(model.get_submodule(fqn), choice))
            yield
        finally:
            for parent, child, original in reversed(swapped):
                setattr(parent, child, original)


def _grad_sqnr(refs: Sequence[torch.Tensor | None], tests: Sequence[torch.Tensor | None],
               energy: Energy) -> None:
    for r, t in zip(refs, tests):
        if r is not None and t is not None:
            energy.add(r, t)


# ----------------------------------------------------------------------------- the probe

SMALL_FLOPS = 2e8
"""Below this many forward FLOPs per probe step the probe runs on one thread: its GEMMs are
so small that thread synchronisation costs more than it saves (on a loaded 2-core machine a
128x32x64 matmul takes 50 ms on two threads and 20 us on one)."""


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)



class Probe:
    """A materialised model, its recorded GEMM sites and region calls (see module doc)."""

    def __init__(self, spec: ModelSpec, info: dict[str, Any], config: ProbeConfig,
                 regions: Sequence[str], fp8_sites: set[SiteKey] | None = None) -> None:
        self.spec, self.info, self.config = spec, info, config
        self.fp8_sites = fp8_sites
        self.seconds = 0.0
        small = info.get("probe_fwd_flops", 0) < SMALL_FLOPS
        self.threads = 1 if small else torch.get_num_threads()
        self.model = spec.model
        self.sites: dict[SiteKey, SiteStats] = {}
        self.region_calls: dict[str, list[_RegionCall]] = {r: [] for r in regions if r}
        self._refs: dict[str, list[Any]] = {}
        with _threads(self.threads):
            self._record()

    @classmethod
    def open(cls, entrypoint: str, args: Mapping[str, Any], regions: Sequence[str],
             config: ProbeConfig | None = None, *, fwd_flops: float = 0.0,
             fp8_sites: set[SiteKey] | None = None) -> Probe:
        """Build, run and measure (see the module doc). ``fp8_sites``: the linear sites
        whose fp8 error to measure (None: all of them); bf16 is measured everywhere."""
        config = config or ProbeConfig()
        start = time.perf_counter()
        spec, info = build_probe_model(entrypoint, args, config, fwd_flops=fwd_flops)
        probe = cls(spec, info, config, regions, fp8_sites)
        probe.seconds = time.perf_counter() - start  # not in info: plans hold no timings
        return probe

    # -- the reference run
    def _record(self) -> None:
        model = self.model
        modules = dict(model.named_modules())
        paths = {id(m): n for n, m in modules.items()}
        recorder = _Recorder(paths, modules)
        handles = []
        def push(name: str) -> Callable[..., None]:
            def hook(_m: nn.Module, _a: Any) -> None:
                recorder.stack.append(name)
            return hook

        def pop(_m: nn.Module, _a: Any, _o: Any) -> None:  # returns None: output unchanged
            recorder.stack.pop()

        for name, module in modules.items():
            handles.append(module.register_forward_pre_hook(push(name)))
            handles.append(module.register_forward_hook(pop, always_call=True))
        for region in self.region_calls:
            if region in modules:
                handles += self._region_hooks(region, modules[region])
        try:
            for step in range(self.config.steps):
                batch = self.spec.make_batch(step, "cpu")
                recorder.counts.clear()
                recorder.calls.clear()
                torch.manual_seed(derive_seed(self.config.seed, f"step{step}"))
                with recorder:
                    loss = model(*batch)
                loss.backward()
                model.zero_grad(set_to_none=True)
                for call in recorder.calls:
                    self._measure(call)
                recorder.calls.clear()
        finally:
            for h in handles:
                h.remove()

    def _region_hooks(self, region: str, module: nn.Module) -> list[Any]:
        calls = self.region_calls[region]

        def pre(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls.append(_RegionCall(_detach(args), _detach(kwargs), [], []))

        def post(_m: nn.Module, _args: Any, _kwargs: Any, out: Any) -> None:
            call = calls[-1]
            for t in _flat_tensors(out):
                call.outputs.append(t.detach())
                call.grads.append(None)
                if t.requires_grad:
                    i = len(call.grads) - 1
                    t.register_hook(lambda g, c=call, i=i: c.grads.__setitem__(i, g.detach()))

        return [module.register_forward_pre_hook(pre, with_kwargs=True),
                module.register_forward_hook(post, with_kwargs=True)]

    def _measure(self, call: _GemmCall) -> None:
        module = call.module
        stats = self.sites.get(call.key)
        if stats is None:
            mtype = type(module).__qualname__ if module is not None else "?"
            stats = self.sites[call.key] = SiteStats(call.key, mtype)
        if call.key[1] == "linear" and isinstance(module, nn.Linear):
            _measure_linear(call, stats,
                            self.fp8_sites is None or call.key in self.fp8_sites)
        else:
            _measure_generic(call, stats)

    # -- queries
    def is_linear(self, fqn: str) -> bool:
        """Whether ``fqn`` is an nn.Linear (the only module fp8 can replace)."""
        try:
            return isinstance(self.model.get_submodule(fqn), nn.Linear)
        except AttributeError:
            return False

    def check_block(self, region: str, assignment: Assignment) -> BlockResult | None:
        """SQNR of ``region`` run alone under bf16 autocast + ``assignment`` vs fp32 (None
        for the root region or a region the probe did not see run)."""
        with _threads(self.threads):
            return self._check_block(region, assignment)

    def _check_block(self, region: str, assignment: Assignment) -> BlockResult | None:
        calls = self.region_calls.get(region) or []
        if not region or not calls:
            return None
        module = self.model.get_submodule(region)
        params = [p for p in module.parameters() if p.requires_grad]
        out_e, in_e, par_e = Energy(), Energy(), Energy()
        if region not in self._refs:  # the fp32 run of the block, once
            self._refs[region] = [self._run_region(module, call, params, None, i)
                                  for i, call in enumerate(calls)]
        for i, call in enumerate(calls):
            ref = self._refs[region][i]
            with applied(self.model, assignment):
                module = self.model.get_submodule(region)  # may itself have been swapped
                test = self._run_region(module, call, params, torch.bfloat16, i)
            module = self.model.get_submodule(region)
            for r, t in zip(ref[0], test[0]):
                out_e.add(r, t)
            _grad_sqnr(ref[1], test[1], in_e)
            _grad_sqnr(ref[2], test[2], par_e)
        return BlockResult(region, out_e.db, in_e.db, par_e.db)

    def _run_region(self, module: nn.Module, call: _RegionCall, params: list[torch.Tensor],
                    autocast: torch.dtype | None, index: int
                    ) -> tuple[list[torch.Tensor], list[Any], list[Any]]:
        tensors = _flat_tensors((call.args, call.kwargs))
        leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
        args, kwargs = _replace_tensors((call.args, call.kwargs), iter(leaves))
        torch.manual_seed(derive_seed(self.config.seed, f"region{index}"))
        ctx = (torch.autocast("cpu", dtype=autocast) if autocast is not None
               else contextlib.nullcontext())
        with torch.enable_grad(), ctx:
            outs = _flat_tensors(module(*args, **kwargs))
        pairs = [(o, g if g is not None else torch.zeros_like(o))
                 for o, g in zip(outs, call.grads) if o.requires_grad]
        inputs = [t for t in leaves if t.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], inputs + params,
                                    [g.to(o.dtype) for o, g in pairs], allow_unused=True)
        return ([o.detach().float() for o in outs], list(grads[: len(inputs)]),
                list(grads[len(inputs):]))


def opener(entrypoint: str, args: Mapping[str, Any]) -> ProbeOpener:
    """The probe bound to a model's entrypoint and arguments: what the driver hands the
    precision pass (``PassContext.precision_probe``), which says what to measure."""
    return functools.partial(Probe.open, entrypoint, dict(args))
