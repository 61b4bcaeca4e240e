"""The price of one matched attention run as gemc's kernel against the model's own attention.

Why: the attention match passes used to emit gemc's kernel wherever they matched. On the
session-25 H100 (``benchmarks/results/session25/``) gemc's kernel is not always the faster:
TransAct's guarded attention (B=4096, S=100, 2 heads of 48, an additive key mask that is no
prefix, every query row computed) took 2.60 ms fwd+bwd where padded masked cuDNN SDPA took
0.97 ms, mostly the guard's per-call host sync and the compaction, not the kernel's
arithmetic; SASRec/BST's and MMoE's kernels took 3.96x and 2.17x less than cuDNN. A call is
priced by ``cost_model.attention_fit`` (the law fitted to that run) with what it costs in a
training step whose host runs ahead of the GPU:

* ``kernel_s``: the kernels' work over the real tokens' tiles at the kernel family's rate;
* ``copies_s``: what the call moves around the kernels: the padded <-> jagged copies of a
  self-attention run on padded tensors, and a guarded call's compaction where the sample
  batch has rows that keep no prefix. A call on a packed region's tokens makes neither;
* ``host_s`` exposed after a per-call sync only (a guarded call: the check's integers read
  by the host drain the GPU queue, so what the host issues next overlaps nothing):
  ``attention_fit.GEMC_GUARDED_CALL_HOST_S``. An unsynced call is issued while the GPU
  runs earlier work; where a whole step is host-bound, the step model's launch-bound term
  prices that (``costing.host_s``), as for any kernel;
* ``sdpa_s``: the model's attention at the padded shape (``op_cost.node_cost`` of its
  nodes: masked SDPA by ``attention_fit``'s law or the calibration's record of the shape).

A call a packed region runs on its tokens (``passes/attention_choice.settle``) has no sync,
and its host work is its launches in the compiled step, priced at the step model's fitted
per-launch host price (``launches.GRAPH_LAUNCH_HOST_S``, 42 us: everything the host does in
a compiled step over its launches, fitted on the session-7 H200 profiles; a calibration's
``graph_launch_s`` replaces it): :func:`region_host_prices`, the model's SDPA priced the
same way for its own launches. Why: the region attention was priced by its kernels alone
(TransAct's 0.364 ms) and its host work left out (issue 17). In the compiled step that host
work is its launches (the bias op is a ``triton_op`` Inductor launches, the attention op
three kernels), not an eager call's Python. (One eager call measured 2.06 ms on the H100;
1.87 ms of it turned out to be kernels, the per-key bias loaded as a whole score tile,
which ``jagged_attention``'s ``KEY_BIAS`` fixed: 0.84 ms since, twenty-seventh session.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from gemc import softmax_backward_rule
from gemc.ir import OpKind

from .attention_fit import GEMC_GUARDED_CALL_HOST_S
from .launches import GRAPH_LAUNCH_HOST_S, ISLAND_LAUNCHES, REP_KEY_BIAS_LAUNCHES
from .op_cost import BWD_KERNELS

REGION_ATTENTION_LAUNCHES = ISLAND_LAUNCHES
"""Kernels a packed region's attention on its tokens launches a step
(``gemc::jagged_attention_values``: forward, dq and dk/dv backward), as the step model counts
a gemc island; one fewer where its softmax backward is one kernel
(:func:`region_attention_launches`)."""

REP_ATTENTION_LAUNCHES = ISLAND_LAUNCHES + REP_KEY_BIAS_LAUNCHES
"""Kernels an attention over padding representatives launches a step
(``packed_tokens.rep_attention``): the bias kernel (``gemc::rep_key_bias``, forward only; no
output guard since issue 17) and the attention's three (two: as above)."""


SOFTMAX_KINDS = ("jagged_attention", "key_padding_attention")
"""Match kinds whose region call runs the softmax self-attention kernels
(``gemc::jagged_attention_values``); the silu and query attentions run kernels of their own."""


def region_attention_launches(rep: bool, facts: Mapping[str, Any] | None = None) -> int:
    """Kernels a region attention launches a step: :data:`REP_ATTENTION_LAUNCHES` (``rep``)
    or :data:`REGION_ATTENTION_LAUNCHES`, less one where ``facts`` (a match's ``kind``,
    ``max_len``, ``head_dim``) say a softmax attention whose backward runs as one kernel
    (``gemc.softmax_backward_rule``, the runner's rule: short rows, the switch on). Why:
    TransAct's region attention launches the forward and the row kernel since the
    thirty-first session, not three kernels."""
    launches = REP_ATTENTION_LAUNCHES if rep else REGION_ATTENTION_LAUNCHES
    facts = facts or {}
    if facts.get("kind") in SOFTMAX_KINDS and facts.get("max_len") and facts.get("head_dim"):
        launches -= 2 - softmax_backward_rule.backward_kernels(int(facts["max_len"]),
                                                               int(facts["head_dim"]))
    return launches


SDPA_LAUNCHES = 1 + BWD_KERNELS[OpKind.ATTENTION]
"""Kernels the model's SDPA launches a step, as the step model counts an attention node
outside gemc (``launches.graph_launches``' ``extern``: forward and its backward kernels)."""


@dataclass(frozen=True)
class AttentionPrices:
    """Forward+backward seconds of one matched attention both ways, and the choice."""

    kernel_s: float   # gemc's kernels' work at its fill
    copies_s: float   # padded <-> jagged copies, compaction (none on a region's tokens)
    host_s: float     # gemc's host cost per call, exposed after a per-call sync
    guarded: bool     # one host sync per call (the guard's check)
    sdpa_s: float     # the model's attention at the padded shape (its kernels)
    fill: float       # the fill the kernel work was priced at
    fill_source: str  # where that fill came from

    @property
    def gemc_s(self) -> float:
        """gemc's call in a step: its GPU work, plus its host time after a per-call sync."""
        return self.kernel_s + self.copies_s + (self.host_s if self.guarded else 0.0)

    @property
    def padded_s(self) -> float:
        """The model's attention at the padded shape."""
        return self.sdpa_s

    @property
    def gemc_slower(self) -> bool:
        return self.gemc_s > self.padded_s

    @property
    def kernel_slower(self) -> bool:
        """Slower even on a packed region's tokens (no copies, no sync of its own)."""
        return self.kernel_s > self.padded_s

    def on_tokens(self) -> AttentionPrices:
        """The same call run on a packed region's tokens: no copies, no compaction, and no
        sync of its own (a guarded region's one check runs ahead of the graph)."""
        return replace(self, copies_s=0.0, guarded=False)

    def why(self) -> str:
        """What makes gemc's call cost what it does, in words."""
        parts = [f"kernel {1e3 * self.kernel_s:.3g} ms at fill {self.fill:.3g} "
                 f"({self.fill_source})"]
        if self.copies_s:
            parts.append(f"+ copies {1e3 * self.copies_s:.3g} ms (padded <-> jagged, "
                         "compaction)")
        if self.guarded:
            parts.append(f"+ host {1e3 * self.host_s:.3g} ms a call not overlapped: the "
                         "guard's host sync drains the GPU queue")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, float | str | bool]:
        """The prices as the plan records them (ms)."""
        return {"gemc_ms": round(1e3 * self.gemc_s, 6), "padded_ms": round(1e3 * self.padded_s, 6),
                "kernel_ms": round(1e3 * self.kernel_s, 6),
                "copies_ms": round(1e3 * self.copies_s, 6),
                "host_ms": round(1e3 * self.host_s, 6),
                "guarded": self.guarded, "fill": round(self.fill, 6),
                "fill_source": self.fill_source}


def region_host_prices(rep: bool, per_launch_s: float | None = None,
                       facts: Mapping[str, Any] | None = None) -> dict[str, float | int]:
    """The host prices of a region attention's call (``rep``: over padding
    representatives; ``facts``: the match's, :func:`region_attention_launches`) and of the
    model's SDPA, by their launches at ``per_launch_s`` (the calibration's
    ``graph_launch_s``; default :data:`launches.GRAPH_LAUNCH_HOST_S`): ms and counts, as the
    plan records them (see the module doc)."""
    per = per_launch_s or GRAPH_LAUNCH_HOST_S
    gemc = region_attention_launches(rep, facts)
    return {"launches": gemc, "launch_ms": round(1e3 * gemc * per, 6),
            "padded_launches": SDPA_LAUNCHES,
            "padded_launch_ms": round(1e3 * SDPA_LAUNCHES * per, 6),
            "per_launch_us": round(1e6 * per, 3)}


def attention_prices(kernel_s: float, sdpa_s: float, *, guarded: bool, fill: float,
                     fill_source: str, copies_s: float = 0.0,
                     host_s: float = GEMC_GUARDED_CALL_HOST_S) -> AttentionPrices:
    """The prices of one matched attention (see the module doc): ``kernel_s`` gemc's kernel
    work at ``fill``, ``copies_s`` what it moves around it, ``sdpa_s`` the model's
    attention at the padded shape."""
    if kernel_s < 0 or sdpa_s < 0 or copies_s < 0:
        raise ValueError(f"attention_prices: negative time (kernel {kernel_s}, copies "
                         f"{copies_s}, sdpa {sdpa_s})")
    return AttentionPrices(float(kernel_s), float(copies_s), float(host_s), bool(guarded),
                           float(sdpa_s), float(fill), fill_source)
