"""The bad-input corpus: every ordinary mistake, run as a user runs it (a fresh process).

Each case is one row of issue #22's table or one of the bad inputs the CLI tests already
cover, and each must end the same way: exit 2 (exit 1 is kept for bugs in gemc), one
message with what / where / fix, no Python traceback, and nothing left behind (no plan,
no temporary file, no dump directory, no crash file). One tiny plan with kernels (the toy
model at h200:1x1) and its run report are made once for the module; the run that makes the
report is itself the CPU run with Triton kernels that used to fail ("Triton was imported
before TRITON_INTERPRET=1").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, TOY

UNWRITABLE = "/proc/gemc-corpus"  # no one, root included, can create files under /proc


def gemc(*args: str, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 240) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TRITON_INTERPRET")}
    base["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "gemc.cli", *args], cwd=cwd,
                          env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def own_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The TMPDIR of every gemc this module starts: a crash file (gemc.exits.report_crash
    writes it in the temporary directory) is then this module's own, not one that another
    test, running at the same time in another pytest-xdist worker, left in /tmp."""
    tmp = tmp_path_factory.mktemp("tmpdir")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", str(tmp))
        yield tmp


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A toy plan with kernels, its run report (from a CPU run), a 2-rank plan whose model
    file is gone, a corrupt calibration file, a directory, an empty checkpoint directory."""
    root = tmp_path_factory.mktemp("corpus")
    plan = root / "toy.json"
    made = gemc("compile", f"{TOY}:build", "--topology", "h200:1x1", "--out", str(plan),
                "--planner", "greedy", "--quiet", cwd=root)
    assert made.returncode == 0, made.stderr
    assert json.loads(plan.read_text())["kernels"], "the corpus plan must have kernels"
    ran = gemc("run", str(plan), "--steps", "1", "--device", "cpu", "--quiet", cwd=root)
    assert ran.returncode == 0, ran.stderr  # Triton kernels on the CPU, no env var needed
    two = root / "two.json"
    made = gemc("compile", f"{TOY}:build", "--topology", "h200:1x2", "--out", str(two),
                "--planner", "naive", "--quiet", cwd=root)
    assert made.returncode == 0, made.stderr
    doc = json.loads(two.read_text())
    doc["model"]["entrypoint"] = str(root / "moved_away.py") + ":build"
    for key in ("entrypoint_from_plan", "entrypoint_absolute"):  # lost from everywhere
        doc["model"].pop(key, None)
    (root / "two_lost.json").write_text(json.dumps(doc))
    (root / "corrupt_calibration.json").write_text("{\"format\": ")
    (root / "a_dir").mkdir()
    (root / "empty_ckpt").mkdir()
    return {"root": root, "two_lost": root / "two_lost.json"}


def _case(*argv: str, expect: str) -> tuple[tuple[str, ...], str]:
    return argv, expect


P, RUNREP, ROOT = "{plan}", "{run}", "{root}"
CASES = {
    # --- issue #22, gemc compile -----------------------------------------------------------
    "out-is-a-directory": _case("compile", f"{TOY}:build", "--out", f"{ROOT}/a_dir",
                                expect="--out names a directory"),
    "out-unwritable": _case("compile", f"{TOY}:build", "--out", f"{UNWRITABLE}/plan.json",
                            expect="--out: cannot write"),
    "dump-dir-unwritable": _case("compile", f"{TOY}:build", "--out", f"{ROOT}/new.json",
                                 "--dump-dir", f"{UNWRITABLE}/dumps",
                                 expect="--dump-dir: cannot write"),
    "dump-dir-is-a-file": _case("compile", f"{TOY}:build", "--out", f"{ROOT}/new.json",
                                "--dump-dir", P, expect="--dump-dir names a file"),
    "calibration-missing": _case("compile", f"{TOY}:build", "--out", f"{ROOT}/new.json",
                                 "--calibration", "/no/such/file.json",
                                 expect="calibration file /no/such/file.json does not exist"),
    "calibration-corrupt": _case("compile", f"{TOY}:build", "--out", f"{ROOT}/new.json",
                                 "--calibration", f"{ROOT}/corrupt_calibration.json",
                                 expect="invalid JSON"),
    "topology-file-missing": _case("compile", f"{TOY}:build", "--out", f"{ROOT}/new.json",
                                   "--topology", f"{ROOT}/no_topology.json",
                                   expect="topology file"),
    "time-limit-negative": _case("compile", f"{TOY}:build", "--out", f"{ROOT}/new.json",
                                 "--time-limit", "-1", expect="must be a number > 0"),
    "sqnr-not-finite": _case("compile", f"{TOY}:build", "--out", f"{ROOT}/new.json",
                             "--min-sqnr-db", "nan", expect="finite number"),
    # --- issue #22, gemc run / explain / report ----------------------------------------------
    "steps-negative": _case("run", P, "--steps", "-1", expect="--steps: must be an integer >= 1"),
    "steps-zero": _case("run", P, "--steps", "0", expect="must be an integer >= 1"),
    "checkpoint-every-negative": _case("run", P, "--checkpoint-every", "-2",
                                       expect="must be an integer >= 0"),
    "keep-checkpoints-negative": _case("run", P, "--keep-checkpoints", "-1",
                                       expect="must be an integer >= 0"),
    "lr-zero": _case("run", P, "--lr", "0", expect="--lr: must be a number > 0"),
    "embedding-lr-negative": _case("run", P, "--embedding-lr", "-0.1",
                                   expect="must be a number > 0"),
    "resume-mistyped-dir": _case("run", P, "--resume", "--checkpoint-dir", f"{ROOT}/ckpt_typo",
                                 expect="no checkpoint was found"),
    "resume-empty-dir": _case("run", P, "--resume", "--checkpoint-dir", f"{ROOT}/empty_ckpt",
                              expect="holds no complete checkpoint"),
    "resume-without-dir": _case("run", P, "--resume", expect="--resume needs --checkpoint-dir"),
    "report-is-a-directory": _case("run", P, "--report", f"{ROOT}/a_dir",
                                   expect="--report names a directory"),
    "report-unwritable": _case("run", P, "--report", f"{UNWRITABLE}/r.json",
                               expect="--report: cannot write"),
    "checkpoint-dir-is-a-file": _case("run", P, "--checkpoint-dir", P,
                                      expect="--checkpoint-dir names a file"),
    "run-a-run-report": _case("run", RUNREP, expect="is a run report"),
    "run-missing-plan": _case("run", f"{ROOT}/no_plan.json", expect="does not exist"),
    "explain-a-run-report": _case("explain", RUNREP, expect="gemc report"),
    "explain-a-directory": _case("explain", f"{ROOT}/a_dir", expect="is a directory"),
    "report-missing-dump-dir": _case("report", f"{ROOT}/no_dumps", "-o", f"{ROOT}/r.html",
                                     expect="dump directory"),
    # --- the bad inputs tests/test_cli.py checks in process, here as a user meets them -------
    "entrypoint-missing-file": _case("compile", "nofile.py:build", "--out", f"{ROOT}/new.json",
                                     expect="does not exist"),
    "entrypoint-no-func": _case("compile", TOY, "--out", f"{ROOT}/new.json",
                                expect="no ':FUNC' part"),
    "entrypoint-wrong-type": _case("compile", f"{TOY}:build_wrong_type", "--out",
                                   f"{ROOT}/new.json", expect="not a gemc.ModelSpec"),
    "loss-not-scalar": _case("compile", f"{TOY}:build_not_scalar", "--out", f"{ROOT}/new.json",
                             expect="must return the scalar training loss"),
    "untraceable": _case("compile", f"{TOY}:build_untraceable", "--out", f"{ROOT}/new.json",
                         "--dump-dir", f"{ROOT}/new_dumps",
                         expect="torch.export could not capture"),
    "bad-set": _case("compile", f"{TOY}:build", "--set", "hidden", "--out", f"{ROOT}/new.json",
                     expect="bad --set"),
    "unknown-kwarg": _case("compile", f"{TOY}:build", "--set", "size=3", "--out",
                           f"{ROOT}/new.json", expect="no argument named 'size'"),
    "topology-zero-hosts": _case("compile", f"{TOY}:build", "--topology", "h200:0x8", "--out",
                                 f"{ROOT}/new.json", expect="h200:0x8"),
    "disable-unknown-pass": _case("compile", f"{TOY}:build", "--disable-pass", "nope", "--out",
                                  f"{ROOT}/new.json", expect="no pass named 'nope'"),
    "validate-a-run-report": _case("validate", RUNREP, expect="is a run report"),
}


def _files(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def _crash_files(tmp: Path) -> set[str]:
    return {p for p in os.listdir(tmp) if p.startswith("gemc-crash-")}


def _assert_one_clean_message(proc: subprocess.CompletedProcess[str], expect: str) -> None:
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert expect in text, text
    assert "Traceback" not in text and "internal error" not in text, text
    assert text.count("gemc: error:") == 1, text  # one message, not one per rank
    assert "fix:" in text, text  # what (the error line), where, fix
    assert "where:" in text or "argument --" in text, text


SHARED = ("toy.json", "toy.run.json", "corrupt_calibration.json", "a_dir", "empty_ckpt")


def _run_case(corpus: dict[str, Path], name: str) -> tuple[subprocess.CompletedProcess[str],
                                                          set[Path], set[Path]]:
    """One case in a folder of its own (copies of the shared inputs), so what it leaves
    behind is its own; returns the process and the folder's files before and after."""
    root = corpus["root"] / "cases" / name
    root.mkdir(parents=True)
    for item in SHARED:
        src = corpus["root"] / item
        shutil.copytree(src, root / item) if src.is_dir() else shutil.copy(src, root / item)
    subs = {P: str(root / "toy.json"), RUNREP: str(root / "toy.run.json"), ROOT: str(root)}
    args = []
    for a in CASES[name][0]:
        for key, value in subs.items():
            a = a.replace(key, value)
        args.append(a)
    before = _files(root)
    proc = gemc(*args, *(["--quiet"] if args[0] in ("compile", "run") else []), cwd=root)
    return proc, before, _files(root)


@pytest.fixture(scope="module")
def outcomes(corpus: dict[str, Path],
             own_tmpdir: Path) -> dict[str, tuple[Any, set[Path], set[Path]]]:
    """Every case, two at a time (each is mostly a Python start-up importing torch)."""
    crashes = _crash_files(own_tmpdir)
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(CASES, pool.map(lambda n: _run_case(corpus, n), CASES)))
    assert _crash_files(own_tmpdir) == crashes, "a case left a gemc-crash file (exit 1: a bug)"
    return done


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_exits_2_with_one_message_and_leaves_nothing(outcomes, name) -> None:
    proc, before, after = outcomes[name]
    _assert_one_clean_message(proc, CASES[name][1])
    assert after == before, sorted(map(str, after - before))
    assert not Path(UNWRITABLE).exists()


def test_a_user_error_on_two_ranks_is_one_message_and_exit_2(corpus) -> None:
    """Both ranks fail to find the model: one message (not one per rank, not under
    torchrun's ChildFailedError traceback and OMP banner), exit 2 from gemc run."""
    root = corpus["root"] / "two_ranks"
    root.mkdir()
    before = _files(root)
    proc = gemc("run", str(corpus["two_lost"]), "--device", "cpu", "--steps", "1", "--quiet",
                cwd=root)
    _assert_one_clean_message(proc, "moved_away.py")
    assert "ChildFailedError" not in proc.stderr and "OMP_NUM_THREADS" not in proc.stderr
    assert "starting 2 processes" in proc.stderr
    assert _files(root) == before
    assert not (corpus["root"] / "two_lost.run.json").exists()


def test_help_documents_each_check() -> None:
    """`--help` says the range or kind each option is checked against."""
    run_help = gemc("run", "--help", cwd=REPO).stdout
    for text in ("an integer >= 1", "an integer >= 0", "a number > 0",
                 "refused when it holds none", "checked writable"):
        assert text in " ".join(run_help.split()), text
    compile_help = " ".join(gemc("compile", "--help", cwd=REPO).stdout.split())
    for text in ("a number > 0", "0..300", "checked writable before compiling",
                 "checked before compiling"):
        assert text in compile_help, text
