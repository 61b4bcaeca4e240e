"""Start the ranks of a one-host plan the way torchrun does, and end with one message.

``gemc run plan.json`` with a plan of ``W > 1`` ranks calls :func:`launch`: torchrun's own
``torch.distributed.run.run`` with ``--standalone --nproc_per_node=W -m gemc.run ...``, in
this process (torchrun's agent then starts the ranks as child processes). Why not a
``torchrun`` subprocess: when a rank fails, torchrun prints its agent's log lines, a
``ChildFailedError`` traceback and a table of failures, and exits 1, burying gemc's own
message and turning a user error (2) into what looks like a bug (1). Here:

* each rank that meets a :class:`GemcUserError` writes its message into a private folder
  (``GEMC_RUN_ERROR_DIR``) instead of printing it; the launcher prints each distinct message
  once (naming the ranks when they differ) and exits 2;
* an interrupted run (SIGINT / SIGTERM, to this process or the ranks) exits 130 / 143 with
  the one line rank 0 prints;
* anything else (a rank crashed: exit 1 with its crash file, or killed by a signal) is
  summarised in one line per failed rank, exit 1;
* torchrun's "Setting OMP_NUM_THREADS=1" banner is not printed: the variable is set to the
  value torchrun would choose before it looks.

Under a plain ``torchrun -m gemc.run`` none of this applies: rank 0 prints the message, the
other ranks stay quiet, and every rank exits 2; torchrun's own report follows.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from gemc.exits import EXIT_INTERNAL, EXIT_SIGINT, EXIT_USAGE

ERROR_DIR_ENV = "GEMC_RUN_ERROR_DIR"


def launch(world: int, argv: Sequence[str]) -> int:
    """Run ``python -m gemc.run *argv`` on ``world`` local ranks; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets, without its banner
    errors = Path(tempfile.mkdtemp(prefix="gemc-run-errors-"))
    os.environ[ERROR_DIR_ENV] = str(errors)
    args = parse_args(["--standalone", f"--nproc_per_node={world}", "-m", "gemc.run", *argv])
    logging.disable(logging.ERROR)  # torchrun's agent logs every failure; we say it once
    try:
        run(args)
        return 0
    except ChildFailedError as exc:
        return _report_failure(exc, errors)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:
        return EXIT_SIGINT
    finally:
        logging.disable(logging.NOTSET)
        os.environ.pop(ERROR_DIR_ENV, None)
        shutil.rmtree(errors, ignore_errors=True)


def _report_failure(exc: object, errors: Path) -> int:
    messages: dict[str, list[int]] = {}
    for f in sorted(errors.glob("rank-*.txt")):
        messages.setdefault(f.read_text(), []).append(int(f.stem.removeprefix("rank-")))
    if messages:
        for text, ranks in messages.items():
            prefix = "" if len(messages) == 1 else f"[rank {', '.join(map(str, ranks))}] "
            print(prefix + text, file=sys.stderr)
        return EXIT_USAGE
    root = exc.get_first_failure()[1]  # type: ignore[attr-defined]
    code = root.exitcode
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        return code  # interrupted: rank 0 said so
    for rank, failure in sorted(exc.failures.items()):  # type: ignore[attr-defined]
        how = (f"was killed by {signal.Signals(-failure.exitcode).name}"
               if failure.exitcode < 0 else f"exited with code {failure.exitcode}")
        print(f"gemc run: rank {rank} {how}", file=sys.stderr)
    return EXIT_INTERNAL


def write_rank_error(text: str, rank: int) -> bool:
    """Under :func:`launch`: leave this rank's message for the launcher; True if left."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder or not Path(folder).is_dir():
        return False
    tmp = Path(folder) / f".rank-{rank:05d}.tmp"
    tmp.write_text(text)
    os.replace(tmp, Path(folder) / f"rank-{rank:05d}.txt")  # the launcher reads whole files
    return True
