"""``gemc --help`` and the command line's argument errors are answered without importing
torch (nor Triton, OR-Tools, SymPy; nor NumPy or networkx, but where a topology or a
calibration file is read).

Why: importing torch takes a second and a half of a process, and a user who mistyped an
option, a path or a ``--set`` should hear so at once; the bad-input corpus
(tests/test_bad_input_corpus.py) starts a ``gemc`` process per mistake, so its time is
mostly those imports. Each case here runs ``gemc`` in a fresh process (as a user does) and
reads back which of those packages it imported: an eager import added to ``gemc.cli``, to
a module the parser or the checks reach (``gemc.plan``, ``gemc.checks``, ``gemc.backends.
torch.cli``...) or to ``gemc/__init__.py`` fails here, naming the case. The messages are the
corpus's, so a check moved to run before torch still says what it said.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TOY

HEAVY = ("torch", "triton", "numpy", "networkx", "ortools", "sympy")

# ``gemc ARGV`` as its console script runs it, then the heavy packages it imported, on stderr
_RUNNER = """\
import sys
from gemc.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("imported:", ",".join(sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))),
      file=sys.stderr)
sys.exit(code)
"""


def _gemc(*argv: str, cwd: Path) -> tuple[int, str, set[str]]:
    """(exit code, stdout + stderr without the last line, heavy packages imported)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{_RUNNER}", *argv],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    text, _, last = (proc.stdout + proc.stderr).rstrip("\n").rpartition("\n")
    assert last.startswith("imported:"), proc.stdout + proc.stderr
    return proc.returncode, text, {m for m in last.removeprefix("imported:").strip().split(",") if m}


HELP = [["--help"], ["compile", "--help"], ["run", "--help"], ["calibrate", "--help"],
        ["explain", "--help"], ["diff", "--help"], ["validate", "--help"],
        ["report", "--help"], ["record-choices", "--help"]]


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_help_imports_no_torch(tmp_path: Path, argv: list[str]) -> None:
    code, text, heavy = _gemc(*argv, cwd=tmp_path)
    assert code == 0, text
    assert "usage: gemc" in text
    assert not heavy, f"gemc {' '.join(argv)} imported {sorted(heavy)}"


NEW = "new.json"
# name -> (argv, text the message must hold); "{d}" is the case's folder, which holds
# plan.json (a file: these checks only need it to exist), run.json (a run report), a_dir/,
# empty_ckpt/ and corrupt.json
CASES = {
    # argparse: unknown options, bad numbers and choices
    "no-command": ([], "the following arguments are required: command"),
    "unknown-command": (["compil"], "invalid choice: 'compil'"),
    "unknown-option": (["compile", f"{TOY}:build", "--out", NEW, "--bogus"],
                       "unrecognized arguments: --bogus"),
    "out-missing": (["compile", f"{TOY}:build"], "the following arguments are required: --out"),
    "time-limit-negative": (["compile", f"{TOY}:build", "--out", NEW, "--time-limit", "-1"],
                            "must be a number > 0"),
    "sqnr-not-finite": (["compile", f"{TOY}:build", "--out", NEW, "--min-sqnr-db", "nan"],
                        "finite number"),
    "planner-unknown": (["compile", f"{TOY}:build", "--out", NEW, "--planner", "cp"],
                        "invalid choice: 'cp'"),
    "steps-zero": (["run", "{d}/plan.json", "--steps", "0"], "must be an integer >= 1"),
    "lr-zero": (["run", "{d}/plan.json", "--lr", "0"], "--lr: must be a number > 0"),
    "audit-every-negative": (["run", "{d}/plan.json", "--fp8-audit-every", "-1"],
                             "is not an integer >= 0"),
    # gemc compile: paths and --set, before the model is built
    "out-is-a-directory": (["compile", f"{TOY}:build", "--out", "{d}/a_dir"],
                           "--out names a directory"),
    "out-unwritable": (["compile", f"{TOY}:build", "--out", "/proc/gemc-lazy/plan.json"],
                       "--out: cannot write"),
    "dump-dir-is-a-file": (["compile", f"{TOY}:build", "--out", NEW, "--dump-dir",
                            "{d}/plan.json"], "--dump-dir names a file"),
    "calibration-missing": (["compile", f"{TOY}:build", "--out", NEW, "--calibration",
                             "/no/such/file.json"],
                            "calibration file /no/such/file.json does not exist"),
    "topology-file-missing": (["compile", f"{TOY}:build", "--out", NEW, "--topology",
                               "{d}/no_topology.json"], "topology file"),
    "calibration-corrupt": (["compile", f"{TOY}:build", "--out", NEW, "--calibration",
                             "{d}/corrupt.json"], "invalid JSON"),
    "topology-zero-hosts": (["compile", f"{TOY}:build", "--topology", "h200:0x8", "--out", NEW],
                            "h200:0x8"),
    "topology-unknown-gpu": (["compile", f"{TOY}:build", "--topology", "tpu:1x8", "--out", NEW],
                             "unknown GPU 'tpu'"),
    "entrypoint-no-func": (["compile", TOY, "--out", NEW], "no ':FUNC' part"),
    "entrypoint-missing-file": (["compile", "nofile.py:build", "--out", NEW],
                                "model file 'nofile.py' does not exist"),
    "bad-set": (["compile", f"{TOY}:build", "--set", "hidden", "--out", NEW], "bad --set"),
    "set-twice": (["compile", f"{TOY}:build", "--set", "a=1", "--set", "a=2", "--out", NEW],
                  "--set a is given twice"),
    # gemc run: paths (and --resume) before torchrun and the model
    "run-missing-plan": (["run", "{d}/no_plan.json"], "does not exist"),
    "report-is-a-directory": (["run", "{d}/plan.json", "--report", "{d}/a_dir"],
                              "--report names a directory"),
    "checkpoint-dir-is-a-file": (["run", "{d}/plan.json", "--checkpoint-dir",
                                  "{d}/plan.json"], "--checkpoint-dir names a file"),
    "resume-without-dir": (["run", "{d}/plan.json", "--resume"],
                           "--resume needs --checkpoint-dir"),
    "resume-mistyped-dir": (["run", "{d}/plan.json", "--resume", "--checkpoint-dir",
                             "{d}/ckpt_typo"], "no checkpoint was found"),
    "resume-empty-dir": (["run", "{d}/plan.json", "--resume", "--checkpoint-dir",
                          "{d}/empty_ckpt"], "holds no complete checkpoint"),
    "run-a-run-report": (["run", "{d}/run.json"], "is a run report"),
    # the plan readers and the report
    "explain-a-run-report": (["explain", "{d}/run.json"], "gemc report"),
    "explain-a-directory": (["explain", "{d}/a_dir"], "is a directory"),
    "explain-corrupt": (["explain", "{d}/corrupt.json"], "is not valid JSON"),
    "validate-a-run-report": (["validate", "{d}/run.json"], "is a run report"),
    "diff-missing": (["diff", "{d}/run.json", "{d}/no_plan.json"], "does not exist"),
    "report-missing-dump-dir": (["report", "{d}/no_dumps", "-o", "{d}/r.html"],
                                "dump directory"),
    "report-run-missing": (["report", "{d}/a_dir", "-o", "{d}/r.html", "--run",
                            "{d}/no.run.json"], "run report"),
}


READS_COST_MODEL = {"topology-zero-hosts", "topology-unknown-gpu", "calibration-corrupt"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_argument_errors_import_no_torch(tmp_path: Path, name: str) -> None:
    (tmp_path / "plan.json").write_text("{}")
    (tmp_path / "run.json").write_text(json.dumps({"losses": [[1, 0.5]]}))
    (tmp_path / "corrupt.json").write_text('{"schema_version": ')
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "empty_ckpt").mkdir()
    argv, expect = CASES[name]
    code, text, heavy = _gemc(*(a.replace("{d}", str(tmp_path)) for a in argv), cwd=tmp_path)
    assert code == 2, text
    assert expect in text, text
    assert "gemc: error:" in text and "fix:" in text and "Traceback" not in text, text
    # a topology is a networkx graph, a calibration file NumPy's arrays: what reads them
    # may import those (a tenth of a second each), never torch
    allowed = {"networkx", "numpy"} if name in READS_COST_MODEL else set()
    assert not heavy - allowed, \
        f"{name}: gemc imported {sorted(heavy - allowed)} before refusing the input"
    assert not (tmp_path / NEW).exists()


def test_the_runner_sees_torch_where_the_command_needs_it(tmp_path: Path) -> None:
    """The probe itself: a compile whose arguments pass goes on to import torch and the
    model (which has no parameter ``size``: exit 2), so an empty list above is a finding,
    not a runner that cannot see imports."""
    code, text, heavy = _gemc("compile", f"{TOY}:build", "--set", "size=3", "--out", NEW,
                              cwd=tmp_path)
    assert code == 2, text
    assert "no argument named 'size'" in text, text
    assert "torch" in heavy
