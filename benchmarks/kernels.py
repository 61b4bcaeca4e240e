"""gemc's Triton kernels against eager PyTorch and torch.compile, side by side.

    python benchmarks/kernels.py [--preset h200] [--cases attention,silu,embedding,jagged]
                                 [--no-compile] [--no-causal] [--out results.json]
    python benchmarks/kernels.py --cases zoo --out $OUT/zoo_attention.json   # H200, < 4 min
    python benchmarks/kernels.py --cases narrow --out $OUT/narrow.json       # H200, < 40 s
    python benchmarks/kernels.py --cases narrow_group --out $OUT/group.json  # H200, < 40 s
    TRITON_INTERPRET=1 python benchmarks/kernels.py --smoke --no-compile   # CPU, tiny

Cases (each timed as forward only and as forward+backward, per variant):

* ``attention``: jagged softmax attention (``jagged_attention``) vs the same math on padded
  ``[B, H, L, D]`` tensors through ``F.scaled_dot_product_attention`` with a boolean
  key-padding (and causal) mask, eager and under ``torch.compile``. The padded inputs are
  made before timing, so the baseline is not charged for padding. Target: >= 2x at 50% fill.
* ``silu``: jagged HSTU silu attention vs the padded formulation written out.
* ``query``: padded history queries ``[B, H, L, D]`` (rows past each length are padding)
  over ``QUERY_KEYS`` dense candidate keys (``jagged_query_attention``: only the real query
  rows computed) vs padded SDPA with no mask, eager and compiled. Expected: ~the fill (50%).
* ``embedding``: one training step (pooled lookup, backward, optimizer) of
  ``BatchedEmbeddingBag`` (fused lazy Adam, and fused row-wise Adagrad) vs one
  ``nn.EmbeddingBag`` per table with dense gradients and ``AdamW`` (fused on CUDA), eager and
  compiled, and vs ``nn.EmbeddingBag(sparse=True)`` + ``SparseAdam`` (the eager lazy-Adam
  equivalent). Target: fused Adam >= 3x EmbeddingBag + dense AdamW. The fused row-wise
  Adagrad also runs with its tables stored bf16 and fp8 (row-scaled e4m3, issue 21): the
  same step reading and rewriting narrower rows (stochastically rounded).
* ``jagged``: ``jagged_to_padded`` vs its ``index_put`` formulation (eager, compiled), and
  ``padded_to_jagged`` vs its gather formulation.
* ``silu_variants`` (not in the default set): HSTU's attention at the ``zoo`` case's shape
  (``h200``: B=128, L=512, 4 heads of 128, causal, ~50% fill, bf16), gemc's kernel in each
  of :data:`SILU_VARIANTS` (exact or fast sigmoid, two backward kernels or one with atomic
  dq, heuristic or autotuned configs, with and without HSTU's ``[B, 1, L, L]`` relative
  bias, the old dk/dv kernel or the key-block one of ``silu_key_block_backward``) against
  padded masked SDPA; each variant
  checked against the padded formula in fp32 (output and every gradient). The JSON's
  ``silu_variants`` section has per variant the ms, the speedup over the fastest masked
  SDPA, the error and the configs it ran. H200, < 3 min:
  ``python benchmarks/kernels.py --cases silu_variants --out $OUT/silu_variants.json``.
* ``narrow`` (not in the default set): is gemc's pooled lookup slow on narrow shards?
  TorchRec's estimator charges shards under 128 columns 1.15x and under 64 1.75x per byte
  (a block penalty); gemc's cost model charges whole 32-byte sectors per row. One table of
  ``NARROW`` shape (DLRMv2-like: 40M rows, local batch 4,096, pooling 100 and 12 ids a
  bag) at widths 8, 16, 32, 64, 128: gemc's ``BatchedEmbeddingBag`` (fp32, fused row-wise
  Adagrad in its backward) forward and forward+backward+optimizer, vs ``nn.EmbeddingBag``
  (``sparse=True``) forward, forward+backward, and + ``torch.optim.Adagrad``. Each row
  has ms, GB/s of rows read (``width x 4`` bytes a row, and the 32-byte sectors it spans)
  and the time per column relative to the 128-wide shard (the JSON's ``narrow`` section;
  1.0 = no penalty, 16 = a width-8 shard as slow as a 128-wide one). Every width's forward
  and one fused step (its touched rows after row-wise Adagrad, from PyTorch's sparse
  gradient) are checked against PyTorch with ``assert_close`` before timing. H200, < 40 s:
  ``python benchmarks/kernels.py --cases narrow --out $OUT/narrow.json``.
* ``narrow_group`` (not in the default set): does each shard of a rank's batched kernel
  pay the ``narrow`` case's fixed ~0.85 ms step, or the kernel once? (The cost model
  assumes once: ``cost_model.step_model.batched_floor_s``.) ``k`` = 1, 2, 4, 8 shards 16
  wide (``NARROW``'s rows / 8 each, its batch, pooling 100) in one ``BatchedEmbeddingBag``
  against ``k`` modules of one shard each, stepped one after another: forward+backward+
  fused row-wise Adagrad, ms (both forms' pooled outputs checked equal first, from the same
  weights). The JSON's ``narrow_group`` section has per ``k`` both times;
  a floor per kernel shows as a flat first column and a second growing ~0.85 ms a shard.
* ``narrow_split`` (not in the default set): what the second pass of a column shard's
  row-wise Adagrad costs (``BatchedEmbeddingBag.split_rows``: the backward computes the
  touched rows' squares over the shard's columns, the optimizer step sums them over the
  column group and updates; the collective is not on one GPU). ``NARROW``'s rows, batch
  and pooling 100, shards 16, 32 and 64 of a 128-wide row and the whole row: two phases
  against the one-pass step of the same shard, ms (the JSON's ``narrow_split`` section).
  H200, < 40 s: ``python benchmarks/kernels.py --cases narrow_split --out $OUT/split.json``.
  ``--narrow-batch``, ``--narrow-rows`` and ``--narrow-poolings`` change the shard (a DLRMv2
  column piece serves the global batch: ``--narrow-batch 65536 --narrow-poolings 100``);
  each ``narrow_split`` row carries gemc's model's price of it (``predicted_*_ms``), and
  ``benchmarks/fit_lookup_price.py`` fits that price to a set of these files.
* ``zoo`` (not in the default set): each zoo model with a history, its attention at the
  model's own preset shapes (``h200``; ``tiny`` under ``--smoke``), lengths uniform in 1..L
  (~50% fill; TransAct's: its own batch and additive key mask, every query row computed,
  through the guarded ``key_padding_attention`` its graph calls): gemc's kernel vs padded
  ``F.scaled_dot_product_attention`` with the
  padding mask (PyTorch's backend choice; cuDNN and memory-efficient forced; flash with no
  padding mask as the padded floor) and, for HSTU, vs the padded SiLU formula (eager and
  compiled). The JSON's ``zoo`` section has per model the fwd+bwd speedups (target: >= 2x
  over padded masked SDPA).

Timing: on CUDA ``triton.testing.do_bench`` (warmup, L2 flushed between runs, median of the
repetitions); on CPU (``--smoke`` under the interpreter, only to check that nothing crashes)
one warm-up and one wall-clock run. Every case also checks the Triton result against the
eager one at the benchmark's size (max abs error in the table and the JSON), so a GPU run
doubles as a numerical check of the compiled kernels. A variant that fails (out of memory, a
compile error) is recorded with its error and the others still run. Prints a table and,
with ``--out``, writes JSON: environment, preset, one row per (case, mode, variant), and the
two targets with their measured speedups.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Preset:
    batch: int  # sequences for attention / jagged, samples for embeddings
    max_len: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    tables: int
    rows: tuple[int, int]  # log-uniform range of rows per table
    dims: tuple[int, ...]  # dims drawn from these
    pooling: tuple[int, int]  # ids per bag, uniform in this range
    jagged_dim: int  # feature width of the jagged <-> padded case


PRESETS = {
    "h200": Preset(batch=4096, max_len=512, heads=4, head_dim=64, dtype=torch.bfloat16,
                   tables=100, rows=(100_000, 1_000_000), dims=(64, 128), pooling=(1, 30),
                   jagged_dim=256),
    "smoke": Preset(batch=3, max_len=20, heads=2, head_dim=16, dtype=torch.bfloat16,
                    tables=3, rows=(50, 100), dims=(8, 16), pooling=(0, 5), jagged_dim=8),
}

@dataclasses.dataclass(frozen=True)
class Narrow:
    """One embedding shard of the ``narrow`` case: ``rows`` x each of ``widths``, ``batch``
    bags of each of ``poolings`` ids (fixed, as DLRMv2's multi-hot features)."""

    rows: int
    batch: int
    poolings: tuple[int, ...]
    widths: tuple[int, ...] = (8, 16, 32, 64, 128)


NARROW = {"h200": Narrow(rows=40_000_000, batch=4096, poolings=(100, 12)),
          "smoke": Narrow(rows=1000, batch=4, poolings=(5, 2))}

TARGETS = {
    "attention": ("jagged softmax attention fwd+bwd vs padded SDPA (eager)", 2.0),
    "embedding": ("fused lazy-Adam embedding step vs EmbeddingBag + dense AdamW (eager)", 3.0),
}


# ---------------------------------------------------------------------------------------
# timing and bookkeeping
# ---------------------------------------------------------------------------------------


def bench_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 25, rep: int = 100
             ) -> float:
    """Median milliseconds of ``fn``: CUDA events through do_bench (``warmup`` and ``rep``
    ms of runs), or wall clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep,
                                             return_mode="median"))
    fn()  # warm up (compiles, autotunes); the CPU run only checks that nothing crashes
    times = []
    for _ in range(1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@dataclasses.dataclass
class Row:
    case: str
    mode: str
    variant: str
    ms: float | None = None
    baseline: bool = False
    speedup: float | None = None  # baseline ms / this ms
    throughput: str = ""
    max_abs_err: float | None = None
    error: str | None = None


class Recorder:
    """Runs variants (catching failures), computes speedups against the case's baseline."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rows: list[Row] = []
        self.timing: dict[str, int] = {}  # bench_ms's warmup / rep (ms), where not default

    def run(self, case: str, mode: str, variant: str, fn: Callable[[], Any], *,
            baseline: bool = False, work: float | None = None, unit: str = "TFLOP/s") -> Row:
        row = Row(case, mode, variant, baseline=baseline)
        try:
            row.ms = bench_ms(fn, self.device, **self.timing)
            if work:
                row.throughput = f"{work / row.ms / 1e9:.3g} {unit}"
        except Exception as exc:  # noqa: BLE001 - a failed variant is a result, not a crash
            row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        finally:
            _free(self.device)
        self.rows.append(row)
        return row

    def check(self, case: str, variant: str, err: float) -> None:
        for row in self.rows:
            if row.case == case and row.variant == variant:
                row.max_abs_err = err

    def finish(self) -> None:
        for row in self.rows:
            base = next((r for r in self.rows if r.case == row.case and r.mode == row.mode
                         and r.baseline and r.ms), None)
            if base is not None and row.ms:
                row.speedup = base.ms / row.ms


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _compiled(fn: Callable, enabled: bool) -> Callable | None:
    return torch.compile(fn) if enabled else None


def _lengths(preset: Preset, gen: torch.Generator) -> torch.Tensor:
    """Uniform in [1, max_len]: mean fill ~50% of max_len."""
    return torch.randint(1, preset.max_len + 1, (preset.batch,), generator=gen, device="cpu")


def _offsets(lengths: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device)


# ---------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------


def attention_case(rec: Recorder, p: Preset, kind: str, causal: bool, compile_: bool,
                   gen: torch.Generator, label: str = "", sdpa: bool = False) -> None:
    """``label`` prefixes the case's name (a zoo model's); ``sdpa``: also the padded SDPA
    variants of :func:`_sdpa_variants` (for ``silu``, SDPA with the same padding mask as a
    reference of what a tuned padded attention costs at these shapes)."""
    from gemc.backends.triton import jagged_attention, jagged_to_padded, padded_to_jagged

    dev = rec.device
    case = f"{label}{kind} attention{' causal' if causal else ''}"
    lengths = _lengths(p, gen)
    offsets = _offsets(lengths, dev)
    total, L, H, D = int(lengths.sum()), p.max_len, p.heads, p.head_dim
    scale = 1.0 / math.sqrt(D)
    q, k, v, g = (torch.randn(total, H, D, generator=gen, device="cpu").to(dev, p.dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    pos = torch.arange(L, device=dev)
    lens = lengths.to(dev)
    visible = (pos[None, None, :] < lens[:, None, None]).expand(-1, L, -1)
    if causal:
        visible = visible & (pos[:, None] >= pos[None, :])
    visible = visible[:, None]  # [B, 1, L, L]
    safe = visible | ~visible.any(-1, keepdim=True)  # padded query rows: keep SDPA finite
    with torch.no_grad():
        padded = [jagged_to_padded(x, offsets, L).transpose(1, 2).contiguous()
                  for x in (q, k, v, g)]
    qp, kp, vp, gp = padded
    for x in (qp, kp, vp):
        x.requires_grad_()
    work = sum(4.0 * H * D * n * n * (0.5 if causal else 1.0) for n in lengths.tolist())

    def triton_fwd():
        return jagged_attention(q, k, v, offsets, L, scale=scale, causal=causal, kind=kind)

    if kind == "softmax":
        def padded_fwd(qp, kp, vp):
            return torch.nn.functional.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=safe, scale=scale)
    else:
        def padded_fwd(qp, kp, vp):
            s = (qp @ kp.transpose(-1, -2)) * scale
            return (torch.nn.functional.silu(s) * visible / L) @ vp

    compiled = _compiled(padded_fwd, compile_)
    variants = [("triton jagged", lambda: triton_fwd(), (q, k, v), g, False),
                ("eager padded", lambda: padded_fwd(qp, kp, vp), (qp, kp, vp), gp, True)]
    if compiled is not None:
        variants.append(("compiled padded", lambda: compiled(qp, kp, vp), (qp, kp, vp), gp,
                         False))
    if sdpa:
        for name, fn in _sdpa_variants(safe, scale, causal, kind == "silu", dev):
            variants.append((name, lambda fn=fn: fn(qp, kp, vp), (qp, kp, vp), gp, False))
    for name, fwd, inputs, grad, is_base in variants:
        with torch.no_grad():
            rec.run(case, "fwd", name, fwd, baseline=is_base, work=work)
        rec.run(case, "fwd+bwd", name,
                lambda fwd=fwd, inputs=inputs, grad=grad: torch.autograd.grad(fwd(), inputs,
                                                                              grad),
                baseline=is_base, work=3.5 * work)
    try:  # the Triton result against eager padded, at this size
        out = triton_fwd()
        dq = torch.autograd.grad(out, (q,), g)[0]
        ref = padded_fwd(qp, kp, vp)
        dq_ref = torch.autograd.grad(ref, (qp,), gp)[0]
        err = max((out - padded_to_jagged(ref.transpose(1, 2), offsets, total)).abs().max(),
                  (dq - padded_to_jagged(dq_ref.transpose(1, 2), offsets, total)).abs().max())
        rec.check(case, "triton jagged", err.item())
    except Exception as exc:  # noqa: BLE001
        print(f"[{case}] check skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
    _free(dev)


def _run_variants(rec: Recorder, case: str,
                  variants: list[tuple[str, Callable[[], torch.Tensor], bool]],
                  inputs: tuple[torch.Tensor, ...], grad: torch.Tensor, work: float) -> None:
    """Each ``(name, fwd, is_baseline)`` of ``variants`` timed forward (no grad) and forward
    + backward (the gradients of ``inputs`` under ``grad``); the backward counts 2.5x the
    forward's ``work``."""
    for name, fwd, is_base in variants:
        with torch.no_grad():
            rec.run(case, "fwd", name, fwd, baseline=is_base, work=work)
        rec.run(case, "fwd+bwd", name,
                lambda fwd=fwd: torch.autograd.grad(fwd(), inputs, grad),
                baseline=is_base, work=3.5 * work)


def _sdpa_variants(mask: torch.Tensor, scale: float, causal: bool, with_default: bool,
                   device: torch.device) -> list[tuple[str, Callable[..., torch.Tensor]]]:
    """Padded ``F.scaled_dot_product_attention`` variants on ``[B, H, L, D]``: with the
    padding (and causal) mask, PyTorch's own backend choice (``with_default``: the softmax
    case's ``eager padded`` already is that one), cuDNN forced (recorded as failed where it
    refuses the mask) and the memory-efficient kernel forced; and flash with ``is_causal``
    and no padding mask, which computes the padding as real tokens (not the model's result:
    the speed of a padded flash attention, a floor for any padded SDPA). Forced backends
    only on CUDA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa_fn = torch.nn.functional.scaled_dot_product_attention

    def masked(backend: Any = None) -> Callable[..., torch.Tensor]:
        def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if backend is None:
                return sdpa_fn(q, k, v, attn_mask=mask, scale=scale)
            with sdpa_kernel([backend]):
                return sdpa_fn(q, k, v, attn_mask=mask, scale=scale)
        return fn

    def flash_no_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return sdpa_fn(q, k, v, is_causal=causal, scale=scale)

    out = [("sdpa padded (softmax, masked)", masked())] if with_default else []
    if device.type == "cuda":
        out += [("sdpa padded cudnn (masked)", masked(SDPBackend.CUDNN_ATTENTION)),
                ("sdpa padded efficient (masked)", masked(SDPBackend.EFFICIENT_ATTENTION)),
                ("sdpa padded flash (no padding mask)", flash_no_mask)]
    return out


def _zoo_attentions(preset: str) -> list[tuple[str, dict[str, Any]]]:
    """Per zoo model with a history, its attention at the model's ``preset`` shapes (read
    from the model's own ``PRESETS``): batch, padded length, heads, head dim, score
    function, causal. The history's lengths are the benchmark's (uniform in 1..L: ~50%
    fill). BST's history has its target appended (L + 1 keys: a mask that is no prefix, which
    gemc runs compacted over the kept keys: the same kernel over as many tokens). DIN's
    target attention is an MLP over the history (no attention kernel); DLRM-DCNv2 and
    Wukong have no history."""
    repo = Path(__file__).resolve().parent.parent
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from examples.zoo import hstu, mmoe, sasrec_bst

    h = hstu.PRESETS[preset]
    b = sasrec_bst.PRESETS[preset]
    m = mmoe.PRESETS[preset]
    return [
        ("hstu", dict(batch=h.batch_size, max_len=h.max_seq_len, heads=h.num_heads,
                      head_dim=h.attention_dim, kind="silu", causal=True)),
        ("sasrec_bst", dict(batch=b.batch_size, max_len=b.max_len + 1, heads=b.num_heads,
                            head_dim=(b.item_dim + b.cate_dim) // b.num_heads,
                            kind="softmax", causal=False)),
        ("mmoe", dict(batch=m.batch_size, max_len=m.max_len, heads=m.num_heads,
                      head_dim=m.d // m.num_heads, kind="softmax", causal=True)),
    ]


ZOO_TIMED = ("hstu", "sasrec_bst", "mmoe", "transact")
"""The zoo models whose attention :func:`zoo_case` times (:func:`_zoo_attentions`, and
TransAct's in :func:`transact_case`)."""
ZOO_NOT_TIMED = {
    "din": "target attention is an MLP over the history: no attention kernel",
    "dlrm_dcnv2": "no history",
    "wukong": "no history",
}


def zoo_case(rec: Recorder, p: Preset, preset: str, compile_: bool,
             gen: torch.Generator, models: tuple[str, ...] = ZOO_TIMED) -> dict[str, Any]:
    """Each zoo model's attention (:func:`_zoo_attentions`), forward and forward+backward:
    gemc's jagged kernel against the padded SDPA variants and, for HSTU, the padded SiLU
    formula (eager, and compiled unless ``--no-compile``: Inductor's fused pointwise is
    what runs without gemc); then TransAct's (:func:`transact_case`, whose facts it
    returns for the JSON's ``zoo`` section). ``models``: only these (``--zoo-models``)."""
    for model, shape in _zoo_attentions(preset):
        if model not in models:
            continue
        kind, causal = shape.pop("kind"), shape.pop("causal")
        attention_case(rec, dataclasses.replace(p, **shape), kind, causal,
                       compile_ and kind == "silu", gen, label=f"{model}: ", sdpa=True)
    return {"transact": transact_case(rec, p.dtype, preset, gen)} if "transact" in models \
        else {}


TRANSACT_WINDOW_MS = 30 * 60 * 1000
"""The time window the ``transact`` row masks (the model draws it uniform in 0..1 h per
training step; its mean)."""


def transact_case(rec: Recorder, dtype: torch.dtype, preset: str, gen: torch.Generator
                  ) -> dict[str, Any]:
    """TransAct's encoder attention as its compiled graph runs it: the model's own batch
    (``synthetic_batch`` at ``preset``: lengths uniform in 0..S, the latest actions inside
    a :data:`TRANSACT_WINDOW_MS` window masked, position 0 always kept) and its mask as the
    model builds it (additive 0 / -inf, in general no prefix), every query row computed
    (its un-masked max pool reads them): gemc's guarded ``key_padding_attention`` (keys
    compacted, then each row's key loop stops at its kept count; the work is ``S * kept``
    a row against padded ``S * S``, so at most ~2x at this fill) against padded SDPA with
    the same mask. q, k, v are random at the model's head shape (the projections are not
    timed). The error column is relative (see the check). Returns the mean kept keys a row
    and the guard's path counts over the timed calls."""
    from gemc.backends.triton import key_padding_attention as kpa

    dev = rec.device
    batch = transact_batch(preset, gen, dev)
    mask, kept, scale = batch.mask, batch.kept, batch.scale
    b, s, h, head_dim = batch.shape
    case = "transact: softmax attention, additive key mask"
    q, k, v, g = (torch.randn(b, h, s, head_dim, generator=gen).to(dev, dtype)
                  for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    sdpa_mask = mask[:, None, None, :].to(dtype)
    work = 4.0 * h * head_dim * s * float(kept.sum())

    def gemc_fwd() -> torch.Tensor:
        return kpa.key_padding_attention(q, k, v, mask, scale=scale, additive=True,
                                         zero_padding_queries=False)

    def sdpa_fwd(qp: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(qp, kp, vp,
                                                                attn_mask=sdpa_mask,
                                                                scale=scale)

    variants = [("triton jagged", gemc_fwd, False), ("eager padded", lambda: sdpa_fwd(q, k, v),
                                                     True)]
    variants += [(name, lambda fn=fn: fn(q, k, v), False)
                 for name, fn in _sdpa_variants(sdpa_mask, scale, False, False, dev)]
    kpa.STATS.reset()
    _run_variants(rec, case, variants, (q, k, v), g, work)
    paths = kpa.STATS.as_dict()
    _transact_region_variant(rec, case, batch, dtype, gen, work)
    if dev.type == "cuda":
        _varlen_block_sweep(rec, case, gemc_fwd, (q, k, v), g, work)
    try:  # gemc's result against padded SDPA in fp32: output and the three gradients, each
        # error over the larger of 1 and the reference's largest magnitude (dk and dv sum
        # over all S queries: their bf16 rounding alone is ~0.03 at magnitude 8)
        got = [gemc_fwd()]
        got += torch.autograd.grad(got[0], (q, k, v), g)
        ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
        want = [torch.nn.functional.scaled_dot_product_attention(
            *ref_in, attn_mask=mask[:, None, None, :], scale=scale)]
        want += torch.autograd.grad(want[0], ref_in, g.float())
        rec.check(case, "triton jagged",
                  max(float((a.detach().float() - w).abs().max() / max(1.0, w.abs().max()))
                      for a, w in zip(got, want)))
    except Exception as exc:  # noqa: BLE001
        print(f"[{case}] check skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
    _free(dev)
    return {"seq_len": s, "mean_kept_keys": float(kept.float().mean()),
            "window_ms": TRANSACT_WINDOW_MS, "guard_paths": paths}


REGION_VARIANT = "triton packed region (representatives)"


@dataclasses.dataclass
class TransactBatch:
    """TransAct's attention inputs as its model draws them (:func:`transact_batch`)."""

    types: torch.Tensor
    """``[B, S]`` action types (``<= 0``: padding, at each row's end)."""
    mask: torch.Tensor
    """``[B, S]`` additive key mask (0 / -inf), on the device."""
    kept: torch.Tensor
    """``[B]`` kept keys a row."""
    shape: tuple[int, int, int, int]
    """(B, S, heads, head dim)."""
    scale: float


def transact_batch(preset: str, gen: torch.Generator, dev: torch.device) -> TransactBatch:
    """TransAct's batch at ``preset`` (``synthetic_batch``: lengths uniform in 0..S) and its
    key mask as the model builds it (padding or the latest actions inside a
    :data:`TRANSACT_WINDOW_MS` window masked, position 0 always kept), at its head shape.
    Shared by :func:`transact_case` and ``benchmarks/attention_gpu_time.py``."""
    from examples.zoo import transact

    cfg = transact.PRESETS[preset]
    types, _, times, request_time, *_ = transact.synthetic_batch(
        cfg, 0, int(torch.randint(0, 2**31, (1,), generator=gen)))
    d = cfg.action_dim + 2 * cfg.item_dim
    b, s, h = cfg.batch_size, cfg.seq_len, cfg.num_heads
    drop = (types <= 0) | ((request_time[:, None] - times) < TRANSACT_WINDOW_MS)
    drop[:, 0] = False
    mask = torch.zeros(b, s).masked_fill_(drop, float("-inf")).to(dev)
    return TransactBatch(types, mask, (~drop).sum(1), (b, s, h, d // h),
                         1.0 / math.sqrt(d // h))


@dataclasses.dataclass
class TransactRegion:
    """TransAct's attention in its packed region (:func:`transact_region`)."""

    layout: Any
    """The region's ``TokenLayout`` with padding representatives."""
    inputs: tuple[torch.Tensor, ...]
    """q, k, v ``[1, H, T, D]`` (requiring grad) and the output gradient."""
    dims: tuple[tuple[int, int], ...]
    mask: torch.Tensor
    scale: float

    def fwd(self) -> torch.Tensor:
        """The region's attention (``packed_tokens.rep_attention``), as both runners call
        it."""
        from gemc.backends.triton import packed_tokens as pt

        q, k, v, _ = self.inputs
        return pt.rep_attention(q, k, v, self.dims, self.layout, self.mask, True, self.scale)

    def padded_reference(self) -> torch.Tensor:
        """fp32 SDPA on the padded values the representatives scatter to, gathered back."""
        from gemc.backends.triton import packed_tokens as pt

        padded = [pt.scatter(x.detach().float(), (0, 2), self.layout)
                  for x in self.inputs[:3]]
        return pt.gather(torch.nn.functional.scaled_dot_product_attention(
            *padded, attn_mask=self.mask[:, None, None, :], scale=self.scale), (0, 2), 4,
            self.layout)


def transact_region(batch: TransactBatch, dtype: torch.dtype, gen: torch.Generator,
                    dev: torch.device) -> TransactRegion:
    """TransAct's attention as its compiled graph runs it since its tower packs over padding
    representatives (``passes/pad_reps``): ``packed_tokens.rep_attention`` on the region's
    tokens (each row's real actions and one representative of its padding), each key
    biased by the mask entries it stands for, with no per-call check (the region's one
    check runs ahead of the graph). Laid out as the region lays TransAct's batch out
    (padding, ``action_types <= 0``, at each row's end: ``min(len + 1, S)`` slots a row);
    q, k, v random at the model's head shape."""
    from gemc.backends.triton import packed_tokens as pt

    b, s, h, head_dim = batch.shape
    lengths = (batch.types > 0).sum(1).to(dev)
    layout = pt.with_rep_weights(pt.TokenLayout(
        pt.rep_offsets(lengths, s), int((lengths + 1).clamp(max=s).sum()), b, s))
    inputs = tuple(torch.randn(1, h, layout.total, head_dim, generator=gen).to(dev, dtype)
                   for _ in range(4))
    for x in inputs[:3]:
        x.requires_grad_()
    return TransactRegion(layout, inputs, ((0, 2),) * 4, batch.mask, batch.scale)


def _transact_region_variant(rec: Recorder, case: str, batch: TransactBatch,
                             dtype: torch.dtype, gen: torch.Generator, work: float) -> None:
    """:func:`transact_region` timed (the per-call variants above time the guarded op a
    graph without the region calls) and checked against padded SDPA on the values the
    representatives scatter to."""
    region = transact_region(batch, dtype, gen, rec.device)
    qp, kp, vp, gp = region.inputs
    _run_variants(rec, case, [(REGION_VARIANT, region.fwd, False)], (qp, kp, vp), gp, work)
    want = region.padded_reference()
    got = region.fwd()
    rec.check(case, REGION_VARIANT,
              float((got.detach().float() - want.detach()).abs().max()
                    / max(1.0, float(want.detach().abs().max()))))
    _free(rec.device)


VARLEN_BLOCKS = ((32, 32, 4), (32, 64, 4), (64, 32, 4), (64, 64, 8), (128, 32, 4),
                 (128, 64, 4), (128, 64, 8))
"""(BLOCK_M, BLOCK_N, warps) the ``transact`` row also times on a GPU, next to the varlen-key
kernel's fixed choice (64, 64, 4 warps): is that choice what holds it back at TransAct's
shape (100 queries, ~half the keys kept, head dim 48)?"""


def _varlen_block_sweep(rec: Recorder, case: str, fwd: Callable[[], torch.Tensor],
                        inputs: tuple[torch.Tensor, ...], grad: torch.Tensor,
                        work: float) -> None:
    """``fwd`` fwd+bwd with the varlen-key kernels' block choice replaced by each of
    :data:`VARLEN_BLOCKS` (the module's ``_blocks``, patched for the timing only, and put
    back), one row each, named by the blocks."""
    from gemc.backends.triton import varlen_key_attention as vka

    chosen = vka._blocks
    for bm, bn, warps in VARLEN_BLOCKS:
        def blocks(q: torch.Tensor, bm: int = bm, bn: int = bn, warps: int = warps) -> dict:
            return {**chosen(q), "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps}

        vka._blocks = blocks
        try:
            rec.run(case, "fwd+bwd", f"triton jagged, blocks {bm}x{bn}, {warps} warps",
                    lambda: torch.autograd.grad(fwd(), inputs, grad), work=3.5 * work)
        finally:
            vka._blocks = chosen


def zoo_summary(rows: list[Row]) -> dict[str, Any]:
    """Per zoo model, forward+backward ms of gemc's jagged attention and its speedup over
    padded SDPA with the padding mask (PyTorch's backend choice: the softmax case's
    ``eager padded``, HSTU's ``sdpa padded (softmax, masked)``; and the fastest masked
    backend forced), over flash on the padded tensors without the mask and, for HSTU, over
    the padded SiLU formula. The issue's target: >= 2x over padded masked SDPA. gemc's
    figure is the form its compiled model runs: TransAct's attention in its packed region
    (:data:`REGION_VARIANT`: the compiled graph runs it there since its tower packs over
    padding representatives), the per-call guarded op (``triton jagged``, what a graph
    without the region runs) kept as ``guarded_op_ms``."""
    out: dict[str, Any] = {}
    for model in ZOO_TIMED:
        mine = [r for r in rows if r.case.startswith(f"{model}: ") and r.mode == "fwd+bwd"
                and r.ms]
        by = {r.variant: r.ms for r in mine}
        variant = REGION_VARIANT if by.get(REGION_VARIANT) else "triton jagged"
        gemc_ms = by.get(variant)
        if gemc_ms is None:
            continue
        silu = "silu" in mine[0].case

        def over(variant: str, by: dict[str, float] = by, ms: float = gemc_ms
                 ) -> float | None:
            return by[variant] / ms if by.get(variant) else None

        default = "sdpa padded (softmax, masked)" if silu else "eager padded"
        masked = [ms for v, ms in by.items() if v == default or v.endswith("(masked)")]
        entry: dict[str, Any] = {
            "case": mine[0].case, "gemc_variant": variant, "gemc_ms": gemc_ms,
            "sdpa_masked_ms": by.get(default),
            "vs_sdpa_masked": over(default),
            "vs_fastest_masked_sdpa": min(masked) / gemc_ms if masked else None,
            "vs_flash_no_mask": over("sdpa padded flash (no padding mask)"),
        }
        if variant != "triton jagged":
            entry["guarded_op_ms"] = by.get("triton jagged")
        if silu:
            entry["vs_padded_silu_eager"] = over("eager padded")
            entry["vs_padded_silu_compiled"] = over("compiled padded")
        entry["target_2x_vs_sdpa_met"] = (entry["vs_sdpa_masked"] or 0.0) >= 2.0
        out[model] = entry
    for model, why in ZOO_NOT_TIMED.items():
        out[model] = {"not_timed": why}
    return out


SILU_VARIANTS = (  # (name, fast sigmoid, fused backward, autotune, bias, key-block bwd)
    ("exact sigmoid, heuristic configs", False, False, False, False, False),
    ("fast sigmoid, heuristic configs", True, False, False, False, False),
    ("fused bwd, heuristic configs", False, True, False, False, False),
    ("fast sigmoid + fused bwd, heuristic configs", True, True, False, False, False),
    ("exact sigmoid, autotuned", False, False, True, False, False),
    ("fast sigmoid, autotuned", True, False, True, False, False),
    ("fused bwd, autotuned", False, True, True, False, False),
    ("fast sigmoid + fused bwd, autotuned", True, True, True, False, False),
    ("exact sigmoid, heuristic configs, bias", False, False, False, True, False),
    ("fast sigmoid + fused bwd, heuristic configs, bias", True, True, False, True, False),
    ("fast sigmoid + fused bwd, autotuned, bias", True, True, True, True, False),
    ("key-block bwd + fused dq, fast sigmoid, heuristic configs", True, True, False, False,
     True),
    ("key-block bwd + fused dq, fast sigmoid, autotuned", True, True, True, False, True),
    ("key-block bwd + fused dq, exact sigmoid, heuristic configs, bias", False, True, False,
     True, True),
    ("key-block bwd + fused dq, fast sigmoid, heuristic configs, bias", True, True, False,
     True, True),
    ("key-block bwd + fused dq, fast sigmoid, autotuned, bias", True, True, True, True, True),
    ("key-block bwd + dq kernel, fast sigmoid, autotuned, bias", True, False, True, True,
     True),
)
"""The ``silu_variants`` case's kernel variants: the sigmoid (``jagged_attention.FAST_SIGMOID``),
the backward as one kernel with atomic dq or two (``FUSED_SILU_BACKWARD``), the launch
configs (``config_choice``'s heuristic picks, or ``GEMC_AUTOTUNE=1``'s timed best),
HSTU's relative bias ``[B, 1, L, L]`` with its gradient, or none (the ``zoo`` case's
kernel has none), and the backward's dk/dv kernel: per (sequence, head, key block) with
the bias gradient added by atomics, or ``key-block`` (``SILU_KEY_BLOCK_BACKWARD``: per
(sequence, key block), the heads looped and the bias gradient summed without atomics)."""


def silu_variants_case(rec: Recorder, p: Preset, preset: str, gen: torch.Generator
                       ) -> dict[str, Any]:
    """HSTU's attention at the zoo preset's shape (``hstu`` of :func:`_zoo_attentions`,
    lengths uniform in 1..L), the gemc kernel's :data:`SILU_VARIANTS` against padded
    masked SDPA (PyTorch's choice, and cuDNN forced): fwd and fwd+bwd ms, each variant's
    output and q/k/v (and bias) gradients checked against the padded formula in fp32 (the
    worst abs error over them, next to the reference's largest magnitude), and the
    configs each variant ran. Returns the JSON's ``silu_variants`` section."""
    import importlib

    from gemc.backends.triton import config_choice, jagged_attention, jagged_to_padded

    kernel = importlib.import_module("gemc.backends.triton.jagged_attention")
    shape = dict(_zoo_attentions(preset)[0][1])
    causal = bool(shape.pop("causal"))
    shape.pop("kind")
    p = dataclasses.replace(p, **shape)
    dev, case = rec.device, "hstu silu variants"
    lengths = _lengths(p, gen)
    offsets = _offsets(lengths, dev)
    total, L, H, D = int(lengths.sum()), p.max_len, p.heads, p.head_dim
    scale = 1.0 / math.sqrt(D)
    q, k, v, g = (torch.randn(total, H, D, generator=gen).to(dev, p.dtype) for _ in range(4))
    bias = (0.1 * torch.randn(p.batch, 1, L, L, generator=gen)).to(dev, p.dtype)
    pos = torch.arange(L, device=dev)
    real = pos[None, :] < lengths.to(dev)[:, None]  # [B, L]
    # keys and queries: a padding query row is no token (with a bias its scores are not 0)
    visible = real[:, None, :] & real[:, :, None]
    if causal:
        visible = visible & (pos[:, None] >= pos[None, :])
    visible = visible[:, None]  # [B, 1, L, L]
    with torch.no_grad():
        qp, kp, vp, gp = (jagged_to_padded(x, offsets, L).transpose(1, 2).contiguous()
                          for x in (q, k, v, g))
    work = sum(4.0 * H * D * n * n * (0.5 if causal else 1.0) for n in lengths.tolist())

    def reference(with_bias: bool) -> list[torch.Tensor]:
        """Out, dq, dk, dv (and dbias) of the padded formula in fp32, [B, H, L, D]."""
        x = [t.float().requires_grad_() for t in (qp, kp, vp, bias)]
        s = scale * x[0] @ x[1].transpose(-1, -2) + (x[3] if with_bias else 0.0)
        out = (torch.nn.functional.silu(s) * visible / L) @ x[2]
        grads = torch.autograd.grad(out, x[:4] if with_bias else x[:3], gp.float())
        return [out.detach(), *grads]

    padded_inputs = [t.detach().clone().requires_grad_() for t in (qp, kp, vp)]
    safe = visible | ~visible.any(-1, keepdim=True)
    for name, fn in _sdpa_variants(safe, scale, causal, True, dev):
        if "flash" in name:
            continue
        rec.run(case, "fwd", name, lambda fn=fn: fn(*padded_inputs), work=work)
        rec.run(case, "fwd+bwd", name,
                lambda fn=fn: torch.autograd.grad(fn(*padded_inputs), padded_inputs, gp),
                work=3.5 * work)
    refs = {False: reference(False), True: reference(True)}
    summary: dict[str, Any] = {"shape": {**shape, "causal": causal, "tokens": total}}
    autotune_was = os.environ.get(config_choice.AUTOTUNE_ENV)
    defaults = kernel.FAST_SIGMOID, kernel.FUSED_SILU_BACKWARD, kernel.SILU_KEY_BLOCK_BACKWARD
    try:
        for name, fast, fused, tune, with_bias, key_block in SILU_VARIANTS:
            kernel.FAST_SIGMOID, kernel.FUSED_SILU_BACKWARD = fast, fused
            kernel.SILU_KEY_BLOCK_BACKWARD = key_block
            os.environ[config_choice.AUTOTUNE_ENV] = "1" if tune else "0"
            config_choice.forget("jagged_attention.")
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            b = bias.detach().clone().requires_grad_() if with_bias else None
            wrt = [*leaves, b] if b is not None else leaves

            def fwd(leaves: list[torch.Tensor] = leaves, b: torch.Tensor | None = b
                    ) -> torch.Tensor:
                return jagged_attention(*leaves, offsets, L, scale=scale, causal=causal,
                                        kind="silu", bias=b)

            def err_of(fwd: Callable[[], torch.Tensor] = fwd, wrt: list[torch.Tensor] = wrt,
                       ref: list[torch.Tensor] = refs[with_bias]) -> float:
                out = fwd()
                got = [out, *torch.autograd.grad(out, wrt, g)]
                padded = [jagged_to_padded(x.detach(), offsets, L).transpose(1, 2)
                          for x in got[:4]] + [x.detach().expand_as(ref[4]) for x in got[4:]]
                return max(float((a.float() - r).abs().max()) for a, r in zip(padded, ref))

            err = err_of()  # first launch: compiles and (autotuned) times the configs
            with torch.no_grad():
                fwd_row = rec.run(case, "fwd", name, fwd, work=work)
            both = rec.run(case, "fwd+bwd", name,
                           lambda fwd=fwd, wrt=wrt: torch.autograd.grad(fwd(), wrt, g),
                           work=3.5 * work)
            rec.check(case, name, err)
            summary[name] = {"fwd_ms": fwd_row.ms, "fwd_bwd_ms": both.ms, "max_abs_err": err,
                             "configs": {k.removeprefix("jagged_attention."): v
                                         for k, v in config_choice.report().items()
                                         if k.startswith("jagged_attention.")}}
    finally:
        kernel.FAST_SIGMOID, kernel.FUSED_SILU_BACKWARD, kernel.SILU_KEY_BLOCK_BACKWARD = defaults
        if autotune_was is None:
            os.environ.pop(config_choice.AUTOTUNE_ENV, None)
        else:
            os.environ[config_choice.AUTOTUNE_ENV] = autotune_was
        config_choice.forget("jagged_attention.")
    summary["reference_max_abs"] = max(float(r.abs().max()) for r in refs[True])
    masked = [r.ms for r in rec.rows if r.case == case and r.mode == "fwd+bwd" and r.ms
              and r.variant.startswith("sdpa")]
    summary["fastest_masked_sdpa_ms"] = min(masked) if masked else None
    for name, *_ in SILU_VARIANTS:
        ms = summary[name]["fwd_bwd_ms"]
        summary[name]["vs_fastest_masked_sdpa"] = min(masked) / ms if masked and ms else None
    _free(dev)
    return summary


def print_silu_variants(summary: dict[str, Any]) -> None:
    for name, *_ in SILU_VARIANTS:
        row = summary[name]
        print(f"silu variant {name}: fwd {_fmt(row['fwd_ms'], '.3f')} ms, fwd+bwd "
              f"{_fmt(row['fwd_bwd_ms'], '.3f')} ms, {_fmt(row['vs_fastest_masked_sdpa'], '.2f')}"
              f"x vs fastest masked SDPA, max abs err {row['max_abs_err']:.3g} "
              f"(reference up to {summary['reference_max_abs']:.3g})")


QUERY_KEYS = 16
"""Dense keys per row of the ``query`` case (candidate or feature tokens)."""


def query_case(rec: Recorder, p: Preset, compile_: bool, gen: torch.Generator) -> None:
    from gemc.backends.triton.jagged_query_attention import (
        jagged_query_attention,
        offsets_query_lengths,
    )

    dev = rec.device
    case = "history queries over dense keys"
    lengths = _lengths(p, gen)
    B, L, H, D, M = p.batch, p.max_len, p.heads, p.head_dim, QUERY_KEYS
    rows = (torch.arange(L)[None, :] < lengths[:, None]).to(dev)[:, None, :, None]
    q = (torch.randn(B, H, L, D, generator=gen).to(dev, p.dtype) * rows).requires_grad_()
    k, v = (torch.randn(B, H, M, D, generator=gen).to(dev, p.dtype).requires_grad_()
            for _ in range(2))
    g = torch.randn(B, H, L, D, generator=gen).to(dev, p.dtype) * rows
    qlen = offsets_query_lengths(_offsets(lengths, dev), 0, L)
    work = 4.0 * H * D * M * float(lengths.sum())

    def triton_fwd():
        return jagged_query_attention(q, k, v, qlen)

    def padded_fwd(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    compiled = _compiled(padded_fwd, compile_)
    variants = [("triton jagged queries", triton_fwd, False),
                ("eager padded", lambda: padded_fwd(q, k, v), True)]
    if compiled is not None:
        variants.append(("compiled padded", lambda: compiled(q, k, v), False))
    _run_variants(rec, case, variants, (q, k, v), g, work)
    try:  # the Triton result against eager padded on the real rows, at this size
        out, ref = triton_fwd(), padded_fwd(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), g)
        refs = torch.autograd.grad(ref, (q, k, v), g)
        err = max([((out - ref) * rows).abs().max()]
                  + [(a - b).abs().max() for a, b in zip(grads, refs)])
        rec.check(case, "triton jagged queries", err.item())
    except Exception as exc:  # noqa: BLE001
        print(f"[{case}] check skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
    _free(dev)


def embedding_case(rec: Recorder, p: Preset, compile_: bool, gen: torch.Generator) -> None:
    from gemc.backends.triton import BatchedEmbeddingBag

    dev = rec.device
    case = "embedding step"
    lo, hi = math.log(p.rows[0]), math.log(p.rows[1])
    rows = [int(math.exp(lo + (hi - lo) * float(torch.rand(1, generator=gen, device="cpu"))))
            for _ in range(p.tables)]
    dims = [p.dims[int(torch.randint(len(p.dims), (1,), generator=gen, device="cpu"))]
            for _ in range(p.tables)]
    tables = list(zip(rows, dims))
    B = p.batch
    lengths = torch.randint(p.pooling[0], p.pooling[1] + 1, (p.tables * B,), generator=gen, device="cpu")
    ids = torch.cat([torch.randint(0, rows[t], (int(lengths[t * B:(t + 1) * B].sum()),),
                                   generator=gen, device="cpu") for t in range(p.tables)]).to(dev)
    offsets = _offsets(lengths, dev)
    cuts = offsets[::B].tolist()
    per_table = [(ids[cuts[t]:cuts[t + 1]], offsets[t * B:(t + 1) * B + 1] - cuts[t])
                 for t in range(p.tables)]
    grad = torch.randn(B, sum(dims), generator=gen, device="cpu").to(dev)
    lr = 1e-3
    # Bytes of embedding rows the forward gathers: the "throughput" column of the fwd rows.
    row_bytes = 4.0 * sum(int(lengths[t * B:(t + 1) * B].sum()) * dims[t]
                          for t in range(p.tables))
    unit = "GB/s"

    def triton_step(optimizer: str, precision: str = "fp32") -> None:
        from gemc.table_precision import element_bytes

        module = BatchedEmbeddingBag(tables, optimizer=optimizer, lr=lr, device=dev,
                                     precision=precision)
        name = f"triton fused {optimizer}" + ("" if precision == "fp32" else f" {precision}")
        with torch.no_grad():  # the rows' stored bytes (fp8's row scales left out)
            rec.run(case, "fwd", name, lambda: module(ids, offsets),
                    work=row_bytes * element_bytes(precision) / 4, unit=unit)
        rec.run(case, "fwd+bwd+opt", name, lambda: module(ids, offsets).backward(grad))

    def lookup(bags):
        return torch.cat([bag(i, o[:-1]) for bag, (i, o) in zip(bags, per_table)], dim=1)

    def eager_dense_step() -> None:
        bags = [torch.nn.EmbeddingBag(r, d, mode="sum", device=dev) for r, d in tables]
        opt = torch.optim.AdamW([b.weight for b in bags], lr=lr, fused=dev.type == "cuda")

        def step(fwd=lookup, opt_step=opt.step):
            fwd(bags).backward(grad)
            opt_step()
            opt.zero_grad(set_to_none=True)

        name = "eager EmbeddingBag + AdamW"
        with torch.no_grad():
            rec.run(case, "fwd", name, lambda: lookup(bags), baseline=True, work=row_bytes,
                    unit=unit)
        rec.run(case, "fwd+bwd+opt", name, step, baseline=True)
        if compile_:
            c_lookup = torch.compile(lookup)

            @torch.compile
            def c_step():
                opt.step()

            name = "compiled EmbeddingBag + AdamW"
            with torch.no_grad():
                rec.run(case, "fwd", name, lambda: c_lookup(bags), work=row_bytes, unit=unit)
            rec.run(case, "fwd+bwd+opt", name, lambda: step(c_lookup, c_step))
        # At this size, the Triton forward against eager with the same weights.
        module = BatchedEmbeddingBag(tables, lr=lr, device=dev)
        module.load_from_embedding_bags(bags)
        with torch.no_grad():
            err = (module(ids, offsets) - lookup(bags)).abs().max().item()
        rec.check(case, "triton fused rowwise_adagrad", err)

    def eager_sparse_step() -> None:
        bags = [torch.nn.EmbeddingBag(r, d, mode="sum", sparse=True, device=dev)
                for r, d in tables]
        opt = torch.optim.SparseAdam([b.weight for b in bags], lr=lr)

        def step():
            lookup(bags).backward(grad)
            opt.step()
            opt.zero_grad(set_to_none=True)

        rec.run(case, "fwd+bwd+opt", "eager EmbeddingBag(sparse) + SparseAdam", step)

    for name, fn in [("triton fused adam", lambda: triton_step("adam")),
                     ("triton fused rowwise_adagrad", lambda: triton_step("rowwise_adagrad")),
                     ("triton fused rowwise_adagrad bf16",
                      lambda: triton_step("rowwise_adagrad", "bf16")),
                     ("triton fused rowwise_adagrad fp8",
                      lambda: triton_step("rowwise_adagrad", "fp8")),
                     ("eager EmbeddingBag + AdamW", eager_dense_step),
                     ("eager EmbeddingBag(sparse) + SparseAdam", eager_sparse_step)]:
        try:  # building a variant (its tables) may itself run out of memory
            fn()
        except Exception as exc:  # noqa: BLE001
            rec.rows.append(Row(case, "fwd+bwd+opt", name,
                                error=f"{type(exc).__name__}: {exc}"[:200]))
        _free(dev)


def sector_bytes(width: int, element_bytes: int = 4, sector: int = 32) -> float:
    """Mean bytes of the 32-byte sectors one row of ``width`` elements spans (the table's
    base sector-aligned, rows at uniformly random ids): what the memory system moves for
    it, the unit of gemc's cost model (a 16-byte row still moves a whole sector)."""
    row = width * element_bytes
    spans = [(r * row + row - 1) // sector - (r * row) // sector + 1 for r in range(sector)]
    return sector * sum(spans) / len(spans)


def narrow_case(rec: Recorder, n: Narrow, gen: torch.Generator) -> dict[str, Any]:
    """gemc's pooled lookup on one shard at each width of ``n.widths`` against PyTorch's
    ``nn.EmbeddingBag``; see the module docstring (``narrow``). Returns the summary: per
    (pooling, variant, mode), per width, ms, GB/s and time per column against 128 wide."""
    from gemc.backends.triton import BatchedEmbeddingBag

    dev = rec.device
    lr, eps = 0.01, 1.0e-8
    summary: dict[str, Any] = {}
    # 50 timings in a 40 s run on an H200 (with the tables' setup and the autotuning):
    # shorter than the default 25 + 100 ms each; ~20 steps of the slowest variant
    rec.timing = {"warmup": 10, "rep": 40}
    for width in n.widths:
        bag = torch.nn.EmbeddingBag(n.rows, width, mode="sum", sparse=True, device=dev)
        gemc = BatchedEmbeddingBag([(n.rows, width)], optimizer="rowwise_adagrad", lr=lr,
                                   eps=eps, device=dev)
        opt = torch.optim.Adagrad(bag.parameters(), lr=lr, eps=eps)
        for pooling in n.poolings:
            nnz = n.batch * pooling
            ids = torch.randint(0, n.rows, (nnz,), generator=gen).to(dev)
            offsets = (torch.arange(n.batch + 1) * pooling).to(dev)
            grad = torch.randn(n.batch, width, generator=gen).to(dev)
            _narrow_check(gemc, bag, ids, offsets, grad, lr, eps)
            _narrow_timings(rec, summary, f"pooling {pooling}", width, gemc, bag, opt, ids,
                            offsets, grad)
        del bag, gemc, opt
        _free(dev)
    rec.timing = {}
    for per_mode in summary.values():  # time per column, against the 128-wide shard
        for widths in per_mode.values():
            ref = widths.get("128", {}).get("ms")
            for w, cell in widths.items():
                cell["per_column_vs_128"] = (cell["ms"] / int(w)) / (ref / 128) \
                    if cell["ms"] and ref else None
    return summary


def _narrow_timings(rec: Recorder, summary: dict[str, Any], key: str, width: int, gemc: Any,
                    bag: torch.nn.EmbeddingBag, opt: torch.optim.Optimizer, ids: torch.Tensor,
                    offsets: torch.Tensor, grad: torch.Tensor) -> None:
    """The ``narrow`` case's five timings of one (width, pooling), into ``rec`` and
    ``summary[key]``."""
    import torch.nn.functional as F

    nnz = ids.numel()
    case = f"narrow shard {width} wide, pooling {nnz // (offsets.numel() - 1)}"
    variants: list[tuple[str, str, Callable[[], Any], bool]] = [  # (..., baseline)
        ("gemc triton", "fwd", lambda: gemc(ids, offsets), False),
        ("gemc triton", "fwd+bwd+opt", lambda: gemc(ids, offsets).backward(grad), False),
        ("eager EmbeddingBag", "fwd",
         lambda: F.embedding_bag(ids, bag.weight.detach(), offsets[:-1], mode="sum"), True),
        ("eager EmbeddingBag", "fwd+bwd",
         lambda: _eager_step(bag, None, ids, offsets, grad), False),
        ("eager EmbeddingBag + Adagrad", "fwd+bwd+opt",
         lambda: _eager_step(bag, opt, ids, offsets, grad), True),
    ]
    width_bytes = 4.0 * nnz * width
    sectors = nnz * sector_bytes(width)
    for variant, mode, fn, base in variants:
        with torch.no_grad() if mode == "fwd" else torch.enable_grad():
            row = rec.run(case, mode, variant, fn, baseline=base)
        if row.ms:
            row.throughput = (f"{width_bytes / row.ms / 1e6:.0f} GB/s rows, "
                              f"{sectors / row.ms / 1e6:.0f} GB/s sectors")
        summary.setdefault(key, {}).setdefault(f"{variant} {mode}", {})[str(width)] = {
            "ms": row.ms, "error": row.error,
            "rows_gbps": row.ms and width_bytes / row.ms / 1e6,
            "sectors_gbps": row.ms and sectors / row.ms / 1e6}


def narrow_group_case(rec: Recorder, n: Narrow, gen: torch.Generator,
                      shards: tuple[int, ...] = (1, 2, 4, 8), width: int = 16
                      ) -> dict[str, Any]:
    """``shards`` narrow shards in one batched kernel against one module each (see the
    module docstring, ``narrow_group``); returns per shard count both steps' ms."""
    from gemc.backends.triton import BatchedEmbeddingBag

    dev, pooling, rows = rec.device, n.poolings[0], max(1, n.rows // max(shards))
    summary: dict[str, Any] = {}
    rec.timing = {"warmup": 10, "rep": 40}
    for k in shards:
        one = BatchedEmbeddingBag([(rows, width)] * k, optimizer="rowwise_adagrad", device=dev)
        each = [BatchedEmbeddingBag([(rows, width)], optimizer="rowwise_adagrad", device=dev)
                for _ in range(k)]
        ids = torch.randint(0, rows, (k * n.batch * pooling,), generator=gen).to(dev)
        offsets = (torch.arange(k * n.batch + 1) * pooling).to(dev)
        grad = torch.randn(n.batch, k * width, generator=gen).to(dev)
        per = n.batch * pooling  # one shard's ids and bags, table-major
        parts = [(ids[i * per:(i + 1) * per], offsets[:n.batch + 1],
                  grad[:, i * width:(i + 1) * width].contiguous()) for i in range(k)]
        with torch.no_grad():  # the same lookups both ways, checked before timing
            for module, w in zip(each, one.split_weights()):
                module.load_weights([w])
            torch.testing.assert_close(
                one(ids, offsets), torch.cat([m(i, o) for m, (i, o, _) in zip(each, parts)], 1))

        def separate(parts=parts, each=each) -> None:
            for module, (i, o, g) in zip(each, parts):
                module(i, o).backward(g)

        summary[str(k)] = _step_against(
            rec, f"{k} narrow shards {width} wide, pooling {pooling}", one, ids, offsets,
            grad, ("one kernel", "one_kernel_ms"),
            ("a kernel a shard", "kernel_per_shard_ms"), separate)
        del one, each, parts
        _free(dev)
    rec.timing = {}
    return summary


def _narrow_shape(base: Narrow, batch: int | None, poolings: str | None,
                  rows: int | None = None) -> Narrow:
    """``base`` with the command line's bags, poolings and rows; ValueError names a bad
    one."""
    if batch is not None and batch < 1:
        raise ValueError(f"--narrow-batch {batch}: give a positive number of bags")
    if rows is not None and rows < 1:
        raise ValueError(f"--narrow-rows {rows}: give a positive number of rows")
    pools = base.poolings
    if poolings is not None:
        try:
            pools = tuple(int(p) for p in poolings.split(",") if p.strip())
        except ValueError:
            pools = ()
        if not pools or min(pools) < 1:
            raise ValueError(f"--narrow-poolings {poolings!r}: give positive integers "
                             "separated by commas, e.g. 100,12")
    return dataclasses.replace(base, batch=base.batch if batch is None else batch,
                               poolings=pools, rows=base.rows if rows is None else rows)


def predicted_shard_ms(n: Narrow, width: int, pooling: int, device: torch.device,
                       split_squares: bool) -> float | None:
    """What gemc's cost model charges this shard's fused step on the device's GPU (its
    bytes in the rank's batched kernel, op_cost.batched_embedding_time, uncalibrated;
    the rank's kernel floor not included): the figure the measured row is checked
    against. None off a known GPU."""
    from gemc.cost_model.hardware import gpu_from_device_name
    from gemc.cost_model.op_cost import batched_embedding_time

    gpu = gpu_from_device_name(torch.cuda.get_device_name(device)) \
        if device.type == "cuda" else None
    if gpu is None:
        return None
    return 1e3 * batched_embedding_time(n.rows, width, n.batch * pooling, n.batch, "fp32",
                                        gpu, None, "rowwise_adagrad",
                                        split_squares=split_squares)


def narrow_split_case(rec: Recorder, n: Narrow, gen: torch.Generator,
                      widths: tuple[int, ...] = (16, 32, 64), full: int = 128
                      ) -> dict[str, Any]:
    """A column shard under row-wise Adagrad: the fused step in two phases (the row's
    squares, then the update from them: ``BatchedEmbeddingBag.split_rows``; the column
    group's all-reduce between them is left out, one GPU) against the one-pass fused step
    of the same shard (what a shard of whole rows runs); see the module docstring
    (``narrow_split``). Both from the same weights; checked equal where the shard is the
    whole row (``width == full``, squares summed over one shard) before timing."""
    from gemc.backends.triton import BatchedEmbeddingBag

    dev, pooling = rec.device, n.poolings[0]
    summary: dict[str, Any] = {}
    rec.timing = {"warmup": 10, "rep": 40}
    for width in (*widths, full):
        one = BatchedEmbeddingBag([(n.rows, width)], optimizer="rowwise_adagrad", device=dev)
        two = BatchedEmbeddingBag([(n.rows, width)], optimizer="rowwise_adagrad", device=dev)
        two.load_weights(one.split_weights())
        two.split_rows({0: full})
        ids = torch.randint(0, n.rows, (n.batch * pooling,), generator=gen).to(dev)
        offsets = (torch.arange(n.batch + 1) * pooling).to(dev)
        grad = torch.randn(n.batch, width, generator=gen).to(dev)
        counts = [ids.numel()]

        def two_phase(two=two, ids=ids, offsets=offsets, grad=grad, counts=counts) -> None:
            two(ids, offsets, id_counts=counts).backward(grad)
            two.apply_pending()  # squares as this shard's: the group's sum left out

        if width == full:  # a whole row in two phases moves as in one
            with torch.enable_grad():
                one(ids, offsets).backward(grad)
                two_phase()
            _assert_close_in_chunks(two.split_weights()[0], one.split_weights()[0])
        summary[str(width)] = _step_against(
            rec, f"column shard {width} of {full} wide, pooling {pooling}", one, ids,
            offsets, grad, ("one pass", "one_pass_ms"), ("two phases", "two_phase_ms"),
            two_phase)
        summary[str(width)].update(
            rows=n.rows, batch=n.batch, pooling=pooling,
            predicted_one_pass_ms=predicted_shard_ms(n, width, pooling, dev, False),
            predicted_two_phase_ms=predicted_shard_ms(n, width, pooling, dev, width < full))
        del one, two
        _free(dev)
    rec.timing = {}
    return summary


def _assert_close_in_chunks(got: torch.Tensor, want: torch.Tensor,
                            rows: int = 1 << 20) -> None:
    """assert_close a block of ``rows`` rows at a time: on a 40M x 128 table the comparison's
    own temporaries (~20 GB each) ran an 80-GB card out of memory beside two such tables."""
    for start in range(0, want.shape[0], rows):
        torch.testing.assert_close(got[start:start + rows], want[start:start + rows])


def _step_against(rec: Recorder, case: str, module: Any, ids: torch.Tensor,
                  offsets: torch.Tensor, grad: torch.Tensor, base: tuple[str, str],
                  other: tuple[str, str], other_step: Callable[[], Any]) -> dict[str, Any]:
    """``module``'s fused step (the baseline) and ``other_step`` timed in ``case``: the
    summary's two ms under their keys (``base``, ``other``: the variant's name after
    "gemc triton, ", the key) and any error."""
    with torch.enable_grad():
        a = rec.run(case, "fwd+bwd+opt", f"gemc triton, {base[0]}",
                    lambda: module(ids, offsets).backward(grad), baseline=True)
        b = rec.run(case, "fwd+bwd+opt", f"gemc triton, {other[0]}", other_step)
    return {base[1]: a.ms, other[1]: b.ms, "errors": [r.error for r in (a, b) if r.error]}


def _eager_step(bag: torch.nn.EmbeddingBag, opt: torch.optim.Optimizer | None,
                ids: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor) -> None:
    """PyTorch's lookup, its sparse gradient and (with ``opt``) the optimizer step; the
    gradient dropped after each (an accumulated sparse gradient grows every run)."""
    bag(ids, offsets[:-1]).backward(grad)
    if opt is not None:
        opt.step()
    bag.weight.grad = None


@torch.no_grad()
def _narrow_check(gemc: Any, bag: torch.nn.EmbeddingBag, ids: torch.Tensor,
                  offsets: torch.Tensor, grad: torch.Tensor, lr: float, eps: float) -> None:
    """gemc's shard against PyTorch at the benchmark's size, before timing: the pooled
    forward, and one fused backward + row-wise Adagrad step on the rows the batch touched
    (PyTorch's sparse gradient, coalesced: ``acc = mean(g^2)``,
    ``w -= lr * g / (sqrt(acc) + eps)``). Raises on a mismatch: a wrong kernel is not
    timed. The shard's weights are PyTorch's afterwards again (the step is undone)."""
    import torch.nn.functional as F

    gemc.load_weights([bag.weight])
    gemc.reset_optimizer_state()
    torch.testing.assert_close(gemc(ids, offsets),
                               F.embedding_bag(ids, bag.weight, offsets[:-1], mode="sum"))
    with torch.enable_grad():
        weight = bag.weight.detach().requires_grad_()
        F.embedding_bag(ids, weight, offsets[:-1], mode="sum", sparse=True).backward(grad)
        g = weight.grad.coalesce()
        gemc(ids, offsets).backward(grad)
    touched, g = g.indices()[0], g.values()
    acc = g.pow(2).mean(1, keepdim=True)
    want = bag.weight[touched] - lr * g / (acc.sqrt() + eps)
    torch.testing.assert_close(gemc.split_weights()[0][touched], want)
    torch.testing.assert_close(gemc.momentum1[touched], acc.squeeze(1))
    gemc.load_weights([bag.weight])
    gemc.reset_optimizer_state()


def print_narrow(summary: dict[str, Any]) -> None:
    """Time per column against the 128-wide shard, per pooling, variant and mode."""
    for pooling, per_mode in summary.items():
        widths = sorted({int(w) for cells in per_mode.values() for w in cells})
        print(f"narrow shards, {pooling}: time per column / the 128-wide shard's "
              f"(1.0 = no penalty; TorchRec charges 1.15 below 128, 1.75 below 64)")
        print("  " + "variant / mode".ljust(40) + "".join(f"{w:>8}" for w in widths))
        for name, cells in per_mode.items():
            vals = [cells.get(str(w), {}).get("per_column_vs_128") for w in widths]
            print("  " + name.ljust(40) + "".join(f"{_fmt(v, '.2f'):>8}" for v in vals))


def jagged_case(rec: Recorder, p: Preset, compile_: bool, gen: torch.Generator) -> None:
    from gemc.backends.triton import (
        jagged_to_padded,
        jagged_to_padded_reference,
        padded_to_jagged,
        padded_to_jagged_reference,
    )

    dev = rec.device
    lengths = _lengths(p, gen)
    offsets = _offsets(lengths, dev)
    total, L = int(lengths.sum()), p.max_len
    values = torch.randn(total, p.jagged_dim, generator=gen, device="cpu").to(dev, p.dtype).requires_grad_()
    padded = torch.randn(p.batch, L, p.jagged_dim, generator=gen, device="cpu").to(dev, p.dtype)
    padded.requires_grad_()
    elem = values.element_size()
    to_pad_bytes = (total + p.batch * L) * p.jagged_dim * elem
    to_jag_bytes = 2 * total * p.jagged_dim * elem

    def pair(case, fns, inputs, grad_shape, work):
        grad = torch.randn(grad_shape, generator=gen, device="cpu").to(dev, p.dtype)
        for name, fn in fns:
            if fn is None:
                continue
            base = name.startswith("eager")
            with torch.no_grad():
                rec.run(case, "fwd", name, fn, baseline=base, work=work, unit="GB/s")
            rec.run(case, "fwd+bwd", name,
                    lambda fn=fn: torch.autograd.grad(fn(), inputs, grad), baseline=base,
                    work=2 * work, unit="GB/s")

    c_pad = _compiled(jagged_to_padded_reference, compile_)
    c_jag = _compiled(padded_to_jagged_reference, compile_)
    pair("jagged_to_padded", [
        ("triton", lambda: jagged_to_padded(values, offsets, L)),
        ("eager index_put", lambda: jagged_to_padded_reference(values, offsets, L)),
        ("compiled index_put", c_pad and (lambda: c_pad(values, offsets, L))),
    ], (values,), (p.batch, L, p.jagged_dim), to_pad_bytes)
    pair("padded_to_jagged", [
        ("triton", lambda: padded_to_jagged(padded, offsets, total)),
        ("eager gather", lambda: padded_to_jagged_reference(padded, offsets, total)),
        ("compiled gather", c_jag and (lambda: c_jag(padded, offsets, total))),
    ], (padded,), (total, p.jagged_dim), to_jag_bytes)
    with torch.no_grad():
        err = (jagged_to_padded(values, offsets, L)
               - jagged_to_padded_reference(values, offsets, L)).abs().max()
        rec.check("jagged_to_padded", "triton", err.item())
        err = (padded_to_jagged(padded, offsets, total)
               - padded_to_jagged_reference(padded, offsets, total)).abs().max()
        rec.check("padded_to_jagged", "triton", err.item())
    _free(dev)


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[Row]) -> None:
    header = ("case", "mode", "variant", "ms", "vs eager", "throughput", "max|err|")
    lines = [(r.case, r.mode, r.variant, r.error and "FAILED" or _fmt(r.ms, ".3f"),
              _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""), r.throughput,
              _fmt(r.max_abs_err, ".2e")) for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
    for line in [header, tuple("-" * w for w in widths), *lines]:
        print("  ".join(str(c).ljust(w) for c, w in zip(line, widths)))
    for r in rows:
        if r.error:
            print(f"  ! {r.case} / {r.mode} / {r.variant}: {r.error}")


def targets(rows: list[Row]) -> list[dict[str, Any]]:
    found = []
    picks = {"attention": ("softmax attention", "fwd+bwd", "triton jagged"),
             "embedding": ("embedding step", "fwd+bwd+opt", "triton fused adam")}
    for key, (case_prefix, mode, variant) in picks.items():
        desc, need = TARGETS[key]
        row = next((r for r in rows if r.case.startswith(case_prefix) and r.mode == mode
                    and r.variant == variant), None)
        got = row.speedup if row else None
        found.append({"target": desc, "required_speedup": need, "measured_speedup": got,
                      "met": got is not None and got >= need})
    return found


def environment(device: torch.device) -> dict[str, Any]:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "triton": triton.__version__, "device": str(device),
           "interpreted": os.environ.get("TRITON_INTERPRET") == "1"}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (same as --preset smoke)")
    ap.add_argument("--cases", default="attention,silu,embedding,jagged",
                    help="comma-separated subset of attention,silu,query,embedding,jagged,zoo,"
                         "silu_variants,narrow,narrow_group,narrow_split")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    ap.add_argument("--zoo-models", default=",".join(ZOO_TIMED),
                    help="the zoo models --cases zoo times (default: every one with a history)")
    ap.add_argument("--no-causal", action="store_true", help="attention without causal mask")
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--narrow-batch", type=int, default=None,
                    help="bags of the narrow cases (default NARROW's: 4,096, a rank's local "
                         "batch; 65,536 is the global batch a DLRMv2 column shard serves)")
    ap.add_argument("--narrow-rows", type=int, default=None,
                    help="rows of the narrow cases' table (default NARROW's 40M: DLRMv2's "
                         "largest; 2.5M is one of 16 row shards of it)")
    ap.add_argument("--narrow-poolings", default=None,
                    help="comma-separated ids a bag for the narrow cases (default 100,12; "
                         "narrow_split takes the first)")
    args = ap.parse_args(argv)

    preset_name = "smoke" if args.smoke else args.preset
    preset = PRESETS[preset_name]
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        if preset_name != "smoke":
            ap.error("no CUDA device: only --smoke runs here (under TRITON_INTERPRET=1)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(cases) - {"attention", "silu", "query", "embedding", "jagged", "zoo",
                            "silu_variants", "narrow", "narrow_group", "narrow_split"}
    if unknown:
        ap.error(f"unknown cases: {sorted(unknown)}")

    try:
        narrow_shape = _narrow_shape(NARROW["smoke" if preset_name == "smoke" else "h200"],
                                     args.narrow_batch, args.narrow_poolings, args.narrow_rows)
    except ValueError as exc:
        ap.error(str(exc))
    rec = Recorder(device)
    compile_, causal = not args.no_compile, not args.no_causal
    zoo_extra: dict[str, Any] = {}
    narrow: dict[str, Any] = {}
    group: dict[str, Any] = {}
    split: dict[str, Any] = {}
    variants: dict[str, Any] = {}
    for case in cases:
        print(f"... {case}", file=sys.stderr, flush=True)
        if case in ("attention", "silu"):
            attention_case(rec, preset, "softmax" if case == "attention" else "silu", causal,
                           compile_, gen)
        elif case == "query":
            query_case(rec, preset, compile_, gen)
        elif case == "zoo":
            zoo_extra = zoo_case(rec, preset, "tiny" if preset_name == "smoke" else preset_name,
                                 compile_, gen, tuple(args.zoo_models.split(",")))
        elif case == "silu_variants":
            variants = silu_variants_case(rec, preset,
                                          "tiny" if preset_name == "smoke" else preset_name, gen)
        elif case == "embedding":
            embedding_case(rec, preset, compile_, gen)
        elif case == "narrow":
            narrow = narrow_case(rec, narrow_shape, gen)
        elif case == "narrow_group":
            group = narrow_group_case(rec, narrow_shape, gen)
        elif case == "narrow_split":
            split = narrow_split_case(rec, narrow_shape, gen)
        else:
            jagged_case(rec, preset, compile_, gen)
    rec.finish()
    print_table(rec.rows)
    if narrow:
        print_narrow(narrow)
    report = {
        "environment": environment(device),
        "preset": preset_name,
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v)
                   for k, v in dataclasses.asdict(preset).items()},
        "causal": causal,
        "compile": compile_,
        "seed": seed,
        "results": [dataclasses.asdict(r) for r in rec.rows],
        "targets": targets(rec.rows),
    }
    if narrow:
        report["narrow"] = narrow
    if variants:
        report["silu_variants"] = variants
        print_silu_variants(variants)
    if split:
        report["narrow_split"] = split
        for w, cell in split.items():
            print(f"column shard {w} wide, {cell['rows']} rows, {cell['batch']} bags x "
                  f"{cell['pooling']}: one pass "
                  f"{_fmt(cell['one_pass_ms'], '.3f')} ms (gemc's model "
                  f"{_fmt(cell['predicted_one_pass_ms'], '.3f')}), two phases "
                  f"{_fmt(cell['two_phase_ms'], '.3f')} ms (gemc's model "
                  f"{_fmt(cell['predicted_two_phase_ms'], '.3f')})")
    if group:
        report["narrow_group"] = group
        for k, cell in group.items():
            print(f"narrow group, {k} shards: one kernel {_fmt(cell['one_kernel_ms'], '.3f')} "
                  f"ms, a kernel a shard {_fmt(cell['kernel_per_shard_ms'], '.3f')} ms")
    if "zoo" in cases:
        report["zoo"] = zoo_summary(rec.rows)
        for model, extra in zoo_extra.items():
            report["zoo"].setdefault(model, {}).update(extra)
        for model, z in report["zoo"].items():
            if "gemc_ms" in z:
                print(f"zoo {model}: gemc ({z['gemc_variant']}) {z['gemc_ms']:.3f} ms fwd+bwd, "
                      f"{_fmt(z['vs_sdpa_masked'], '.2f')}x vs padded masked SDPA")
    for t in report["targets"]:
        got = t["measured_speedup"]
        verdict = "NOT RUN" if got is None else ("MET" if t["met"] else "NOT MET")
        print(f"target {verdict}: {t['target']} >= "
              f"{t['required_speedup']}x (measured {_fmt(got, '.2f')}x)")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
