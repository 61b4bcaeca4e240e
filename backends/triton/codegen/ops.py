"""The pointwise vocabulary of generated kernels: forward expression and derivative per op.

Every value inside a generated kernel is an fp32 tile; an op's rule turns argument
expressions into the expression of its result (forward) and, given the adjoint ``g`` of the
result, into one adjoint contribution per argument (reverse mode). Rules only produce Triton
expressions over ``tl`` core functions that Triton 3.6 already has (``tl.erf``,
``tl.sigmoid``, ``tl.rsqrt``, ...); constants are written as literals, never as Python
globals (Triton 3.6 rejects non-constexpr globals inside ``@triton.jit`` functions).

The fusion pass may only put ops named in :data:`POINTWISE` into a group, so what the pass
forms and what the code generator can emit are the same set by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Tmp = Callable[[str], str]  # emits ``t = expr`` and returns the temporary's name
_SQRT1_2 = "0.7071067811865476"
_INV_SQRT_2PI = "0.3989422804014327"
_SQRT_2_OVER_PI = "0.7978845608028654"

# Casts that round inside the kernel (the value is kept in fp32 but rounded as eager would).
_ROUNDING_CASTS = {"bfloat16": "tl.bfloat16", "float16": "tl.float16"}
# pow exponents with an exact, cheap formulation (others are not fused).
POW_EXPONENTS = (-1.0, -0.5, 0.5, 1.0, 2.0, 3.0)


def lit(value: float) -> str:
    """A float literal Triton parses the same on every version (never a global name)."""
    return repr(float(value))


def _gelu_fwd(x: str, attrs: dict[str, Any]) -> str:
    if attrs.get("approximate", "none") == "tanh":
        inner = f"{_SQRT_2_OVER_PI} * ({x} + 0.044715 * {x} * {x} * {x})"
        return f"{x} * tl.sigmoid(2.0 * ({inner}))"  # 0.5 (1 + tanh u) == sigmoid(2u)
    return f"0.5 * {x} * (1.0 + tl.erf({x} * {_SQRT1_2}))"


def _gelu_bwd(x: str, g: str, attrs: dict[str, Any], tmp: Tmp) -> str:
    if attrs.get("approximate", "none") == "tanh":
        s = tmp(f"tl.sigmoid(2.0 * {_SQRT_2_OVER_PI} * ({x} + 0.044715 * {x} * {x} * {x}))")
        du = f"{_SQRT_2_OVER_PI} * (1.0 + 0.134145 * {x} * {x})"
        return f"{g} * ({s} + {x} * 2.0 * {s} * (1.0 - {s}) * {du})"
    cdf = f"0.5 * (1.0 + tl.erf({x} * {_SQRT1_2}))"
    pdf = f"{_INV_SQRT_2PI} * tl.exp(-0.5 * {x} * {x})"
    return f"{g} * ({cdf} + {x} * {pdf})"


def _pow_fwd(x: str, p: float) -> str:
    return {
        -1.0: f"1.0 / {x}",
        -0.5: f"tl.rsqrt({x})",
        0.5: f"tl.sqrt({x})",
        1.0: x,
        2.0: f"{x} * {x}",
        3.0: f"{x} * {x} * {x}",
    }[p]


def _pow_bwd(x: str, out: str, g: str, p: float) -> str:
    return {
        -1.0: f"-{g} * {out} * {out}",
        -0.5: f"-0.5 * {g} * {out} * {out} * {out}",
        0.5: f"0.5 * {g} / {out}",
        1.0: g,
        2.0: f"2.0 * {g} * {x}",
        3.0: f"3.0 * {g} * {x} * {x}",
    }[p]


def _cast_fwd(x: str, attrs: dict[str, Any]) -> str:
    rounded = _ROUNDING_CASTS.get(attrs.get("dtype", "float32"))
    return f"{x}.to({rounded}).to(tl.float32)" if rounded else x


def _scaled(attrs: dict[str, Any]) -> str:
    """``"<alpha> * "`` for add/sub's alpha, nothing when it is 1."""
    alpha = float(attrs.get("alpha", 1.0))
    return "" if alpha == 1.0 else f"{lit(alpha)} * "


def forward(op: str, a: list[str], attrs: dict[str, Any]) -> str:
    """The expression of ``op`` applied to argument expressions ``a``."""
    alpha = _scaled(attrs)
    rules: dict[str, Callable[[], str]] = {
        "identity": lambda: a[0],
        "cast": lambda: _cast_fwd(a[0], attrs),
        "add": lambda: f"{a[0]} + {alpha}{a[1]}",
        "sub": lambda: f"{a[0]} - {alpha}{a[1]}",
        "rsub": lambda: f"{a[1]} - {alpha}{a[0]}",
        "mul": lambda: f"{a[0]} * {a[1]}",
        "div": lambda: f"{a[0]} / {a[1]}",
        "neg": lambda: f"-{a[0]}",
        "gelu": lambda: _gelu_fwd(a[0], attrs),
        "silu": lambda: f"{a[0]} * tl.sigmoid({a[0]})",
        "relu": lambda: f"tl.maximum({a[0]}, 0.0)",
        "sigmoid": lambda: f"tl.sigmoid({a[0]})",
        "tanh": lambda: f"2.0 * tl.sigmoid(2.0 * {a[0]}) - 1.0",
        "exp": lambda: f"tl.exp({a[0]})",
        "log": lambda: f"tl.log({a[0]})",
        "sqrt": lambda: f"tl.sqrt({a[0]})",
        "rsqrt": lambda: f"tl.rsqrt({a[0]})",
        "abs": lambda: f"tl.abs({a[0]})",
        "pow": lambda: _pow_fwd(a[0], float(attrs["exponent"])),
        "clamp": lambda: _clamp_fwd(a[0], attrs),
        "where": lambda: f"tl.where({a[0]} != 0.0, {a[1]}, {a[2]})",
    }
    return rules[op]()


def _clamp_fwd(x: str, attrs: dict[str, Any]) -> str:
    if attrs.get("min") is not None:
        x = f"tl.maximum({x}, {lit(attrs['min'])})"
    if attrs.get("max") is not None:
        x = f"tl.minimum({x}, {lit(attrs['max'])})"
    return x


def _clamp_bwd(x: str, g: str, attrs: dict[str, Any]) -> str:
    conds = []
    if attrs.get("min") is not None:
        conds.append(f"({x} >= {lit(attrs['min'])})")
    if attrs.get("max") is not None:
        conds.append(f"({x} <= {lit(attrs['max'])})")
    return f"tl.where({' & '.join(conds)}, {g}, 0.0)" if conds else g


def backward(
    op: str, a: Sequence[str], out: str, g: str, attrs: dict[str, Any], tmp: Tmp
) -> list[tuple[int, str]]:
    """Adjoint contributions ``(argument index, expression)`` of ``op`` given ``g``.

    ``a`` are the forward argument expressions and ``out`` the forward result, both
    recomputed in the backward kernel (cheaper than saving them). ``a`` may load on
    indexing (:class:`.emit.Tile` passes lazy arguments): index it only for a derivative
    that reads the argument, so ``x + r``'s backward loads neither."""
    alpha = _scaled(attrs)
    if op in ("identity", "cast"):
        return [(0, g)]
    if op == "add":
        return [(0, g), (1, f"{alpha}{g}")]
    if op == "sub":
        return [(0, g), (1, f"-{alpha}{g}")]
    if op == "rsub":
        return [(0, f"-{alpha}{g}"), (1, g)]
    if op == "mul":
        return [(0, f"{g} * {a[1]}"), (1, f"{g} * {a[0]}")]
    if op == "div":
        return [(0, f"{g} / {a[1]}"), (1, f"-{g} * {out} / {a[1]}")]
    if op == "where":
        return [(1, f"tl.where({a[0]} != 0.0, {g}, 0.0)"),
                (2, f"tl.where({a[0]} != 0.0, 0.0, {g})")]
    unary = {  # a[0] read only where the derivative needs the input (it may be a load)
        "neg": lambda: f"-{g}",
        "gelu": lambda: _gelu_bwd(a[0], g, attrs, tmp),
        "silu": lambda: _silu_bwd(a[0], g, tmp),
        "relu": lambda: f"tl.where({a[0]} > 0.0, {g}, 0.0)",
        "sigmoid": lambda: f"{g} * {out} * (1.0 - {out})",
        "tanh": lambda: f"{g} * (1.0 - {out} * {out})",
        "exp": lambda: f"{g} * {out}",
        "log": lambda: f"{g} / {a[0]}",
        "sqrt": lambda: f"0.5 * {g} / {out}",
        "rsqrt": lambda: f"-0.5 * {g} * {out} * {out} * {out}",
        "abs": lambda: f"tl.where({a[0]} > 0.0, {g}, tl.where({a[0]} < 0.0, -{g}, 0.0))",
        "pow": lambda: _pow_bwd(a[0], out, g, float(attrs["exponent"])),
        "clamp": lambda: _clamp_bwd(a[0], g, attrs),
    }
    return [(0, unary[op]())]


def _silu_bwd(x: str, g: str, tmp: Tmp) -> str:
    s = tmp(f"tl.sigmoid({x})")
    return f"{g} * {s} * (1.0 + {x} * (1.0 - {s}))"


POINTWISE = frozenset(
    ["identity", "cast", "add", "sub", "rsub", "mul", "div", "neg", "gelu", "silu", "relu",
     "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt", "abs", "pow", "clamp", "where"]
)
"""Ops a generated kernel can compute, forward and backward."""

AFFINE = frozenset(["identity", "cast", "add", "sub", "rsub", "neg"])
"""Ops whose derivative needs no forward value: a GEMM whose epilogue holds only these
(and constant scales) need not save its pre-epilogue output for the backward."""
