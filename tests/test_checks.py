"""gemc.checks in process: what each path and number check accepts, refuses, and creates."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gemc import checks
from gemc.errors import GemcUserError


def test_an_output_file_may_need_new_folders_and_the_check_creates_nothing(tmp_path: Path):
    target = tmp_path / "a" / "b" / "plan.json"
    assert checks.output_file(target, "--out") == target
    assert list(tmp_path.iterdir()) == []  # no folder made, no probe left


def test_output_paths_refuse_the_wrong_kind_and_places_that_take_no_files(tmp_path: Path):
    (tmp_path / "f.json").write_text("{}")
    with pytest.raises(GemcUserError, match="names a directory"):
        checks.output_file(tmp_path, "--out")
    with pytest.raises(GemcUserError, match="is a file"):
        checks.output_file(tmp_path / "f.json" / "plan.json", "--out")
    with pytest.raises(GemcUserError, match="names a file"):
        checks.output_dir(tmp_path / "f.json", "--dump-dir")
    with pytest.raises(GemcUserError, match="cannot write") as exc:
        checks.output_dir("/proc/gemc-checks/dumps", "--dump-dir")
    assert exc.value.where == "--dump-dir /proc/gemc-checks/dumps" and exc.value.fix


def test_input_paths_must_exist_and_be_of_their_kind(tmp_path: Path):
    (tmp_path / "f.json").write_text("{}")
    assert checks.input_file(tmp_path / "f.json", "--calibration") == tmp_path / "f.json"
    with pytest.raises(GemcUserError, match="does not exist"):
        checks.input_file(tmp_path / "missing.json", "--calibration")
    with pytest.raises(GemcUserError, match="is a directory"):
        checks.input_file(tmp_path, "--calibration")
    with pytest.raises(GemcUserError, match="is a file"):
        checks.input_dir(tmp_path / "f.json", "gemc report")


@pytest.mark.parametrize(
    ("parse", "good", "bad", "message"),
    [
        (checks.int_at_least(1), ("1", 1), "0", "must be an integer >= 1, got 0"),
        (checks.int_at_least(0), ("0", 0), "1.5", "expected an integer"),
        (checks.positive_float, ("1e-3", 1e-3), "-2", "must be a number > 0"),
        (checks.positive_float, ("3", 3.0), "inf", "finite"),
        (checks.float_in(0.0, 300.0), ("25", 25.0), "301", "must be in [0, 300]"),
    ],
)
def test_number_checks(parse, good, bad, message):
    assert parse(good[0]) == good[1]
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("[", r"\[")):
        parse(bad)
