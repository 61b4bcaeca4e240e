"""Triton's CPU interpreter without its per-call scan of ``triton.language`` (test speed).

Every call of a ``@triton.jit`` function from inside an interpreted kernel (a gemc helper,
and ``tl.sum``, ``tl.max``, ``tl.cdiv``... which triton.language writes as jit functions)
re-patches the language: ``_patch_builtin`` runs ``inspect.getmembers`` over
``triton.language``, ``triton.language.core``, ``tl.tensor``, ``tl.math`` and the
descriptor class to find the builtins to wrap. Measured on the runner's two-rank tests,
that scan was a third of the run (7.5 s of a 22.6 s run: ~35,000 scans of ~150 members,
each sorted). The members never change, only whether each one is currently wrapped; so
this looks the candidate names up once and, on every call, wraps exactly the names whose
current value is a builtin, as Triton does. The kernels execute the same code on the same
values; only the discovery of what to wrap is cached.

And within one launch, the language is patched once per set of language modules a jit
function sees: Triton re-patches on every device call (about 7,000 a run above, 2 s after
the cache), but nothing is restored until the launch ends, and a second patch of the same
modules sets what the first set (the builtins are wrapped already; the rest are fresh
closures of the same code). The launch's own patch, restored at its end, is unchanged.

And ``_get_np_dtype`` (every interpreted op asks it the numpy type of a Triton type: 81,000
calls a run above, each building a 19-entry dict of Triton types) answers from a cache keyed
by the scalar type, which is all its answer depends on (a block type's is its element's).

Installed by ``tests/__init__.py`` (every process that imports a test module: pytest's
workers and the gloo ranks the runner tests spawn) when ``TRITON_INTERPRET=1``, and only on
the ``_patch_builtin`` this was written against (its source compared): another Triton keeps
its own.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import threading

_EXPECTED = """def _patch_builtin(pkg, builder, scope: _LangPatchScope):
    for name, member in inspect.getmembers(pkg):
        if tl.core.is_builtin(member):
            _patch_attr(pkg, name, member, builder, scope)
"""


def install() -> bool:
    """Replace the interpreter's ``_patch_builtin`` with the cached-names one; True when
    installed (now or before). Idempotent; a no-op unless ``TRITON_INTERPRET=1``."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = interpreter._patch_builtin
    if getattr(original, "_gemc_cached_names", False):
        return True
    try:
        if inspect.getsource(original) != _EXPECTED:
            return False
    except (OSError, TypeError):
        return False
    is_builtin = tl.core.is_builtin
    names: dict[int, tuple[str, ...]] = {}
    for pkg in (tl, tl.math, tl.core, tl.tensor, tl.core.tensor_descriptor_base):
        found = tuple(name for name, member in inspect.getmembers(pkg) if is_builtin(member))
        if not found:  # already wrapped (mid-kernel?): don't cache an empty list
            return False
        names[id(pkg)] = found
    patch_attr = interpreter._patch_attr

    def _patch_builtin(pkg, builder, scope) -> None:  # noqa: ANN001 (Triton's signature)
        known = names.get(id(pkg))
        if known is None:
            original(pkg, builder, scope)
            return
        for name in known:  # sorted, as getmembers returns them
            member = getattr(pkg, name, None)
            if is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    _patch_builtin._gemc_cached_names = True  # type: ignore[attr-defined]
    interpreter._patch_builtin = _patch_builtin
    _patch_once_per_launch(interpreter, tl)
    _cache_np_dtypes(interpreter, tl)
    return True


_NP_DTYPE_SHA256 = "8f20d41e3207891ae9872819aff05bee11d5c9bbe24f772282cb3ac72749fc75"
"""sha256 of Triton 3.9.0's ``interpreter._get_np_dtype`` source, the one cached here."""


def _cache_np_dtypes(interpreter, tl) -> None:  # noqa: ANN001 (modules)
    source = inspect.getsource(interpreter._get_np_dtype)
    if hashlib.sha256(source.encode()).hexdigest() != _NP_DTYPE_SHA256:
        return
    original = interpreter._get_np_dtype
    block_type = tl.block_type
    cache: dict[object, object] = {}

    def _get_np_dtype(tt_dtype):  # noqa: ANN001, ANN202 (Triton's signature)
        if isinstance(tt_dtype, block_type):
            tt_dtype = tt_dtype.element_ty  # Triton's answer for a block is its element's
        try:
            return cache[tt_dtype]
        except KeyError:
            cache[tt_dtype] = found = original(tt_dtype)  # a type it refuses: its KeyError
            return found
        except TypeError:  # not hashable: ask Triton each time
            return original(tt_dtype)

    interpreter._get_np_dtype = _get_np_dtype


_EXPECTED_DEVICE_CALL = """    def __call__(self, *args, **kwargs):
        # This is a device function call
        _patch_lang(self.fn)
"""


def _patch_once_per_launch(interpreter, tl) -> None:  # noqa: ANN001 (modules)
    """Inside a launch (``GridExecutor.__call__``), ``_patch_lang`` of a function whose
    language modules this launch already patched returns an empty scope (see the module
    docstring); outside one, and for the launch's own first patch, Triton's."""
    device_call = inspect.getsource(interpreter.InterpretedFunction.__call__)
    grid_call = interpreter.GridExecutor.__call__
    if (not device_call.startswith(_EXPECTED_DEVICE_CALL)
            or "patch_scope = _patch_lang(self.fn)" not in inspect.getsource(grid_call)):
        return
    patch_lang, scope_type = interpreter._patch_lang, interpreter._LangPatchScope
    state = threading.local()
    langs: dict[object, frozenset[int]] = {}

    def _patch_lang(fn):  # noqa: ANN001, ANN202 (Triton's signature)
        patched = getattr(state, "patched", None)
        if patched is None:
            return patch_lang(fn)
        key = langs.get(fn)
        if key is None:
            key = langs[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                        if inspect.ismodule(v) and v in (tl, tl.core))
        if key in patched:
            return scope_type()
        patched.add(key)
        return patch_lang(fn)

    def launch(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        outer, state.patched = getattr(state, "patched", None), set()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state.patched = outer

    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = launch
