"""gemc's own Triton kernels compiled ahead of their first launch, in worker processes.

Why: on a cold first step every hand-written gemc kernel compiles in the training process,
one after another, where it is first launched (MMoE on the H200: 4.7 s of a 33-s first
step; issue 16), while Inductor compiles its own kernels in a pool of processes. Threads do
not help: Triton's compile holds the GIL. So the kernels the first step will launch are
compiled in worker processes into Triton's on-disk cache (``TRITON_CACHE_DIR``, which the
run points at its compile cache before the pool starts), and the first launch in the
training process finds them there.

Which launches: derived, not listed per model. Each gemc custom op says which host code
its forward and backward run (:data:`gemc.backends.triton.ops.WARM`); that host code is
the kernel module's own launch path, run here on ``meta`` tensors shaped like the op's
fake-tensor arguments in the compiled graph (:func:`dry_launches`). Every
``kernel[grid](...)`` it reaches is recorded instead of launched, with its arguments as
Triton will see them: tensors as :class:`Arg` (dtype, 16-byte alignment, shape and
strides), integers and floats as the values the host computed from the shapes, the
constexprs as passed. An autotuned kernel is recorded at its autotuner, so the worker's
warm-up asks the same :class:`~.config_choice.ConfigChoice` hook for the config (the
heuristic, the recorded one, or every config under ``GEMC_AUTOTUNE=1``).

The worker compiles through ``warmup`` (``JITFunction.warmup`` / ``Autotuner.warmup``):
the path a launch takes, less the launch. Triton keys a compiled kernel by the source,
the options and the *specialisation* of the arguments, which it computes from the values
passed (Triton 3.6 and 3.9 alike: a pointer is specialised on its address being a multiple
of 16, an integer on being 1 (then a constant) or a multiple of 16, and typed i32 or
i64 by its range; floats are fp32). :class:`Arg` answers ``data_ptr()`` with 0 or 8 by the
real tensor's alignment, so the key a warm-up computes is the launch's by construction.
An integer the graph cannot know is warmed with both of its specialisations
(:func:`int_variants`): where an op's shapes hold a symbolic size (a token count Dynamo made
dynamic on its recompile), the op's host code runs once per variant of each symbol
(:func:`size_variants`), so every integer it computes from that size (counts, strides,
grids) is derived at values of both kinds. A launch derived for a value the graph does not
fix says so (``Launch.variant``, set inside :func:`variant`): it may never be made.

A warm-up never breaks training: a launch whose derivation fails, or whose compile fails
in the worker, is a warning naming the kernel and the reason, and the launch compiles in
the training process as before. :meth:`WarmUp.report` says what was warmed, how long it
took, and whether each first launch found its kernel compiled (the hit / miss lists of
:class:`~gemc.backends.torch.first_step.TritonCompiles`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import itertools
import math
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Arg", "Launch", "WORKERS_ENV", "WarmUp", "compile_launch", "dry_launches",
           "int_variants", "meta_like", "record_launches", "signature", "size_variants",
           "symbols_of", "variant"]

WORKERS_ENV = "GEMC_WARM_WORKERS"
"""Worker processes of the warm-up (default: half the CPUs, at most 8; ``0``: no warm-up,
the kernels compile at their first launch as before)."""
_OWN = ("gemc.", "gemc_")


@dataclass(frozen=True)
class Arg:
    """A tensor argument as Triton specialises it: dtype and address alignment (plus shape
    and strides, which gemc's config hooks read). Picklable, so it crosses to a worker."""

    dtype: torch.dtype
    aligned: bool = True
    shape: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()

    def data_ptr(self) -> int:
        return 0 if self.aligned else 8

    def element_size(self) -> int:
        return self.dtype.itemsize

    def stride(self, dim: int | None = None) -> Any:
        return self.strides if dim is None else self.strides[dim]

    def dim(self) -> int:
        return len(self.shape)

    @classmethod
    def of(cls, t: torch.Tensor) -> Arg:
        """The descriptor of a real or meta tensor (a meta tensor's base address is 0: its
        alignment is its storage offset's, as a real allocation's, 256-byte aligned)."""
        base = 0 if t.device.type == "meta" else t.untyped_storage().data_ptr()
        addr = base + t.storage_offset() * t.element_size()
        return cls(t.dtype, addr % 16 == 0, tuple(t.shape), tuple(t.stride()))


@dataclass(frozen=True)
class Launch:
    """One kernel launch as Triton sees it: the kernel (module and attribute: its autotuner
    where it has one), its positional arguments and keyword constexprs / options."""

    module: str
    name: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    variant: str = ""
    """Empty for a launch of the values the graph fixes; else which value it was derived at
    that the graph does not fix (a dynamic size's other specialisation)."""

    @property
    def kernel(self) -> str:
        return f"{self.module.rsplit('.', 1)[-1]}.{self.name}"


def _specialise(value: Any) -> Any:
    """An argument's part of Triton's key (module doc): what two launches must share to
    reuse one compiled kernel."""
    if isinstance(value, (Arg, torch.Tensor)):
        arg = value if isinstance(value, Arg) else Arg.of(value)
        return ("ptr", str(arg.dtype), arg.aligned)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        width = "i32" if -2**31 <= value < 2**31 else "i64"
        return ("int", width, "one" if value == 1 else "d16" if value % 16 == 0 else "")
    if isinstance(value, float):
        return "fp32"
    return value


@functools.cache
def _unspecialised(module: str, name: str) -> frozenset[int]:
    """Positions of the arguments the kernel declares ``do_not_specialize`` (an integer
    Triton types but never specialises: the fused update's per-step seed)."""
    try:
        fn = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - an unknown kernel specialises everything
        return frozenset()
    while not hasattr(fn, "arg_names") and hasattr(fn, "fn"):
        fn = fn.fn  # an autotuner's kernel
    names = getattr(fn, "do_not_specialize", None)
    if names is None:  # the interpreter keeps the decorator's arguments
        names = (getattr(fn, "kwargs", None) or {}).get("do_not_specialize")
    arg_names = list(getattr(fn, "arg_names", ()))
    return frozenset(arg_names.index(n) if isinstance(n, str) else int(n)
                     for n in names or () if not isinstance(n, str) or n in arg_names)


def signature(launch: Launch, skip: Sequence[str] = ()) -> tuple[Any, ...]:
    """The launch's specialisation: kernel, every argument's specialised form (an integer
    the kernel does not specialise: its type only), and the keyword arguments not in
    ``skip`` (an autotuner's config keys, chosen at the launch)."""
    kw = tuple((k, _specialise(v)) for k, v in launch.kwargs if k not in skip)
    plain = _unspecialised(launch.module, launch.name)
    args = tuple(_specialise(a)[:2] if i in plain and isinstance(a, int)
                 and not isinstance(a, bool) else _specialise(a)
                 for i, a in enumerate(launch.args))
    return (launch.kernel, args, kw)


def int_variants(value: int) -> list[int]:
    """Values of an integer the graph does not fix (a dynamic size) that cover the
    specialisations Triton can give it: a multiple of 16 and not (1 stays as it is)."""
    if value == 1:
        return [1]
    return [value, value + 1] if value % 16 == 0 else [value, value - value % 16 or 16]


def meta_like(t: Any, sizes: dict[Any, int] | None = None, grad: bool = False) -> Any:
    """A ``meta`` tensor with ``t``'s shape, strides, storage offset and dtype (a fake or
    real tensor), anything else as it is. Symbolic sizes take their value in ``sizes``
    (symbol -> int, :func:`size_variants`), else their hint. ``grad``: the result requires
    grad where ``t`` does (the host code of a backward asks which inputs need one)."""
    if not isinstance(t, torch.Tensor):
        return _hint(t, sizes)
    shape = tuple(_hint(s, sizes) for s in t.shape)
    stride = tuple(_hint(s, sizes) for s in t.stride())
    offset = _hint(t.storage_offset(), sizes)
    size = 1 + sum((n - 1) * s for n, s in zip(shape, stride) if n > 0) + offset
    base = torch.empty(size if all(shape) else 0, dtype=t.dtype, device="meta")
    out = base.as_strided(shape, stride, offset) if all(shape) else \
        torch.empty(shape, dtype=t.dtype, device="meta")
    return out.requires_grad_(grad and t.requires_grad and t.is_floating_point())


def _hint(x: Any, sizes: dict[Any, int] | None = None) -> Any:
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        if sizes:
            import sympy

            value = x.node.expr.xreplace({k: sympy.Integer(v) for k, v in sizes.items()})
            if not value.free_symbols:
                return type(x.node.hint)(value) if x.node.hint is not None else int(value)
        return x.node.hint if x.node.hint is not None else x.node.require_hint()
    if isinstance(x, (list, tuple)):
        return type(x)(_hint(v, sizes) for v in x)
    return x


def symbols_of(values: Any) -> dict[Any, int]:
    """The free symbols of the symbolic sizes in ``values`` (fake tensors' shapes, strides
    and offsets, symbolic scalars, nested in lists), each with its hint."""
    found: dict[Any, int] = {}

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            for s in (*x.shape, *x.stride(), x.storage_offset()):
                visit(s)
        elif isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            shape_env = x.node.shape_env  # torch >= 2.10 names the hints backed_var_to_val
            env = getattr(shape_env, "backed_var_to_val", None)
            env = env if env is not None else shape_env.var_to_val
            for sym in x.node.expr.free_symbols:
                if sym not in found and sym in env:
                    found[sym] = int(env[sym])
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(values)
    return found


MAX_SIZE_VARIANTS = 8
"""Above this many combinations of its symbols' variants, an op's host code runs with one
symbol varied at a time (a launch's integers seldom mix several dynamic sizes)."""


def size_variants(symbols: dict[Any, int]) -> list[tuple[dict[Any, int], str]]:
    """Assignments of ``symbols`` (symbol -> hint) covering each symbol's specialisations
    (:func:`int_variants`), the hints first (label ""), each other with a label naming its
    values: every combination, or one symbol varied at a time past
    :data:`MAX_SIZE_VARIANTS`."""
    names = list(symbols)
    options = [int_variants(symbols[s]) for s in names]
    combos: list[tuple[int, ...]]
    if math.prod(len(o) for o in options) <= MAX_SIZE_VARIANTS:
        combos = list(itertools.product(*options))
    else:
        hints = tuple(o[0] for o in options)
        combos = [hints] + [hints[:i] + (v,) + hints[i + 1:]
                            for i, o in enumerate(options) for v in o[1:]]
    out = []
    for combo in combos:
        changed = [f"{s}={v}" for s, v, o in zip(names, combo, options) if v != o[0]]
        out.append((dict(zip(names, combo)), "dynamic size " + ", ".join(changed)
                    if changed else ""))
    return out


_VARIANT: contextvars.ContextVar[str] = contextvars.ContextVar("gemc_warm_variant", default="")


@contextlib.contextmanager
def variant(label: str) -> Iterator[None]:
    """Launches recorded inside are derived at a value the graph does not fix (``label``
    says which): :attr:`Launch.variant`."""
    token = _VARIANT.set(label)
    try:
        yield
    finally:
        _VARIANT.reset(token)


def _kernel_of(obj: Any) -> tuple[str, str] | None:
    """(module, attribute) of a gemc kernel object, None for others' kernels."""
    fn = obj
    while hasattr(fn, "fn") and not callable(getattr(fn, "__code__", None)):
        fn = fn.fn
    module = getattr(fn, "__module__", "") or ""
    if not module.startswith(_OWN):
        return None
    base = getattr(obj, "base_fn", None) or fn
    return module, base.__name__


def _launchers() -> list[tuple[Any, str]]:
    """The classes whose ``run`` a ``kernel[grid](...)`` reaches (the autotuner first)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    out: list[tuple[Any, str]] = [(Autotuner, "run"), (JITFunction, "run")]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        out.append((InterpretedFunction, "run"))
    return out


@contextlib.contextmanager
def _intercept(on_launch: Callable[[Launch], None], launch: bool) -> Iterator[None]:
    """Record the outermost launch of each gemc kernel (``launch``: and run it)."""
    depth = [0]
    saved = [(cls, name, cls.__dict__[name]) for cls, name in _launchers()]

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, grid: Any = None, warmup: bool = False,
                **kwargs: Any) -> Any:
            who = _kernel_of(self) if depth[0] == 0 and not warmup else None
            if who is not None:
                on_launch(Launch(who[0], who[1], tuple(
                    Arg.of(a) if isinstance(a, torch.Tensor) else a for a in args),
                    tuple(sorted(kwargs.items())), _VARIANT.get()))
                if not launch:
                    return None
            depth[0] += 1
            try:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                depth[0] -= 1
        return run

    try:
        for cls, name, original in saved:
            setattr(cls, name, wrap(original))
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)


@contextlib.contextmanager
def dry_launches() -> Iterator[list[Launch]]:
    """Inside it, gemc's kernel launches are recorded, not run (host code on ``meta``
    tensors: see the module doc)."""
    seen: list[Launch] = []
    with _intercept(seen.append, launch=False):
        yield seen


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Inside it, gemc's kernel launches run and are recorded (tests compare them with the
    derived ones)."""
    seen: list[Launch] = []
    with _intercept(seen.append, launch=True):
        yield seen


def _config_keys(obj: Any) -> set[str]:
    keys: set[str] = set()
    for cfg in getattr(obj, "configs", ()) or ():
        keys |= set(cfg.all_kwargs())
    return keys


def config_keys(launch: Launch) -> set[str]:
    """The keyword arguments an autotuner adds from its config (none for a plain kernel)."""
    return _config_keys(getattr(importlib.import_module(launch.module), launch.name))


def compile_launch(launch: Launch) -> dict[str, Any]:
    """Compile ``launch``'s kernel into Triton's cache through its ``warmup`` (the worker's
    job; also callable in-process). Never raises: the result says what failed."""
    t0 = time.perf_counter()
    try:
        kernel = getattr(importlib.import_module(launch.module), launch.name)
        kernel.warmup(*launch.args, grid=(1,), **dict(launch.kwargs))
        error = None
    except Exception as exc:  # noqa: BLE001 - reported, the launch compiles as before
        error = f"{type(exc).__name__}: {exc}"
    return {"kernel": launch.kernel, "seconds": round(time.perf_counter() - t0, 3),
            "error": error}


def _worker_init(modules: Sequence[str]) -> None:
    """Import the kernels' modules once per worker, before any job (their import is most
    of a cold worker's first job)."""
    for m in modules:
        with contextlib.suppress(Exception):
            importlib.import_module(m)


def _ready() -> None:
    """A worker's first job: nothing (its initializer imported the kernels)."""


_KERNEL_MODULES = ("gemc.backends.triton.jagged_attention",
                   "gemc.backends.triton.varlen_key_attention",
                   "gemc.backends.triton.key_padding_attention",
                   "gemc.backends.triton.embedding_bag",
                   "gemc.backends.triton.masked_row_update",
                   "gemc.backends.triton.segment_sum",
                   "gemc.backends.triton.small_table_gather",
                   "gemc.backends.triton.silu_key_block_backward",
                   "gemc.backends.triton.softmax_row_backward")


def default_workers() -> int:
    """:data:`WORKERS_ENV`, else half the CPUs (Inductor's own pool wants the rest), 1 to 8."""
    value = os.environ.get(WORKERS_ENV)
    if value is not None:
        return max(0, int(value))
    return max(1, min(8, (os.cpu_count() or 2) // 2))


@dataclass
class WarmUp:
    """The warm-up of one run: a process pool started early (:meth:`start`), launches
    submitted as they are derived (:meth:`submit`, once per specialisation), and the run
    report's section (:meth:`report`). ``workers=0`` derives and reports, compiles
    nothing (Triton's interpreter, or the warm-up switched off)."""

    workers: int = field(default_factory=default_workers)
    pool: ProcessPoolExecutor | None = None
    launches: dict[tuple[Any, ...], Launch] = field(default_factory=dict)
    futures: dict[tuple[Any, ...], Future[dict[str, Any]]] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    started_s: float = 0.0
    _t0: float = field(default_factory=time.perf_counter)

    def start(self) -> WarmUp:
        """Start the workers (spawned: the training process may hold CUDA state a fork
        must not inherit); they inherit the environment, so call it after the compile
        cache's variables are set."""
        if self.workers <= 0 or self.pool is not None:
            return self
        t0 = time.perf_counter()
        try:
            ctx = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(self.workers, mp_context=ctx,
                                            initializer=_worker_init,
                                            initargs=(_KERNEL_MODULES,))
            # a spawned pool starts a worker per submitted job: start them all now, so
            # their imports run during setup, not at the first derived launch
            for _ in range(self.workers):
                self.pool.submit(_ready)
        except Exception as exc:  # noqa: BLE001 - no warm-up, kernels compile as before
            self._fail("the worker pool", f"did not start ({type(exc).__name__}: {exc})")
            self.workers = 0
        self.started_s = round(time.perf_counter() - t0, 3)
        self._t0 = time.perf_counter()
        return self

    def _fail(self, what: str, why: str) -> None:
        msg = (f"gemc warm-up: {what} {why}; its first launch compiles in the training "
               "process instead")
        self.failures.append(msg)
        warnings.warn(msg, stacklevel=3)

    def derive(self, source: str, fn: Callable[[], Any], label: str = "") -> list[Launch]:
        """The launches ``fn`` (host code on meta tensors) reaches, submitted; a failure
        is a warning naming ``source`` (and ``label``, the :func:`variant` it derives)."""
        if label:
            source = f"{source} at {label}"
        with dry_launches() as seen, variant(label):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - the warm-up must not break training
                self._fail(f"deriving the launches of {source}",
                           f"failed ({type(exc).__name__}: {exc})")
        self.submit(seen, source)
        return seen

    def submit(self, launches: Sequence[Launch], source: str) -> None:
        for launch in launches:
            key = signature(launch)
            if key in self.launches:
                continue
            self.launches[key] = launch
            self.sources[source] = self.sources.get(source, 0) + 1
            if self.pool is not None:
                fut = self.pool.submit(compile_launch, launch)
                fut.add_done_callback(self._done)
                self.futures[key] = fut

    def _done(self, fut: Future[dict[str, Any]]) -> None:
        try:
            res = fut.result()
        except Exception as exc:  # noqa: BLE001 - a worker died
            self._fail("a worker", f"failed ({type(exc).__name__}: {exc})")
            return
        if res.get("error"):
            self._fail(f"compiling {res['kernel']}", f"failed in the worker ({res['error']})")

    def report(self, hits: Sequence[str] = (), misses: Sequence[str] = ()) -> dict[str, Any]:
        """What was warmed (per kernel: specialisations, seconds in the workers, done or
        still compiling), and the first launches' hits and misses in Triton's cache."""
        per: dict[str, dict[str, Any]] = {}
        for key, launch in self.launches.items():
            row = per.setdefault(launch.kernel, {"variants": 0, "compiled": 0, "seconds": 0.0,
                                                  "pending": 0, "failed": 0})
            row["variants"] += 1
            fut = self.futures.get(key)
            if fut is None:
                continue
            if not fut.done():
                row["pending"] += 1
                continue
            with contextlib.suppress(Exception):
                res = fut.result()
                row["seconds"] = round(row["seconds"] + res["seconds"], 3)
                row["failed" if res.get("error") else "compiled"] += 1
        return {"workers": self.workers, "pool_start_s": self.started_s,
                "derived_from": dict(self.sources), "kernels": per,
                "first_launch_hits": sorted(hits), "first_launch_misses": sorted(misses),
                "failures": list(self.failures)}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
