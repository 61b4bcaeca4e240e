"""Checkpoints through torch.distributed.checkpoint (DCP), never half-written.

Layout under ``--checkpoint-dir D`` (a directory every rank sees: local disk on one host,
a shared file system across hosts)::

    D/step-00000010/     a complete checkpoint (DCP files + .metadata)
    D/step-00000020/
    D/latest             "step-00000020": the newest complete one

Protocol of one save (step N):

1. rank 0 removes a stale ``D/step-N.tmp/`` left by an interrupted save; barrier;
2. every rank writes its part into ``D/step-N.tmp/`` with ``dcp.save`` (DCP's coordinator
   writes ``.metadata`` last, after every rank's data);
3. barrier: all ranks have finished writing;
4. rank 0 renames ``step-N.tmp`` to ``step-N`` (atomic on POSIX), then replaces ``latest``
   through a temporary file and ``os.replace`` (atomic), syncing the directory; prunes old
   checkpoints beyond ``keep``; barrier.

A crash at any point leaves either the previous ``latest`` with its complete directory, or
the new one complete: an interrupted save never replaces the last good checkpoint.
``find_latest`` trusts ``latest`` only if it names a directory holding ``.metadata``, and
otherwise falls back to the newest complete ``step-*`` directory.

Two environment hooks exist for the crash tests (never set them in production):
``GEMC_RUN_CRASH_IN_SAVE=N`` exits the process inside step N's save, after the data is
written but before the rename.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gemc.errors import GemcUserError

LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d+)$")


@contextmanager
def _quiet_sharded_tensor():  # noqa: ANN202
    """Tables travel as ShardedTensors (see state.py): silence their deprecation notice, and
    DCP's notice that it runs without a process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        # one process without a process group is a supported case, not a mistake
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* single process")
        yield


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _barrier() -> None:
    # torch on the paths that save or load only: ``gemc run --resume`` checks the directory
    # (require_latest) before anything imports torch (tests/test_cli_lazy_imports.py)
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_complete(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and _is_complete(child):
            out.append((int(m.group(1)), child))
    return sorted(out)


def find_latest(root: str | Path) -> tuple[int, Path] | None:
    """The last complete checkpoint: ``latest`` if valid, else the newest complete dir."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        m = _STEP_RE.match(name)
        if m and _is_complete(root / name):
            return int(m.group(1)), root / name
    found = complete_checkpoints(root)
    return found[-1] if found else None


def require_latest(root: str | Path) -> tuple[int, Path]:
    """:func:`find_latest`, or a user error: ``--resume`` on a mistyped or empty directory
    must not quietly train from step 0 (and overwrite nothing the user meant to continue)."""
    root = Path(root)
    found = find_latest(root) if root.is_dir() else None
    if found is not None:
        return found
    partial = sorted(p.name for p in root.glob("step-*.tmp")) if root.is_dir() else []
    state = ("does not exist" if not root.exists() else
             f"holds no complete checkpoint (only the interrupted save {partial[-1]})"
             if partial else "holds no complete checkpoint (step-NNNNNNNN/ with .metadata)")
    raise GemcUserError(
        f"--resume: no checkpoint was found in {root}: the directory {state}",
        where=f"--checkpoint-dir {root}",
        fix="give the --checkpoint-dir of the run to continue, or start without --resume",
    )


def discard_partial(root: str | Path) -> None:
    """Remove the remains of a save that was interrupted (``step-N.tmp/``, the ``latest``
    being replaced): they never became a checkpoint, and a later save would redo them."""
    root = Path(root)
    if not root.is_dir():
        return
    for path in root.glob("step-*.tmp"):
        shutil.rmtree(path, ignore_errors=True)
    (root / f".{LATEST}.tmp").unlink(missing_ok=True)


def save(
    root: str | Path, step: int, state: dict[str, Any], *, rank: int, keep: int = 2
) -> Path:
    """Write ``state`` as checkpoint ``step`` with the protocol of the module doc."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 - heavy, only when saving

    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    _barrier()
    with _quiet_sharded_tensor():
        dcp.save(state, checkpoint_id=str(tmp))
    if os.environ.get("GEMC_RUN_CRASH_IN_SAVE") == str(step):
        os._exit(41)  # test hook: die with the data written but not yet published
    _barrier()
    if rank == 0:
        if final.exists():  # the same step saved again (a resumed run): replace it
            old = root / (step_dir_name(step) + ".old")
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        _write_latest(root, final.name)
        for _, path in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(path, ignore_errors=True)
    _barrier()
    return final


def stored_keys(path: str | Path) -> set[str]:
    """The top-level state keys a checkpoint holds (to skip what it lacks, e.g. RNG)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    meta = dcp.FileSystemReader(str(path)).read_metadata()
    return set(meta.state_dict_metadata)


def load(path: str | Path, state: dict[str, Any]) -> None:
    """Load ``path`` into ``state`` in place (DCP reshards where layouts differ)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    # Keep ShardedTensors without a local piece in the plan: the default flattening drops
    # them, and DCP then takes the missing key for a pre-2.4 checkpoint and mis-loads.
    with _quiet_sharded_tensor():
        dcp.load(
            state,
            checkpoint_id=str(path),
            planner=dcp.DefaultLoadPlanner(flatten_sharded_tensors=False),
        )
