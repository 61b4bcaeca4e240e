"""Deterministic parameter initialization, independent of sharding and world size.

The runner builds the model on ``meta`` and materializes only what a rank holds, so the
initial values cannot come from the order in which modules happen to draw from one global
RNG. Instead every value is a pure function of ``(seed, name)``:

* a dense module is re-initialized with its own ``reset_parameters()`` under a seed derived
  from its FQN, so FSDP-sharded, replicated and single-process runs start from the same
  weights (the module is materialized whole, initialized, then sharded);
* a tensor no ``reset_parameters()`` writes (a module without one, which is how most models
  create their own ``nn.Parameter``s and constant buffers), one the author's build wrote
  again after the module's reset (``nn.init.normal_(lin.weight, std=1e-4)``,
  gemc.init_recipes), and a plain tensor attribute (``self.li = torch.tensor(...)``) take
  the value the author's build gives them: the entrypoint runs once more for real with the
  tables on meta, under a seed derived from the run's, and rank 0's values are broadcast
  (see :func:`init_dense_`);
* an embedding table built from given values (``from_pretrained``) takes them from that
  build, each shard its slice (gemc.backends.torch.materialize);
* any other embedding table is drawn in fixed blocks of ``BLOCK_ROWS`` full-width rows, block ``k``
  from a generator seeded by ``(seed, fqn, k)``. Any shard (a row range, a column range or
  both) is produced by drawing only the blocks it overlaps, and equals the same slice of the
  table a single process draws, without ever building the whole table.

Values are drawn from the distribution the author's build gives the table
(gemc.init_recipes: ``nn.init.xavier_uniform_``, ``normal_(std=1e-4)``, ``w.data.uniform_``),
N(0, 1) like ``nn.Embedding``/``nn.EmbeddingBag``'s default otherwise, with the
``padding_idx`` row zeroed (unless the author's fill of the whole table came after the
module zeroed it, as in eager). They depend on the device type (CPU and CUDA generators
differ), never on the number of ranks.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemc.errors import GemcError, GemcUserError
from gemc.init_recipes import Recipe

BLOCK_ROWS = 8192
"""Rows per independently seeded block of an embedding table."""


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from ``seed`` and names: stable across processes, Python versions, hosts."""
    text = "\x1f".join([str(int(seed)), *(str(p) for p in parts)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def fill_table_slice_(
    out: torch.Tensor,
    *,
    fqn: str,
    rows: int,
    dim: int,
    row_offset: int,
    col_offset: int,
    seed: int,
    padding_idx: int | None = None,
    recipe: Recipe | None = None,
) -> torch.Tensor:
    """Fill ``out`` ([nr, nc]) with rows/columns of table ``fqn`` starting at the offsets,
    drawn from ``recipe`` (the author's distribution, gemc.init_recipes; None or one
    that is no elementwise distribution: N(0, 1), nn.Embedding's own)."""
    nr, nc = out.shape
    if row_offset + nr > rows or col_offset + nc > dim:
        raise ValueError(f"slice {row_offset}+{nr} x {col_offset}+{nc} outside {rows} x {dim}")
    if nr == 0 or nc == 0:
        return out
    gen = torch.Generator(device=out.device)
    for block in range(row_offset // BLOCK_ROWS, (row_offset + nr - 1) // BLOCK_ROWS + 1):
        b0 = block * BLOCK_ROWS
        bn = min(BLOCK_ROWS, rows - b0)
        gen.manual_seed(derive_seed(seed, "table", fqn, block))
        values = _draw(bn, dim, gen, out.device, recipe)
        lo, hi = max(b0, row_offset), min(b0 + bn, row_offset + nr)
        out[lo - row_offset : hi - row_offset].copy_(
            values[lo - b0 : hi - b0, col_offset : col_offset + nc]
        )
    if padding_idx is not None and row_offset <= padding_idx < row_offset + nr and (
            recipe is None or recipe.zeroes_padding_row()):
        out[padding_idx - row_offset].zero_()
    return out


def _draw(rows: int, dim: int, gen: torch.Generator, device: torch.device,
          recipe: Recipe | None) -> torch.Tensor:
    """One block of a table from its recipe (N(0, 1) without one)."""
    kind = recipe.kind if recipe is not None else "normal"
    if kind == "constant":
        assert recipe is not None
        return torch.full((rows, dim), recipe.a, device=device)
    if kind == "uniform":
        assert recipe is not None
        values = torch.rand(rows, dim, generator=gen, device=device, dtype=torch.float32)
        return values.mul_(recipe.b - recipe.a).add_(recipe.a)
    values = torch.randn(rows, dim, generator=gen, device=device, dtype=torch.float32)
    if kind == "normal" and recipe is not None:
        values.mul_(recipe.b).add_(recipe.a)
    return values


def _reset_fn(module: nn.Module):  # noqa: ANN202 - a bound method or None
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def _owns_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


def _in(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@torch.no_grad()
def reset_dense_(model: nn.Module, seed: int, skip: Iterable[str] = ()) -> None:
    """Re-initialize every module outside ``skip`` that has ``reset_parameters`` under a
    seed derived from its FQN (see :func:`init_dense_`, which also covers the rest)."""
    skip = set(skip)
    devices = _cuda_devices(model)
    for name, module in model.named_modules():
        if _in(name, skip) or not _owns_state(module):
            continue
        fn = _reset_fn(module)
        if fn is not None:
            _reset_under_seed(fn, seed, name, devices)


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _reset_under_seed(
    fn: Callable[[], Any],
    seed: int,
    name: str,
    devices: list[int],
    seed_for: Callable[[str], int] | None = None,
) -> None:
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed_for(name) if seed_for else derive_seed(seed, "module", name))
        fn()


RESET = "reset_parameters"
AUTHOR = "author's __init__"
TABLE = "table fill"


@dataclass
class InitReport:
    """How each part of the model got its initial values (the run report's
    ``initialization``): dense modules by name, tables as a count."""

    per_module: dict[str, str] = field(default_factory=dict)
    author_tensors: list[str] = field(default_factory=list)
    tables: int = 0
    numel: dict[str, int] = field(default_factory=lambda: {RESET: 0, AUTHOR: 0, TABLE: 0})
    author_source: str | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "per_module": dict(self.per_module),
            "author_tensors": list(self.author_tensors),
            "tables": self.tables,
            "elements": dict(self.numel),
            "author_source": self.author_source,
            "definition": (
                f"'{RESET}': the module's own reset_parameters() under a seed derived from "
                f"its name; '{AUTHOR}': the values the model's build gives it, from one "
                "build of the dense part for real (tables left on meta) under the run's "
                "seed, broadcast from rank 0; "
                f"'{TABLE}': gemc's blockwise fill, shard by shard, from the distribution "
                "the author's build gives the table (N(0, 1) by default)"
            ),
        }


def _poison_(t: torch.Tensor) -> bool:
    """Fill ``t`` with a value no initializer writes; False when its dtype has none."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
        return True
    if t.dtype == torch.bool:
        return False
    t.fill_(torch.iinfo(t.dtype).min)
    return True


def _still_poisoned(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).min).any())


@torch.no_grad()
def init_dense_(
    model: nn.Module,
    seed: int,
    skip: Iterable[str] = (),
    *,
    author_build: Callable[[], nn.Module | Mapping[str, torch.Tensor]] | None = None,
    report: InitReport | None = None,
    seed_for: Callable[[str], int] | None = None,
    author_init: Collection[str] = (),
) -> InitReport:
    """Initialize every parameter and buffer of ``model`` outside ``skip``; never refuse.

    A module with ``reset_parameters()`` is reset under a seed derived from its FQN
    (parents before children, as :func:`reset_dense_`). Its tensors are filled with NaN
    (integers: their minimum) first, so a tensor its reset leaves unwritten is noticed.
    Those, and every tensor of a module without ``reset_parameters`` (an ``nn.Parameter``
    made in ``__init__`` with the author's own recipe, a constant buffer), take the value
    the author's build gives them: ``author_build()`` builds the model for real with its
    tables on meta (the dense part is small), once, only when some tensor needs it (or
    returns those values by FQN, e.g. a snapshot of a model that was built for real). On
    several ranks rank 0's values are broadcast, so every replica starts identical even
    when the author's recipe draws from an unseeded source. ``seed_for(name)``: another
    caller's per-module seeds (the precision probe's). ``author_init``: FQNs the author's
    build initialised itself after the module's own reset (``nn.init.normal_(lin.weight,
    std=1e-4)``, gemc.init_recipes): those take the author's values too.
    """
    skip = set(skip)
    report = report or InitReport()
    devices = _cuda_devices(model)
    needs = _plain_tensors_on_meta_(model, skip)
    optional: set[str] = set()
    for name, module in model.named_modules():
        if _in(name, skip) or not _owns_state(module):
            continue
        own = [
            (f"{name}.{n}" if name else n, t)
            for n, t in (*module.named_parameters(recurse=False),
                         *module.named_buffers(recurse=False))
        ]
        fn = _reset_fn(module)
        how = AUTHOR
        if fn is not None:
            poisoned = {fqn: _poison_(t.data) for fqn, t in own}
            _reset_under_seed(fn, seed, name, devices, seed_for)
            unwritten = {fqn for fqn, t in own if not poisoned[fqn] or _still_poisoned(t.data)}
            # written by the reset, but the author's build wrote it again: the author's
            # value where that build has one, else the reset's (a warning says so)
            optional |= {fqn for fqn, _ in own if fqn in author_init and fqn not in unwritten}
            left = [(fqn, t) for fqn, t in own if fqn in unwritten or fqn in author_init]
            report.numel[RESET] += sum(t.numel() for fqn, t in own if fqn not in unwritten)
            how = RESET if not left else f"{RESET} + {AUTHOR}"
            own = left
        for fqn, t in own:
            needs[fqn] = t
            report.numel[AUTHOR] += t.numel()
        report.per_module[name or "(root)"] = how
    if needs:
        _copy_author_values_(needs, author_build, report, optional)
    return report


def plain_tensors(model: nn.Module, skip: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """FQN -> each tensor a module holds as a plain attribute (``self.li = torch.tensor(
    [...])`` in ``__init__``: neither a parameter nor a registered buffer)."""
    skip = set(skip)
    return {f"{name}.{attr}" if name else attr: value
            for name, module in model.named_modules() if not _in(name, skip)
            for attr, value in vars(module).items()
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)}


def _plain_tensors_on_meta_(model: nn.Module, skip: set[str]) -> dict[str, torch.Tensor]:
    """Give each plain tensor attribute the model's build left on meta (gemc builds on
    meta, and ``to_empty`` allocates only parameters and buffers) an empty tensor on the
    model's device, to take the author's value: left on meta, the forward read it as
    garbage (DLRM ports' ``Z[:, self.li, self.lj]`` gave a loss outside [0, 1])."""
    device = next((t.device for t in (*model.parameters(), *model.buffers())
                   if not t.is_meta), torch.device("cpu"))
    out = {}
    for fqn, value in plain_tensors(model, skip).items():
        if value.is_meta:
            owner, _, attr = fqn.rpartition(".")
            real = torch.empty(value.shape, dtype=value.dtype, device=device)
            setattr(model.get_submodule(owner) if owner else model, attr, real)
            out[fqn] = real
    return out


def _copy_author_values_(
    needs: dict[str, torch.Tensor],
    author_build: Callable[[], nn.Module | Mapping[str, torch.Tensor]] | None,
    report: InitReport,
    optional: Collection[str] = (),
) -> None:
    """Copy the author's build's values into ``needs``; one in ``optional`` (already
    reset) keeps its reset value, with a warning, where that build has none."""
    if author_build is None:
        for fqn in needs.keys() & set(optional):
            _warn_reset_kept(fqn)
        needs = {f: t for f, t in needs.items() if f not in optional}
        if not needs:
            return
    names = ", ".join(list(needs)[:6]) + (f" and {len(needs) - 6} more" if len(needs) > 6 else "")
    if author_build is None:
        raise GemcError(
            f"tensors without reset_parameters ({names}) need the author's build to be "
            "initialized, and none was given (materialize_(..., author_build=...))"
        )
    real = author_build()
    source = real if isinstance(real, Mapping) else {
        **dict(real.named_parameters(remove_duplicate=False)),
        **dict(real.named_buffers(remove_duplicate=False)),
        **plain_tensors(real),
    }
    for fqn, t in list(needs.items()):
        value = source.get(fqn)
        bad = value is None or value.is_meta or tuple(value.shape) != tuple(t.shape)
        if bad and fqn in optional:
            _warn_reset_kept(fqn)
            del needs[fqn]
            continue
        if bad:
            assert value is None or isinstance(value, torch.Tensor)
            got = "missing" if value is None else (
                "on meta" if value.is_meta else f"of shape {tuple(value.shape)}")
            raise GemcUserError(
                f"the model's build for real does not give '{fqn}' a value: it is {got} "
                f"there (expected {tuple(t.shape)})",
                where=fqn,
                fix="build the same module structure on every call of the entrypoint, and "
                "create this tensor on the default device (not under torch.device('meta'))",
            )
        t.data.copy_(value.detach())
    report.author_tensors = list(needs)
    report.author_source = getattr(author_build, "description", None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _broadcast_from_rank0([t.data for t in needs.values()])


def _warn_reset_kept(fqn: str) -> None:
    warnings.warn(
        f"gemc: '{fqn}' is initialised by the model's own code after its module's reset, "
        "but the model's build for real (tables on meta) gives it no value: it starts from "
        "reset_parameters() instead (build it on the default device, not on meta)",
        stacklevel=3)


def _broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """One broadcast per dtype and device of the flattened tensors (small: dense only)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.broadcast(flat, src=0)
        offset = 0
        for t in group:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def real_dense_state(model: nn.Module, skip: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Copies of the tensors outside ``skip`` that hold real values (not on meta): a model
    built for real (outside gemc's meta build) is its own author's build."""
    skip = set(skip)
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if _in(name, skip):
            continue
        for n, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)):
            if not t.is_meta:
                out[f"{name}.{n}" if name else n] = t.detach().clone()
    return out
