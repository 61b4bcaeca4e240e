"""The one place the jagged attentions' output buffers are made uninitialised.

Why: the attention kernels (:mod:`.jagged_attention`, :mod:`.silu_key_block_backward`,
:mod:`.softmax_row_backward`, :mod:`.varlen_key_attention`) write every element of their
outputs: every row a sequence covers, and zeros into the rows no sequence covers (spare
slots past ``offsets[-1]`` of a packed buffer, a padded row's tail: ``jagged_attention._zero_uncovered``, called by the
kernel that stores the buffer's other rows). Zeroing whole buffers first cost 0.17 ms of
MMoE's 1.84-ms attention fwd+bwd on an H100 (four ``[T, H, D]`` fills, 0.55 GB;
twenty-third session); a zero-fill launch of the uncovered rows alone then cost the host
two of a fwd+bwd's five launches (issue 17, twenty-sixth session's host profile). A test
patches :func:`uninitialised` to fill the buffers with NaN and sees that every element was
written.
"""

from __future__ import annotations

import torch

__all__ = ["contiguous_strides", "uninitialised"]


def contiguous_strides(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, as ``torch.empty(shape).stride()``
    gives them (a size-1 dim's stride is the product of the sizes after it), in Python.
    Why not a ``meta`` tensor's stride: making one cost ~20 us of host each time, per
    buffer set of every attention call (twenty-eighth session's launch probe, an H100)."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(int(shape[i + 1]), 1)
    return tuple(strides)


def uninitialised(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """An output buffer that a kernel writes in full (``torch.empty_strided``): the one
    place such buffers are made, so a test can fill them with NaN instead and see that
    every element was written."""
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)
