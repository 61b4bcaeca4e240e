"""The price of one matched attention run as gemc's kernel against the model's own attention.

Why: the attention match passes used to emit gemc's kernel wherever they matched, priced by
its kernel work alone. On the session-25 H100 (``benchmarks/results/session25/``) that work
is not what a call costs: TransAct's guarded attention (B=4096, S=100, 2 heads of 48, an
additive key mask that is no prefix, every query row computed) took 2.60 ms fwd+bwd where
padded masked cuDNN SDPA took 0.97 ms (``kernels_zoo.log``), at every block size tried
(2.6-3.2 ms): the host's work per call and the guard's sync, not the kernel's arithmetic.
So a call is priced with what it costs in a training step:

* ``kernel_s``: the kernel's work at its fill (the caller's: a graph-proven fill over
  offsets, a guarded attention's from the sample batch) plus its copies;
* the guarded path's one host sync per call (``backends/triton/key_padding_attention``:
  the check's four integers read by the host). A sync drains the GPU queue, so the host
  time of what follows it in the call (its launches and Python) no longer overlaps any
  GPU work: priced as gemc's host cost per call, :data:`GEMC_ATTENTION_HOST_S`, added to
  the kernel (``kernel + host``). Not fitted: at TransAct's shape and fill 1 this prices
  1.96 ms against the 2.60 ms measured (the compaction's gathers and the check kernel are
  not in ``kernel_s``), i.e. it errs towards keeping gemc's kernel;
* without a sync (an attention over offsets; a guarded attention run on the tokens of a
  guarded packed region, whose one check runs ahead of the graph) the host issues the
  call while the GPU still runs earlier work, so its host cost is not added: where a
  whole step is host-bound, the step model's launch-bound term prices that
  (``costing.host_s``). Why not a per-call floor ``max(kernel, host)``: that is what
  ``do_bench`` of one call in isolation measures (``attention_gpu_time.log``: gemc's
  jagged attention, kernels 0.38-0.53 ms and host 1.0-1.8 ms, timed 1.0-1.8 ms), not a
  call inside a step with work queued ahead of it; as a floor it priced mmoe's target
  attention (kernel 0.25 ms at the sample's fill) 1.0 ms against SDPA's 0.45 ms and so
  gave up the packed region around it, whose tower attention measured 2.19x faster than
  cuDNN (``kernels_zoo.log``).

The model's attention (SDPA, or the written-out formula Inductor compiles) is priced by the
caller at the padded shape (``op_cost.attention_time`` through ``node_cost``). Its own host
cost (cuDNN's fwd+bwd call: 0.35 ms of host on that machine, the efficient backend's 0.50)
is issued ahead like any other kernel's and is not added either.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GEMC_ATTENTION_HOST_S = 1.0e-3
"""Host seconds of one fwd+bwd call of gemc's attention op (launches and Python):
``benchmarks/results/session25/attention_gpu_time.log``, ``host_ms`` of the gemc variants,
1.01-1.76 ms for HSTU's SiLU kernel and 1.11 ms for mmoe's jagged softmax (H100, its slow
host); the low end, so the price never overstates gemc's host cost. Exposed per call
only after the guard's sync (see the module doc)."""


@dataclass(frozen=True)
class AttentionPrices:
    """Forward+backward seconds of one matched attention both ways, and the choice."""

    kernel_s: float   # gemc's kernel work at its fill, copies included
    host_s: float     # gemc's host cost per call
    guarded: bool     # one host sync per call (the guard's check)
    sdpa_s: float     # the model's attention at the padded shape (its kernels)
    fill: float       # the fill the kernel work was priced at
    fill_source: str  # where that fill came from

    @property
    def gemc_s(self) -> float:
        """gemc's call: ``kernel + host`` after the guard's sync (nothing overlaps the
        host's issue then), the kernel alone without one."""
        return self.kernel_s + self.host_s if self.guarded else self.kernel_s

    @property
    def padded_s(self) -> float:
        """The model's attention at the padded shape."""
        return self.sdpa_s

    @property
    def gemc_slower(self) -> bool:
        return self.gemc_s > self.padded_s

    @property
    def kernel_slower(self) -> bool:
        """Slower even without the sync (e.g. run on a packed region's tokens)."""
        return self.kernel_s > self.padded_s

    def unsynced(self) -> AttentionPrices:
        """The same call run without its own sync (on a guarded packed region's tokens,
        checked once ahead of the graph)."""
        return replace(self, guarded=False)

    def why(self) -> str:
        """What makes gemc's call cost what it does, in words."""
        parts = [f"kernel {1e3 * self.kernel_s:.3g} ms at fill {self.fill:.3g} "
                 f"({self.fill_source})"]
        if self.guarded:
            parts.append(f"+ host {1e3 * self.host_s:.3g} ms a call not overlapped: the "
                         "guard's host sync drains the GPU queue")
        return ", ".join(parts)

    def as_dict(self) -> dict[str, float | str | bool]:
        """The prices as the plan records them (ms)."""
        return {"gemc_ms": round(1e3 * self.gemc_s, 6), "padded_ms": round(1e3 * self.padded_s, 6),
                "kernel_ms": round(1e3 * self.kernel_s, 6), "host_ms": round(1e3 * self.host_s, 6),
                "guarded": self.guarded, "fill": round(self.fill, 6),
                "fill_source": self.fill_source}


def attention_prices(kernel_s: float, sdpa_s: float, *, guarded: bool, fill: float,
                     fill_source: str, host_s: float = GEMC_ATTENTION_HOST_S
                     ) -> AttentionPrices:
    """The prices of one matched attention (see the module doc): ``kernel_s`` gemc's kernel
    work at ``fill``, ``sdpa_s`` the model's attention at the padded shape."""
    if kernel_s < 0 or sdpa_s < 0:
        raise ValueError(f"attention_prices: negative time (kernel {kernel_s}, sdpa {sdpa_s})")
    return AttentionPrices(float(kernel_s), float(host_s), bool(guarded), float(sdpa_s),
                           float(fill), fill_source)
