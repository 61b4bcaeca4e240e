"""The graph-mode kernel kinds' implementations, one :class:`KindImplementation` per kind.

Every module listed in :data:`MODULES` holds the implementations of its kinds in a tuple
``IMPLEMENTATIONS``; importing this package registers them, in that order. The plan
builder (``entry``, ``layout_entries``), the interpreter (``reads``, ``setup``, ``run``,
``layout_setup``) and the emitter (``emit``) look a kind up here by its name, so a new kind
is its declaration (``gemc.kernel_kinds``), one module here and its kernel; see
``docs/architecture.md`` ("Where a new kernel kind goes") for a worked example.
``tests/test_kernel_kinds.py`` checks that the registered kinds are the declared
graph-mode kinds.

:func:`register` also takes a kind from outside this list (a test's, an experiment's),
and declares it in the core (``gemc.kernel_kinds.declare``) when no built-in declaration
names it: the plan builder, the interpreter, the emitter, the plan validator, the cost
model and the runner's choice of graph mode then handle it as they handle the built-in
ones, so such a kind is one file (see ``docs/architecture.md``, "A kind in one file").
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from gemc import kernel_kinds

from . import attention, embeddings, generated, packed_tokens, transposed_linear
from .implementation import Entry, EntryBuilder, Env, KindImplementation, Unit, named

__all__ = ["MODULES", "Entry", "EntryBuilder", "Env", "KindImplementation", "Unit", "layouts",
           "named", "register", "registered", "unit", "unregister"]

MODULES = (generated, embeddings, attention, packed_tokens, transposed_linear)
"""The modules whose ``IMPLEMENTATIONS`` are registered on import, in this order."""

_REGISTRY: dict[str, KindImplementation] = {}


_DECLARED_HERE: set[str] = set()  # kinds register() declared in the core


def register(implementation: KindImplementation) -> KindImplementation:
    """Make a kind known to the plan builder, the interpreter and the emitter, and, when
    no declaration names it yet, its declaration to the core's readers. A name that is
    already registered is refused (two implementations of one kind would disagree), and
    so is an implementation built on another declaration of a declared name."""
    kind = implementation.kind
    if kind.name in _REGISTRY:
        raise ValueError(f"kernel kind {kind.name} is already registered "
                         f"({_REGISTRY[kind.name].kind.library or 'generated'})")
    declared = kernel_kinds.KINDS.get(kind.name)
    if declared is None:
        kernel_kinds.declare(kind)
        _DECLARED_HERE.add(kind.name)
    elif declared is not kind:
        raise ValueError(f"kernel kind {kind.name}: the implementation is built on another "
                         "declaration than gemc.kernel_kinds.KINDS's")
    _REGISTRY[kind.name] = implementation
    return implementation


def unregister(name: str) -> None:
    """Forget a registered kind (a test's, after it ran), and its declaration if
    :func:`register` made it."""
    del _REGISTRY[name]
    if name in _DECLARED_HERE:
        _DECLARED_HERE.discard(name)
        kernel_kinds.forget(name)


def registered() -> Mapping[str, KindImplementation]:
    """The registered kinds by name, in registration order (a read-only view)."""
    return MappingProxyType(_REGISTRY)


def unit(name: str) -> KindImplementation | None:
    """The implementation of a unit kind (one call in place of its nodes), or None."""
    found = _REGISTRY.get(name)
    return found if found is not None and not found.kind.layout else None


def layouts() -> tuple[KindImplementation, ...]:
    """The implementations of the layout kinds, in registration order."""
    return tuple(k for k in _REGISTRY.values() if k.kind.layout)


for _module in MODULES:
    for _implementation in _module.IMPLEMENTATIONS:
        register(_implementation)
