"""Which softmax attention backward gemc runs: one kernel for short rows, two otherwise.

Why in the core: the runner's kernels (``backends/triton/jagged_attention``) decide it per
call, and the cost model (``cost_model/attention_choice``) prices a region attention's
launches by the same rule; the compiler's middle may not import a backend, so the rule
lives here, once, for both.

The one-kernel backward (``backends/triton/softmax_row_backward``: one program per
(sequence, head), delta, then dq, dk, dv from each tile pair once) runs where every row
is short (``max_len`` at most :data:`SHORT_ROWS`) at a head dim that pads to at most 64,
with the switch :data:`ENV` on (unset: on). Elsewhere the dq and dk/dv kernels run.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "SHORT_ROWS", "backward_kernels", "enabled_from_env", "padded_head_dim",
           "short_rows", "switch_from_env"]

ENV = "GEMC_FUSED_SOFTMAX_SHORT_ROWS"
"""``0``: the two-kernel softmax backward everywhere; ``1`` or unset: one kernel for
short rows."""

SHORT_ROWS = 128
"""Rows at most this long (``max_len``) at a padded head dim <= 64 are short (the kernels'
short-row configs and the one-kernel backward both read it; the kernels' module says why)."""

MIN_DOT = 16
"""Smallest extent ``tl.dot`` accepts: a head dim pads to a power of two at least this."""


def switch_from_env(name: str, on: str, off: str, default: str = "1") -> bool:
    """Environment switch ``name`` = 1 (``on``) / 0 (``off``), unset: ``default``. Anything
    else is refused by name rather than read as either."""
    value = os.environ.get(name, default).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: set it to 1 ({on}) or 0 ({off}), or unset it")
    return value == "1"


def enabled_from_env() -> bool:
    """:data:`ENV` (:func:`switch_from_env`; unset: on)."""
    return switch_from_env(ENV, "the one-kernel softmax backward of short rows",
                           "the two-kernel one")


def padded_head_dim(head_dim: int) -> int:
    """The head dim as the kernels tile it: the next power of two, at least :data:`MIN_DOT`."""
    return max(MIN_DOT, 1 << (max(int(head_dim), 1) - 1).bit_length())


def short_rows(max_len: float, block_d: int) -> bool:
    """Whether rows of at most ``max_len`` tokens at a padded head dim ``block_d`` are short."""
    return 0 < max_len <= SHORT_ROWS + 0.5 and block_d <= 64


def backward_kernels(max_len: int, head_dim: int, enabled: bool | None = None) -> int:
    """Kernels a softmax attention's backward launches at this shape: 1 where the one-kernel
    backward runs (``enabled``; None: :func:`enabled_from_env`), else 2 (dq, dk/dv)."""
    on = enabled_from_env() if enabled is None else enabled
    return 1 if on and short_rows(max_len, padded_head_dim(head_dim)) else 2
