"""Every kernel kind a plan may list, declared once: the facts each layer reads about it.

A kernel kind is recognised by a pass, written into ``plan["kernels"]`` by the plan
builder, checked by the plan validator and executed by the runner. Those layers need the
same few facts about a kind (how the runner executes it, whether gemc's kernel competes
with Inductor's code for its nodes, which plan-entry fields it needs, which library module
holds its kernel); declaring them here, in the core, keeps the layers from each keeping a
list of their own that a new kind must be added to.

What the plan builder, the interpreter and the emitter do with a graph-mode kind (its plan
entry's fields, what the unit reads, builds and runs, its call in the compiled graph) is
one object per kind, its ``KindImplementation`` in ``gemc.backends.triton.kinds`` (the
backend: code the core may not import); ``tests/test_kernel_kinds.py`` checks that the
registered kinds are exactly the declared graph-mode kinds.

Module-mode kinds (kernels that swap whole modules, registered by a backend module the
runner imports with ``--kernel-module``, see ``gemc.backends.torch.kernels``) are not the
compiler's: a kind no declaration names is left to that registry, which refuses it by name
when nothing registered it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

MODES = ("graph", "module")
CHOICES = ("gemc", "inductor")
ENTRY_FIELDS = ("name", "kind", "nodes")
"""Fields every entry of a declared kind has: its name, its kind, the graph nodes it covers."""


@dataclass(frozen=True)
class KernelKind:
    """One kind's kind-level facts.

    ``mode``: ``graph`` (the runner executes the captured graph with the kernel in place of
    ``nodes``) or ``module`` (an applier swaps modules; multi-rank module-mode runs keep it).
    ``layout``: not a call replacing its nodes but a layout the runner keeps a region's
    values in (``packed_tokens``: its nodes overlap other kinds' units), set up before them.
    ``generated``: a kernel generated from the entry's structure, for nodes Inductor also
    fuses, so the two compete per group (measured, or ``default_choice`` without a
    measurement); a kind that does not compete always runs gemc's kernel.
    ``fields``: the entry fields (beyond :data:`ENTRY_FIELDS`) the runner reads, required by
    the plan validator. ``library``: the module of the runner's kernel, recorded in the
    entry (None for generated kernels: their source is in the plan). ``aten_formulation``:
    the kernel is ATen ops that Inductor compiles with their neighbours (the cost model
    prices its nodes as fused code, as it does a generated group's: see
    :attr:`compiled_by_inductor`), not a kernel of its own.
    """

    name: str
    fields: tuple[str, ...]
    library: str | None = None
    mode: str = "graph"
    layout: bool = False
    generated: bool = False
    default_choice: str = "gemc"
    aten_formulation: bool = False

    @property
    def compiled_by_inductor(self) -> bool:
        """Whether Inductor compiles the kind's nodes in a compiled run (a generated group's
        code, unless a measurement picked gemc's kernel; an ATen formulation's ops)."""
        return self.generated or self.aten_formulation

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"kernel kind {self.name}: mode {self.mode!r} not in {MODES}")
        if self.default_choice not in CHOICES:
            raise ValueError(f"kernel kind {self.name}: default choice "
                             f"{self.default_choice!r} not in {CHOICES}")
        if not self.generated and self.default_choice != "gemc":
            raise ValueError(f"kernel kind {self.name}: only a generated kind competes with "
                             "Inductor, so only its default choice may be 'inductor'")
        if self.layout and self.mode != "graph":
            raise ValueError(f"kernel kind {self.name}: a layout is a graph-mode kind")
        if self.generated and self.aten_formulation:
            raise ValueError(f"kernel kind {self.name}: a generated kernel is Triton code, "
                             "not an ATen formulation")

    def missing(self, entry: Mapping[str, Any]) -> list[str]:
        """The fields a plan entry of this kind lacks (empty: it has all it needs)."""
        return [f for f in (*ENTRY_FIELDS, *self.fields) if f not in entry]


_GENERATED_FIELDS = ("structure", "binding", "sha256")
_TRITON = "gemc.backends.triton."


def _generated(name: str) -> KernelKind:
    # Inductor's fused code is the safe default: it never loses to the op-by-op graph and
    # fuses across the group's border; gemc's kernel runs where a measurement recorded a win
    return KernelKind(name, _GENERATED_FIELDS, generated=True, default_choice="inductor")


DECLARED: tuple[KernelKind, ...] = (
    _generated("gemm_epilogue"),
    _generated("pointwise"),
    _generated("norm"),
    _generated("reduction"),
    KernelKind("batched_embedding_bag", ("tables", "optimizer"), _TRITON + "embedding_bag"),
    KernelKind("jagged_attention", ("q", "k", "v", "offsets", "clamp_min", "max_len", "scale"),
               _TRITON + "jagged_attention"),
    KernelKind("key_padding_attention", ("q", "k", "v", "mask", "scale", "causal", "additive",
                                         "zero_padding_queries"),
               _TRITON + "key_padding_attention"),
    KernelKind("jagged_silu_attention", ("q", "k", "v", "output", "norm", "scale", "causal",
                                         "query_mask"),
               _TRITON + "key_padding_attention"),
    KernelKind("jagged_query_attention", ("q", "k", "v", "output", "queries", "keys", "heads",
                                          "head_dim", "scale"),
               _TRITON + "jagged_query_attention"),
    KernelKind("packed_tokens", ("dims", "padded_from", "clamp_min", "max_len"),
               _TRITON + "packed_tokens", layout=True),
    KernelKind("transposed_linear", ("input", "weight"), _TRITON + "transposed_linear",
               aten_formulation=True),
)

_REGISTRY: dict[str, KernelKind] = {}

KINDS: Mapping[str, KernelKind] = MappingProxyType(_REGISTRY)
"""The declared kinds by name, the built-in ones (:data:`DECLARED`) first: a read-only view
that follows :func:`declare`."""


def declare(kind: KernelKind) -> KernelKind:
    """Make a kind's declaration known to the core's readers (the plan validator, the cost
    model, the runner's choice of graph mode): a kind from outside gemc, declared by
    ``gemc.backends.triton.kinds.register`` with its implementation. A name already
    declared is refused (two declarations of one kind would disagree)."""
    if kind.name in _REGISTRY:
        raise ValueError(f"kernel kind {kind.name} is already declared")
    _REGISTRY[kind.name] = kind
    return kind


def forget(name: str) -> None:
    """Forget a kind :func:`declare` added (a test's, after it ran); built-in ones stay."""
    if any(k.name == name for k in DECLARED):
        raise ValueError(f"kernel kind {name} is built in")
    del _REGISTRY[name]


for _kind in DECLARED:
    declare(_kind)


def graph_kinds() -> tuple[str, ...]:
    """Names of the kinds the runner executes in graph mode (declaration order); the rest go
    to the module-mode registry (``gemc.backends.torch.kernels``)."""
    return tuple(k.name for k in KINDS.values() if k.mode == "graph")


def generated_kinds() -> tuple[str, ...]:
    """Names of the kinds whose kernel competes with Inductor's code for its group."""
    return tuple(k.name for k in KINDS.values() if k.generated)


def layout_kinds() -> tuple[str, ...]:
    """Names of the graph-mode kinds that are layouts, not calls replacing their nodes."""
    return tuple(k.name for k in KINDS.values() if k.layout)


def unit_kinds() -> tuple[str, ...]:
    """Names of the graph-mode kinds that run as one call in place of their nodes."""
    return tuple(k.name for k in KINDS.values() if k.mode == "graph" and not k.layout)


def inductor_compiled_kinds() -> tuple[str, ...]:
    """Names of the kinds whose nodes Inductor compiles (:attr:`KernelKind.compiled_by_inductor`):
    the cost model prices them as fused code, every other kind as a gemc island."""
    return tuple(k.name for k in KINDS.values() if k.compiled_by_inductor)
