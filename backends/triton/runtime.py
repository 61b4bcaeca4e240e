"""What every hand-written gemc kernel needs to know about where it runs.

One module owns these facts so the kernels do not each re-derive them:

* whether Triton runs *interpreted* (``TRITON_INTERPRET=1``, the CPU test path), decided once
  at import, before any gemc kernel is decorated (``@triton.jit`` reads the variable then). On
  a machine without CUDA, where compiled kernels cannot run at all, importing this module sets
  ``TRITON_INTERPRET=1`` unless the variable is already set, so the kernels work on CPU
  tensors (slowly) wherever they are imported first;
* the autotune config lists: the interpreter gets a single small config (autotuning an
  interpreted kernel would only multiply the test time), the GPU gets the short list written
  for Hopper next to each kernel (which of them a launch compiles, and whether it times
  them, is :mod:`.config_choice`'s decision);
* block-size arithmetic (powers of two, the 16-wide minimum of ``tl.dot``);
* ``mma``: the one matrix-multiply every kernel calls, with fp32 accumulation. It routes
  around an interpreter defect (Triton 3.9's interpreter multiplies bf16 tiles as their raw
  uint16 bit patterns) by upcasting to fp32 there; a bf16 x bf16 product is exact in fp32, so
  the interpreted result equals what the tensor cores compute with fp32 accumulation;
* argument checks shared by the jagged kernels (offsets, devices).

Only the subset of Triton that 3.6 already has is used here and in the kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported here: see below

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def _decide_interpreted() -> bool:
    """Whether gemc's kernels can run in the interpreter: the variable set *and*
    ``triton.language``'s own helpers interpreted. Triton decorates those once, at its
    first import; a process that imported it before the variable was set (``torch.export``
    does, through ``torch._dynamo``: a Python script that compiles a plan and then runs it
    on the CPU) has compiled-mode helpers that no interpreted kernel may call ("Cannot
    call @triton.jit'd outside of the scope of a kernel", a crash in the sparse optimizer's
    row update). There the kernels count as not runnable on the CPU: host functions take
    their ATen fallbacks, and :func:`check_launchable` names the fix."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    return type(tl.cdiv).__name__ == "InterpretedFunction"


INTERPRETED: bool = _decide_interpreted()
"""True when kernels run in Triton's CPU interpreter (tests on machines without a GPU)."""

_INTERPRETED = tl.constexpr(INTERPRETED)

MIN_DOT = 16
"""Smallest extent ``tl.dot`` accepts along any dimension."""


def kernel_runs_on(t: torch.Tensor) -> bool:
    """Whether a host function with an ATen fallback takes its Triton kernel for ``t``:
    on a GPU, in the interpreter, and on ``meta`` (the warm-up runs host code on meta
    tensors and records the launch, :func:`gemc.backends.triton.warm.dry_launches`; a
    host function that took its fallback there derived nothing, and its kernel compiled
    in the training process at its first launch on the H200: the masked row update of
    MMoE's dense-gradient tables, 0.6 s of its first step)."""
    return t.is_cuda or t.device.type == "meta" or INTERPRETED


def is_interpreted() -> bool:
    """Whether Triton kernels run in the CPU interpreter (set by ``TRITON_INTERPRET=1``)."""
    return INTERPRETED


def launched_directly(kernel: Any) -> Any:
    """A kernel as launched outside any op: directly (``torch.library.wrap_triton``'s
    stand-in, for a launch function shared by an op and an eager call)."""
    return kernel


def kernel_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any],
              interpreted: bool = INTERPRETED) -> Any:
    """``gemc::<name>`` running ``impl``: a ``triton_op`` on a GPU, a ``custom_op`` with
    ``fake`` as its fake under the interpreter.

    Why a ``triton_op`` on a GPU: as opaque ``custom_op``s fp8's quantisers cost ~130-170 us
    of host a call on the H200 (Python dispatch into the op, then Triton's launcher binding
    the arguments), 0.9 ms of the compiled LayerNorm -> Linear's 3.9 ms step at M = 8,192
    (benchmarks/results/session11/fp8_unit_profile.json). A ``triton_op`` is decomposed by
    AOTAutograd into its launches (``impl`` launching through ``wrap_triton``), which
    Inductor compiles into its own code and launches through its own launcher, as it does
    its generated kernels. Under the interpreter (CPU tensors) a ``custom_op``:
    ``wrap_triton`` hands an interpreted kernel back unwrapped, so a trace would run it on
    fake tensors, and Inductor cannot compile a user Triton kernel for the CPU; the launch
    code is the same either way."""
    if not interpreted:
        return torch.library.triton_op(f"gemc::{name}", impl, mutates_args=())
    op = torch.library.custom_op(f"gemc::{name}", impl, mutates_args=())
    op.register_fake(fake)
    return op


def host_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short vector of host values (a few per table, known from shapes) on ``device``.

    Why two ways: a copy from pageable host memory cannot be captured into a CUDA graph
    (``torch.compile(mode="reduce-overhead")`` over gemc's graph refused TransAct's first
    step so, thirtieth session), while a fill per value can (the value is the launch's
    argument, replayed as captured). Outside a capture one copy is one launch where the
    fills are one per value, so the copy stays the eager path."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return filled_values(values, dtype, device)
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def filled_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`host_values` under a CUDA graph capture: one fill per value, no host copy."""
    if not values:
        return torch.empty((0,), dtype=dtype, device=device)
    return torch.stack([torch.full((), v, dtype=dtype, device=device) for v in values])


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): Triton block extents must be powers of two.
    Plain Python: recent Triton wraps its own helper as a constexpr function that costs
    microseconds per host call."""
    return max(minimum, 1 << (max(int(n), 1) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids, in plain Python (see :func:`next_pow2`)."""
    return -(-a // b)


def autotune_configs(
    gpu: list[triton.Config], interpreted: triton.Config | list[triton.Config]
) -> list[triton.Config]:
    """The configs a kernel autotunes over: Hopper's short list, or under the interpreter
    one (several where a config's meta-parameter picks a code path the CPU tests force)."""
    if not INTERPRETED:
        return gpu
    return list(interpreted) if isinstance(interpreted, list) else [interpreted]


def check_launchable(*tensors: torch.Tensor) -> None:
    """Fail early with a clear message when a kernel cannot run on these tensors' device.
    ``meta`` tensors pass: the warm-up runs host code on them and records the launches
    instead of making them (:func:`gemc.backends.triton.warm.dry_launches`)."""
    for t in tensors:
        if t.device.type == "meta":
            continue
        if INTERPRETED:
            if t.device.type != "cpu":
                raise ValueError("TRITON_INTERPRET=1 runs kernels on CPU tensors only")
        elif t.device.type != "cuda":
            raise ValueError(
                f"gemc Triton kernels need CUDA tensors, got {t.device}; "
                "set TRITON_INTERPRET=1 (before importing triton: start Python with it, "
                "as Triton was imported first here) to run them on the CPU"
            )


def check_offsets(offsets: torch.Tensor, name: str = "offsets") -> int:
    """Validate a jagged offsets vector (int32/int64, 1-D, length B+1) and return B."""
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must be 1-D with B+1 entries, got shape {tuple(offsets.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {offsets.dtype}")
    return offsets.numel() - 1


def lengths_of(offsets: torch.Tensor) -> torch.Tensor:
    """Per-sequence lengths from offsets (a device op, no host sync)."""
    return offsets[1:] - offsets[:-1]


def max_length(offsets: torch.Tensor) -> int:
    """Longest sequence of a jagged batch; costs a host sync, so callers that know it pass it."""
    if offsets.numel() <= 1:
        return 0
    return int(lengths_of(offsets).max().item())


@triton.jit
def mma(a, b, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation; IEEE fp32 products when ``IEEE`` (fp32 inputs)."""
    if _INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
