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
MIN_SQNR_DB = 25.0
"""The lowest SQNR (dB against fp32) a GEMM may have in bf16 or fp8: the precision pass's
default bound (``PrecisionOptions.min_sqnr_db``, ``gemc compile --min-sqnr-db``), which the
plan records in its ``"*"`` entry's ``rule``. Here, in the core, so the runner's fp8 audit
(``gemc.backends.torch.fp8_audit``) holds a plan without a recorded rule to the same bound
without importing the compiler."""


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
ones, ldexp x2, cast) on the [M, 1] / [1, N] amax."""


def quantize_kernels(numel: int, elt_bytes: int, relayout: bool) -> list[int]:
    """Bytes moved by each streaming kernel of ``gemc.backends.torch.fp8.quantize`` (+ the
    layout copy that its ``fp8_matmul`` adds where the operand is not already in
    ``_scaled_mm``'s layout), for the cost model: it prices exactly what the runner
    launches (change both together)."""
    out = [numel * elt_bytes]  # amax
    work = elt_bytes
    if elt_bytes not in (2, 4):  # fp16 goes through fp32
        out.append(numel * (elt_bytes + 4))
        work = 4
    out += [numel * (work + work), numel * (work + 1)]  # scale multiply, cast to fp8
    if relayout:
        out.append(2 * numel)
    return out


EAGER_QUANT = "eager"
COMPILED_QUANT = "compiled"
QUANT_PATHS = (EAGER_QUANT, COMPILED_QUANT)
"""How the runner quantises an fp8 GEMM's operands, as the precision pass prices it:
``eager`` kernel by kernel (:func:`quantize_kernels`), ``compiled`` under torch.compile
(:func:`compiled_quantize_bytes`)."""


def compiled_quantize_bytes(numel: int, rows: int, elt_bytes: int) -> int:
    """Bytes the compiled fp8 linear moves to quantise one operand of ``rows`` scales.

    Under torch.compile the quantisation is ATen ops Inductor fuses: the amax, the scale and
    the cast (and the layout copy, a transposed store) are at most one pass -- read the
    operand, write its fp8 copy and one fp32 scale per row. Fused into the producer's kernel
    (a LayerNorm writing its fp8 copy as well) the read is of registers, so this is an upper
    bound that does not depend on which fusions Inductor makes."""
    return numel * (elt_bytes + 1) + 4 * rows
