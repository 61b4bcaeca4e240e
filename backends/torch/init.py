"""Deterministic parameter initialization, independent of sharding and world size.

The runner builds the model on ``meta`` and materializes only what a rank holds, so the
initial values cannot come from the order in which modules happen to draw from one global
RNG. Instead every value is a pure function of ``(seed, name)``:

* a dense module is re-initialized with its own ``reset_parameters()`` under a seed derived
  from its FQN, so FSDP-sharded, replicated and single-process runs start from the same
  weights (the module is materialized whole, initialized, then sharded);
* an embedding table is drawn in fixed blocks of ``BLOCK_ROWS`` full-width rows, block ``k``
  from a generator seeded by ``(seed, fqn, k)``. Any shard (a row range, a column range or
  both) is produced by drawing only the blocks it overlaps, and equals the same slice of the
  table a single process draws, without ever building the whole table.

Values are N(0, 1) like ``nn.Embedding``/``nn.EmbeddingBag``'s default, with the
``padding_idx`` row zeroed. They depend on the device type (CPU and CUDA generators
differ), never on the number of ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from torch import nn

from gemc.errors import GemcUserError

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
) -> torch.Tensor:
    """Fill ``out`` ([nr, nc]) with rows/columns of table ``fqn`` starting at the offsets."""
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
        values = torch.randn(bn, dim, generator=gen, device=out.device, dtype=torch.float32)
        lo, hi = max(b0, row_offset), min(b0 + bn, row_offset + nr)
        out[lo - row_offset : hi - row_offset].copy_(
            values[lo - b0 : hi - b0, col_offset : col_offset + nc]
        )
    if padding_idx is not None and row_offset <= padding_idx < row_offset + nr:
        out[padding_idx - row_offset].zero_()
    return out


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


def check_initializable(model: nn.Module, skip: Iterable[str] = ()) -> None:
    """Every parameter and buffer outside ``skip`` must belong to a module that can reset it.

    A tensor materialized from meta holds garbage until something writes it; a module
    without ``reset_parameters`` would silently train from garbage, so refuse it up front.
    """
    skip = set(skip)
    bad = []
    for name, module in model.named_modules():
        if _in(name, skip) or not _owns_state(module) or _reset_fn(module) is not None:
            continue
        own = [n for n, _ in module.named_parameters(recurse=False)]
        own += [n for n, _ in module.named_buffers(recurse=False)]
        bad.append(f"{name or '(root)'} ({type(module).__name__}: {', '.join(own)})")
    if bad:
        raise GemcUserError(
            "the runner builds the model on meta and initializes each module with its "
            "reset_parameters(); these modules hold parameters or buffers but have none: "
            + "; ".join(bad[:8])
            + (f" and {len(bad) - 8} more" if len(bad) > 8 else ""),
            where="the model's modules",
            fix="give each such module a reset_parameters() that (re)fills its tensors",
        )


def _in(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@torch.no_grad()
def reset_dense_(model: nn.Module, seed: int, skip: Iterable[str] = ()) -> None:
    """Re-initialize every module outside ``skip`` under a seed derived from its FQN.

    Parents come before children (``named_modules`` order), so a parent whose
    ``reset_parameters`` also touches its children is overridden by the children's own,
    exactly as in every run: the result depends only on names and ``seed``.
    """
    skip = set(skip)
    devices = sorted(
        {p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"}
    )
    for name, module in model.named_modules():
        if _in(name, skip) or not _owns_state(module):
            continue
        fn = _reset_fn(module)
        if fn is None:
            continue
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed(seed, "module", name))
            fn()
