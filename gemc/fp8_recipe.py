"""The fp8 recipe types: what precision each of a linear layer's three GEMMs runs in.

In the core so that the compiler's precision pass (which chooses recipes and prices their
quantization) and the runner (``gemc.backends.torch.fp8``, which executes them) share one
definition without the compiler importing the runner. Pure Python: no torch.

The three GEMMs of a linear layer: ``fwd`` (y = x W^T), ``dgrad`` (dx = dy W) and ``wgrad``
(dW = dy^T x); see ``gemc.backends.torch.fp8`` for the scaling and the kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROWWISE = "rowwise"
TENSORWISE = "tensorwise"
SCALINGS = (ROWWISE, TENSORWISE)
GEMMS = ("fwd", "dgrad", "wgrad")
DTYPES = ("fp32", "bf16", "fp8")
ALIGN = 16  # torch._scaled_mm: K and N divisible by 16


# ----------------------------------------------------------------------------- choices


@dataclass(frozen=True)
class GemmChoice:
    """The precision of one GEMM: fp32, bf16, or fp8 with a scaling."""

    dtype: str = "bf16"
    scaling: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"GEMM dtype {self.dtype!r} is not one of {DTYPES}")
        if self.dtype == "fp8" and self.scaling not in SCALINGS:
            raise ValueError(f"an fp8 GEMM needs a scaling in {SCALINGS}, got {self.scaling!r}")
        if self.dtype != "fp8" and self.scaling is not None:
            raise ValueError(f"only fp8 GEMMs have a scaling ({self.dtype} has {self.scaling!r})")

    @property
    def label(self) -> str:
        """'fp32', 'bf16', 'fp8-row' or 'fp8-tensor' (dumps, tables)."""
        if self.dtype != "fp8":
            return self.dtype
        return "fp8-row" if self.scaling == ROWWISE else "fp8-tensor"

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "scaling": self.scaling}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GemmChoice:
        return cls(str(d.get("dtype", "bf16")), d.get("scaling"))


FP32 = GemmChoice("fp32")
BF16 = GemmChoice("bf16")
FP8_ROW = GemmChoice("fp8", ROWWISE)
FP8_TENSOR = GemmChoice("fp8", TENSORWISE)


@dataclass(frozen=True)
class Fp8Recipe:
    """The choices of a linear layer's three GEMMs."""

    fwd: GemmChoice = FP8_ROW
    dgrad: GemmChoice = FP8_ROW
    wgrad: GemmChoice = FP8_ROW

    @property
    def any_fp8(self) -> bool:
        return any(c.dtype == "fp8" for c in self.choices().values())

    def choices(self) -> dict[str, GemmChoice]:
        return {"fwd": self.fwd, "dgrad": self.dgrad, "wgrad": self.wgrad}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {g: c.to_dict() for g, c in self.choices().items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Fp8Recipe:
        """From ``{"fwd": {"dtype", "scaling", ...}, "dgrad": ..., "wgrad": ...}`` (extra
        keys, such as a plan entry's measurements, are ignored)."""
        missing = [g for g in GEMMS if g not in d]
        if missing:
            raise ValueError(f"fp8 recipe lacks the GEMM(s) {missing}")
        return cls(*(GemmChoice.from_dict(d[g]) for g in GEMMS))

    @classmethod
    def uniform(cls, choice: GemmChoice) -> Fp8Recipe:
        return cls(choice, choice, choice)


SCALE_KERNELS = 7
"""Tiny launches per quantized operand for the scale arithmetic (clamp, divide, frexp,
ones, ldexp x2, cast) on the [M, 1] / [1, N] amax (the eager, tensor-wise path)."""


def one_pass_quantize_bytes(numel: int, elt_bytes: int, relayout: bool) -> int:
    """Bytes moved by the one kernel that quantizes a *row-wise* operand on the GPU
    (``gemc.backends.triton.fp8_quant`` through ``gemc.backends.torch.fp8_ops``): read it
    once and write 1 byte an element where it is already in ``_scaled_mm``'s layout
    (``rowwise_quant``); read it twice (amax, then scale) and write the transposed fp8 copy
    where it is not (``colwise_quant``). Scales are computed in registers (4 bytes a row,
    not counted). The cost model prices exactly this (change both together)."""
    return numel * ((2 if relayout else 1) * elt_bytes + 1)


def quantize_kernels(numel: int, elt_bytes: int, relayout: bool) -> list[int]:
    """Bytes moved by each streaming kernel of ``gemc.backends.torch.fp8.quantize`` (+ the
    layout copy that its ``fp8_matmul`` adds where the operand is not already in
    ``_scaled_mm``'s layout): the tensor-wise path (row-wise runs
    :func:`one_pass_quantize_bytes` on a GPU). For the cost model: it prices exactly what
    the runner launches (change both together)."""
    out = [numel * elt_bytes]  # amax
    work = elt_bytes
    if elt_bytes not in (2, 4):  # fp16 goes through fp32
        out.append(numel * (elt_bytes + 4))
        work = 4
    out += [numel * (work + work), numel * (work + 1)]  # scale multiply, cast to fp8
    if relayout:
        out.append(2 * numel)
    return out


FUSABLE_NORMS = {"layer_norm": "layer", "rms_norm": "rms"}
"""ATen norms (packet name -> the kernel's kind) whose output graph mode writes in fp8
straight from the norm kernel (``gemc::norm_fp8_linear``)."""


def fusable_norm(op: str, normalized_shape: Any, users: int) -> str | None:
    """The kind of a norm node that graph mode fuses into the fp8 linear reading it: a
    LayerNorm / RMSNorm over the last dim alone whose only user is that linear (another
    reader would need the bf16 output the fused kernel never writes). One rule for the
    runner's rewrite and the precision pass's price."""
    if op not in FUSABLE_NORMS or users != 1:
        return None
    if not isinstance(normalized_shape, (list, tuple)) or len(normalized_shape) != 1:
        return None
    return FUSABLE_NORMS[op]


def fused_norm_bytes(numel: int, out_elt_bytes: int, in_elt_bytes: int) -> tuple[int, int]:
    """(bytes the forward saves, bytes the backward adds) when a norm's output is written in
    fp8 by the norm (row scales: 4 bytes a row, not counted): forward, the norm writes 1
    byte an element instead of ``out_elt_bytes`` and the GEMM's input needs no quantizing
    pass; backward, the weight gradient recomputes the normalised rows from the norm's input
    (read ``in_elt_bytes``, written fp32) before quantizing them along the tokens."""
    return numel * (out_elt_bytes - 1), numel * (in_elt_bytes + 4)
