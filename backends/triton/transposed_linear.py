"""``linear(x.transpose(-1, -2), w, b)`` without copying the transposed ``x``.

See ``passes/fold_transposed_linear``: the product is ``w @ x`` per batch, a batched GEMM
reading ``x`` in place with ``w`` at batch stride 0; its transpose is the linear's output
(a view). Autograd differentiates the batched GEMM as usual (the weight's gradient is the
batch sum of ``grad @ x.T``, the input's ``w.T @ grad``, both contiguous).
"""

from __future__ import annotations

import torch


def transposed_linear(xt: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same value as ``F.linear(xt, weight, bias)`` for ``xt`` a ``transpose(-1, -2)`` view
    (or any ``[..., d, n]`` tensor), in the dtype autocast would give it."""
    x = xt.transpose(-1, -2)  # [..., n, d], the tensor the view was taken of
    lead = x.shape[:-2]
    x3 = x.reshape(-1, *x.shape[-2:])  # a view when the leading dims are contiguous
    dev = x.device.type
    w = weight
    if torch.is_autocast_enabled(dev):
        # cast before the expand: autocast would cast the expanded (overlapping) weight
        # into a full [B, out, n] copy
        dt = torch.get_autocast_dtype(dev)
        w, x3 = w.to(dt), x3.to(dt)
    out = torch.bmm(w.expand(x3.shape[0], *w.shape), x3)  # [B, out, d]
    out = out.reshape(*lead, *out.shape[-2:]).transpose(-1, -2)  # [..., d, out]
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out
