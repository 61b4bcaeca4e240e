"""Loading a user's model entrypoint: ``FILE.py:FUNC`` or ``package.module:FUNC``.

The function is called with keyword arguments from repeated ``--set key=value`` (parsed
by :mod:`gemc.entrypoint_args`) and must return a :class:`gemc.spec.ModelSpec`. gemc calls
it under ``torch.device("meta")`` when it only compiles, so GEM-scale models never allocate
their weights.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from gemc.batch_structure import example_leaves, flat_spec
from gemc.entrypoint_args import ENTRYPOINT_FIX, split_entrypoint
from gemc.errors import EntrypointError, GemcUserError, user_frame
from gemc.init_recipes import IN_PLACE_FILLS, FillRecorder
from gemc.spec import ModelSpec


def load_entrypoint(entrypoint: str) -> Callable[..., Any]:
    """Resolve ``FILE.py:FUNC`` or ``package.module:FUNC`` to the function object."""
    target, func_name = split_entrypoint(entrypoint)
    module = _import_file(target) if target.endswith(".py") else _import_module(target)
    fn = getattr(module, func_name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise EntrypointError(
            f"'{target}' has no function '{func_name}'",
            where=entrypoint,
            fix=f"name one of its functions: {', '.join(public[:12]) or '(none found)'}",
        )
    if not callable(fn):
        raise EntrypointError(
            f"'{func_name}' in '{target}' is a {type(fn).__name__}, not a function",
            where=entrypoint,
            fix="point at the function that builds and returns a gemc.ModelSpec",
        )
    return fn


def _import_file(path_str: str) -> Any:
    path = Path(path_str)  # there: split_entrypoint checked
    name = "gemc_user_model_" + "_".join(path.resolve().with_suffix("").parts[-3:]).replace(
        "-", "_"
    )
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's file failed to import: say where
        sys.modules.pop(name, None)
        raise EntrypointError(
            f"importing '{path_str}' failed: {type(exc).__name__}: {exc}",
            where=_user_frame(exc, path),
            fix="fix the error in the model file (run `python FILE.py` to see it on its own)",
        ) from exc
    return module


def _import_module(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise EntrypointError(
                f"no module named '{module_name}'",
                where=module_name,
                fix=f"install the package or add its folder to PYTHONPATH; {ENTRYPOINT_FIX}",
            ) from exc
        raise EntrypointError(
            f"importing '{module_name}' failed: {exc}",
            where=module_name,
            fix="install what the model module imports",
        ) from exc
    except Exception as exc:
        raise EntrypointError(
            f"importing '{module_name}' failed: {type(exc).__name__}: {exc}",
            where=module_name,
            fix="fix the error in the model module",
        ) from exc


def _user_frame(exc: BaseException, path: Path) -> str:
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path.resolve()
    ]
    if frames:
        return f"{frames[-1].filename}:{frames[-1].lineno}"
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f"{path}:{exc.lineno}"
    return str(path)


def load_model(
    entrypoint: str, args: dict[str, Any] | None = None, *, device: str = "meta"
) -> ModelSpec:
    """Build a user's model through its entrypoint (on the meta device by default).

    In the core (not the API) because the runner and the precision probe rebuild the
    plan's model too, and neither may import the compiler; ``gemc.api`` offers it as is."""
    return build_spec(
        load_entrypoint(entrypoint), dict(args or {}), entrypoint=entrypoint, device=device
    )


def build_spec(
    fn: Callable[..., Any], kwargs: dict[str, Any], *, entrypoint: str, device: str = "meta"
) -> ModelSpec:
    """Call the entrypoint under ``torch.device(device)`` and check what it returned."""
    _check_kwargs(fn, kwargs, entrypoint)
    on_meta = torch.device(device).type == "meta"
    fills = FillRecorder()
    try:
        with torch.device(device), _skip_init_on_meta(fills), _given_weights(fills), \
                stay_on_meta(fills=fills) if on_meta else _nothing():
            spec = fn(**kwargs)
    except GemcUserError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        # Entrypoints reject bad arguments with these; show their message as the fix.
        raise EntrypointError(
            f"'{entrypoint}' rejected its arguments: {type(exc).__name__}: {exc}",
            where=_describe_kwargs(kwargs),
            fix="change the --set values",
        ) from exc
    except Exception as exc:
        raise EntrypointError(
            f"'{entrypoint}' raised {type(exc).__name__}: {exc}",
            where=user_frame(exc) or _last_frame(exc),
            fix=f"fix the model's build function (it runs with torch.device({device!r}) as "
            "default" + ("" if not on_meta else
                         ", where a tensor holds no values: make what reads values from a "
                         "tensor (.item(), int(t), a size from data), such as the example "
                         "batch, on the CPU: `with torch.device('cpu'):` around it, or "
                         "device='cpu'; gemc moves the batch to meta itself") + ")",
        ) from exc
    check_spec(spec, entrypoint)
    spec = flat_spec(spec, entrypoint)
    recipes = fills.recipes(spec.model)
    if on_meta:
        _params_to_meta(spec.model)
    spec.origin = (entrypoint, dict(kwargs))
    spec.init_recipes = recipes
    return spec


class AuthorBuild:
    """Build a spec's model for real (on the CPU) with its embedding tables left on meta.

    The runner materializes tables shard by shard and dense modules with their own
    ``reset_parameters()``; what is left (``nn.Parameter``s made in ``__init__`` with the
    author's recipe, constant buffers) is copied from this build. Tables are the large
    part of a recommendation model, so an ``nn.Embedding``/``nn.EmbeddingBag`` whose shape
    is one of ``table_shapes`` is built on meta; the dense part is small. The build runs
    under ``torch.manual_seed(seed)`` with the global RNG state restored afterwards, so it
    is the same on every rank.
    """

    def __init__(
        self, origin: tuple[str, dict[str, Any]], table_shapes: set[tuple[int, int]], seed: int
    ) -> None:
        self.entrypoint, self.kwargs = origin
        self.table_shapes = set(table_shapes)
        self.seed = seed
        self.description = (
            f"{self.entrypoint} built on cpu under torch.manual_seed({seed}), "
            f"{len(self.table_shapes)} table shape(s) on meta"
        )

    def __call__(self) -> torch.nn.Module:
        fn = load_entrypoint(self.entrypoint)
        # a table's .to("cpu") / .cpu() keeps it on meta; a .cuda() or device="cuda" in
        # the model builds on the CPU
        with torch.random.fork_rng(devices=[]), _tables_on_meta(self.table_shapes), \
                stay_on_meta(on_cpu=True):
            torch.manual_seed(self.seed)
            spec = build_spec(fn, dict(self.kwargs), entrypoint=self.entrypoint, device="cpu")
        return spec.model


@contextlib.contextmanager
def _tables_on_meta(shapes: set[tuple[int, int]]) -> Iterator[None]:
    """``nn.Embedding``/``nn.EmbeddingBag`` of one of ``shapes`` are built on meta."""
    classes = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    originals = {cls: cls.__init__ for cls in classes}

    def wrap(cls: type, init: Callable[..., None]) -> Callable[..., None]:
        sig = inspect.signature(init)

        @functools.wraps(init)
        def meta_init(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = sig.bind(self, *args, **kwargs)
            shape = (bound.arguments.get("num_embeddings"), bound.arguments.get("embedding_dim"))
            if shape in shapes and bound.arguments.get("_weight") is None:
                bound.arguments["device"] = "meta"
            init(*bound.args, **bound.kwargs)

        return meta_init

    for cls, init in originals.items():
        cls.__init__ = wrap(cls, init)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, init in originals.items():
            cls.__init__ = init  # type: ignore[method-assign]


@contextlib.contextmanager
def _given_weights(fills: FillRecorder) -> Iterator[None]:
    """Note the ``_weight=`` an ``nn.Embedding``/``nn.EmbeddingBag`` is built with
    (``from_pretrained`` passes its vectors so): their values are the author's data."""
    classes = (torch.nn.Embedding, torch.nn.EmbeddingBag)
    originals = {cls: cls.__init__ for cls in classes}

    def wrap(init: Callable[..., None]) -> Callable[..., None]:
        sig = inspect.signature(init)

        @functools.wraps(init)
        def noting_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if sig.bind(self, *args, **kwargs).arguments.get("_weight") is not None:
                fills.note_given(self.weight, f"{type(self).__name__}(_weight=...)")

        return noting_init

    for cls, init in originals.items():
        cls.__init__ = wrap(init)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, init in originals.items():
            cls.__init__ = init  # type: ignore[method-assign]


def _params_to_meta(model: torch.nn.Module) -> None:
    """Parameters and buffers the build put on a real device (``device="cpu"`` written in
    the model) join the others on meta: the compile prices shapes, and the runner
    materializes every tensor itself, so a real copy here would only cost memory."""
    if any(not t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to("meta")


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


class _StayOnMetaMode(torch.overrides.TorchFunctionMode):
    """``.to(device)``, ``.cpu()`` and ``.cuda()`` of a meta tensor keep it on meta.

    Models are written for a real device: ``nn.Linear(4, 4).to("cpu")`` or
    ``self.pos = nn.Parameter(torch.zeros(n)).cuda()`` raise "Cannot copy out of meta
    tensor" when built on meta. Under this mode the device part of such a call is dropped
    (a dtype or memory format still applies), so the model builds unchanged; a factory's
    ``device="cuda"`` makes the tensor on meta (a host without a GPU compiles it too).
    An explicit ``device="cpu"`` is kept: a build may compute with such a tensor.
    """

    def __init__(self, on_cpu: bool = False, fills: FillRecorder | None = None) -> None:
        super().__init__()
        self.fills = fills  # notes ``w.data.uniform_(-a, a)`` on a meta weight
        # the author's build: a real tensor stays where it is too, and a factory's
        # device="cuda" makes it on the CPU (only values are wanted, on any host)
        self.on_cpu = on_cpu

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if self.fills is not None and args and isinstance(args[0], torch.Tensor) \
                and args[0].is_meta and getattr(func, "__name__", "") in IN_PLACE_FILLS:
            self.fills.note(func.__name__, args[0], args[1:], kwargs)
        if kwargs.get("device") is not None and func is not torch.Tensor.to:
            if torch.device(kwargs["device"]).type not in ("cpu", "meta"):
                kwargs = {**kwargs, "device": "cpu" if self.on_cpu else "meta"}
        if args and isinstance(args[0], torch.Tensor) and (args[0].is_meta or self.on_cpu):
            if func is torch.Tensor.to:
                to_args = [a for a in args[1:] if not isinstance(a, bool)]
                flags = {k: v for k, v in kwargs.items() if k in ("copy", "non_blocking")}
                rest = {k: v for k, v in kwargs.items() if k not in flags}
                _, dtype, _, memory_format = torch._C._nn._parse_to(*to_args, **rest)
                out = args[0]
                if dtype is not None or memory_format is not None:
                    out = out.to(
                        dtype=dtype or out.dtype,
                        memory_format=memory_format or torch.preserve_format,
                    )
                return out
            if func in (torch.Tensor.cpu, torch.Tensor.cuda):
                return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def stay_on_meta(on_cpu: bool = False, fills: FillRecorder | None = None) -> Iterator[None]:
    with _StayOnMetaMode(on_cpu, fills):
        yield


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextlib.contextmanager
def _skip_init_on_meta(fills: FillRecorder | None = None) -> Iterator[None]:
    """Make torch.nn.init a no-op on meta tensors while the model is built, noting each
    call in ``fills`` (the runner draws from the same distribution, gemc.init_recipes).

    Initialising a meta tensor computes nothing, but the first call routes through
    torch's Python reference decompositions and costs seconds; the runner initialises
    real weights itself (reset_parameters, shard by shard).
    """
    originals = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def init(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                if fills is not None:
                    fills.note(fn.__name__, tensor, args, kwargs)
                return tensor
            return fn(tensor, *args, **kwargs)

        return init

    for name, fn in originals.items():
        setattr(torch.nn.init, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch.nn.init, name, fn)


def _check_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any], entrypoint: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = [k for k in kwargs if k not in accepted]
    if unknown:
        raise EntrypointError(
            f"'{entrypoint}' takes no argument named {', '.join(repr(k) for k in unknown)}",
            where="--set " + " ".join(f"{k}=..." for k in unknown),
            fix=f"use its parameters: {', '.join(accepted) or '(it takes none)'}",
        )
    missing = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        and n not in kwargs
    ]
    if missing:
        raise EntrypointError(
            f"'{entrypoint}' needs {', '.join(repr(m) for m in missing)}",
            where="--set",
            fix=" ".join(f"--set {m}=VALUE" for m in missing),
        )


def check_spec(spec: Any, entrypoint: str) -> None:
    """The entrypoint must return a ModelSpec whose parts have the right types."""
    if not isinstance(spec, ModelSpec):
        raise EntrypointError(
            f"'{entrypoint}' returned {type(spec).__name__}, not a gemc.ModelSpec",
            where=entrypoint,
            fix="return gemc.ModelSpec(model=..., example_inputs=(...), make_batch=...)",
        )
    if not isinstance(spec.model, torch.nn.Module):
        raise EntrypointError(
            f"ModelSpec.model is a {type(spec.model).__name__}, not a torch.nn.Module",
            where=f"{entrypoint} -> ModelSpec.model",
            fix="pass the nn.Module whose forward(*inputs) returns the training loss",
        )
    inputs = spec.example_inputs
    if not isinstance(inputs, tuple) or not inputs:
        raise EntrypointError(
            "ModelSpec.example_inputs must be a non-empty tuple of the forward's arguments "
            f"(tensors, or dicts / lists / tuples of tensors), got {type(inputs).__name__}",
            where=f"{entrypoint} -> ModelSpec.example_inputs",
            fix="give a tuple: example_inputs=(dense, ids, offsets, labels), or "
            "example_inputs=(batch,) for forward(self, batch)",
        )
    if not callable(spec.make_batch):
        raise EntrypointError(
            "ModelSpec.make_batch is not callable",
            where=f"{entrypoint} -> ModelSpec.make_batch",
            fix="give a function make_batch(step, device) returning a tuple like example_inputs",
        )
    _check_batch_size(spec, example_leaves(inputs, entrypoint), entrypoint)


def _check_batch_size(spec: ModelSpec, leaves: list[torch.Tensor], entrypoint: str) -> None:
    """A stated batch size is a positive integer that some example input has as a
    dimension (the labels, a dense feature, a bag's offsets: ``B`` or ``B + 1``)."""
    size = spec.batch_size
    where = f"{entrypoint} -> ModelSpec.batch_size"
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise EntrypointError(
            f"ModelSpec.batch_size is {size!r}; it must be a positive integer (the samples "
            "in one batch)",
            where=where,
            fix="set batch_size=B, the number of samples make_batch returns per step",
        )
    dims = {int(d) for t in leaves for d in t.shape}
    if size not in dims and size + 1 not in dims:
        shapes = ", ".join("x".join(map(str, t.shape)) or "scalar" for t in leaves)
        raise EntrypointError(
            f"ModelSpec.batch_size is {size}, but no example input has {size} (or {size + 1} "
            f"offsets) along any dimension: inputs are {shapes}",
            where=where,
            fix="state the samples per batch (the labels' length), or build example_inputs "
            "for that batch",
        )


def _describe_kwargs(kwargs: dict[str, Any]) -> str:
    return (
        "--set " + " ".join(f"{k}={json.dumps(v)}" for k, v in kwargs.items())
        if kwargs
        else "(no --set)"
    )


def _last_frame(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    return f"{tb[-1].filename}:{tb[-1].lineno}" if tb else "(unknown)"
