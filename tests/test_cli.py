"""The CLI end to end on the toy model: exit codes, messages, files written or not."""

import json
import subprocess
import sys

import pytest

from gemc.cli import main
from tests.conftest import TOY


def run_cli(*args: str) -> tuple[int, str]:
    """In a fresh process, as a user runs it: exit code and everything printed."""
    proc = subprocess.run([sys.executable, "-m", "gemc.cli", *args], capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def run_main(capsys, *args: str) -> tuple[int, str]:
    """In this process (fast): exit code and everything printed."""
    try:
        rc = main(list(args))
    except SystemExit as exc:  # argparse usage errors
        rc = exc.code
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_compile_explain_validate(tmp_path, capsys):
    out, dumps = tmp_path / "plan.json", tmp_path / "dumps"
    rc = main(
        [
            "compile",
            f"{TOY}:build",
            "--set",
            "hidden=8",
            "--topology",
            "h200:1x8",
            "--out",
            str(out),
            "--dump-dir",
            str(dumps),
            "--quiet",
        ]
    )
    assert rc == 0
    plan = json.loads(out.read_text())
    assert plan["model"]["args"] == {"hidden": 8}
    assert plan["mesh"]["world_size"] == 8
    names = sorted(p.name for p in dumps.iterdir())
    assert names[0] == "000_capture.txt" and "manifest.json" in names
    manifest = json.loads((dumps / "manifest.json").read_text())
    assert [p["name"] for p in manifest["passes"]][:2] == ["capture", "classify-ops"]
    assert all(p["verifier"] == "ok" for p in manifest["passes"])
    assert main(["validate", str(out)]) == 0
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "table.weight" in text and "tower" in text


def test_same_inputs_same_bytes(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        assert main(["compile", f"{TOY}:build", "--out", str(path), "--quiet"]) == 0
    assert a.read_bytes() == b.read_bytes()


def test_dump_mode_changed_and_failure(tmp_path):
    for mode, expect_pass_files in (("changed", True), ("failure", False)):
        d = tmp_path / mode
        assert (
            main(
                [
                    "compile",
                    f"{TOY}:build",
                    "--out",
                    str(tmp_path / f"{mode}.json"),
                    "--dump-dir",
                    str(d),
                    "--dump-mode",
                    mode,
                    "--quiet",
                ]
            )
            == 0
        )
        files = {p.name for p in d.iterdir()}
        assert "manifest.json" in files
        assert ("001_classify-ops.txt" in files) == expect_pass_files


def test_disable_pass_by_name_and_dependency_error(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "compile",
                f"{TOY}:build",
                "--out",
                str(out),
                "--disable-pass",
                "parallelize",
                "--quiet",
            ]
        )
        == 0
    )
    rc = main(
        ["compile", f"{TOY}:build", "--out", str(out), "--disable-pass", "classify-ops", "--quiet"]
    )
    assert rc == 2
    assert "needs classify-ops" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compile", "nofile.py:build", "--out", "{out}"], "does not exist"),
        (["compile", f"{TOY}", "--out", "{out}"], "no ':FUNC' part"),
        (["compile", f"{TOY}:build_wrong_type", "--out", "{out}"], "not a gemc.ModelSpec"),
        (
            ["compile", f"{TOY}:build_not_scalar", "--out", "{out}"],
            "must return the scalar training loss",
        ),
        (
            ["compile", f"{TOY}:build_untraceable", "--out", "{out}"],
            "torch.export could not capture",
        ),
        (["compile", f"{TOY}:build", "--set", "hidden", "--out", "{out}"], "bad --set"),
        (
            ["compile", f"{TOY}:build", "--set", "size=3", "--out", "{out}"],
            "no argument named 'size'",
        ),
        (["compile", f"{TOY}:build", "--topology", "h200:0x8", "--out", "{out}"], "h200:0x8"),
        (["compile", f"{TOY}:build", "--topology", "tpu:1x8", "--out", "{out}"], "tpu"),
        (
            [
                "compile",
                f"{TOY}:build",
                "--dump-mode",
                "some",
                "--dump-dir",
                "{tmp}/d",
                "--out",
                "{out}",
            ],
            "dump mode",
        ),
        (
            ["compile", f"{TOY}:build", "--disable-pass", "nope", "--out", "{out}"],
            "no pass named 'nope'",
        ),
        (
            ["compile", f"{TOY}:build", "--passes", "classify-ops,fusion", "--out", "{out}"],
            "unknown pass 'fusion'",
        ),
        (["compile"], "required"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_exits_2_with_one_clear_message_and_writes_nothing(
    tmp_path, capsys, args, message
):
    out = tmp_path / "plan.json"
    args = [a.replace("{out}", str(out)).replace("{tmp}", str(tmp_path)) for a in args]
    rc, text = (
        run_main(capsys, *args, "--quiet")
        if args[0] == "compile" and len(args) > 1
        else run_main(capsys, *args)
    )
    assert rc == 2, text
    assert message in text
    assert "Traceback" not in text
    assert not out.exists()


def test_corrupt_and_wrong_version_plans(tmp_path, capsys):
    good = tmp_path / "good.json"
    assert main(["compile", f"{TOY}:build", "--out", str(good), "--quiet"]) == 0
    plan = json.loads(good.read_text())
    cases = {
        "truncated.json": good.read_text()[:200],
        "version.json": json.dumps({**plan, "schema_version": 99}),
        "shard.json": json.dumps(
            {
                **plan,
                "tables": [
                    {**plan["tables"][0], "shards": [{**plan["tables"][0]["shards"][0], "rank": 9}]}
                ],
            }
        ),
        "strategy.json": json.dumps(
            {**plan, "regions": [{**plan["regions"][0], "strategy": "zero9"}]}
        ),
    }
    expected = {
        "truncated.json": "not valid JSON",
        "version.json": "schema_version",
        "shard.json": "outside the mesh",
        "strategy.json": "strategy",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        rc, out = run_main(capsys, "validate", str(tmp_path / name))
        assert rc == 2 and expected[name] in out and "Traceback" not in out, (name, out)


def test_a_user_error_in_a_fresh_process_is_one_message_and_exit_2(tmp_path):
    rc, text = run_cli(
        "compile", f"{TOY}:build_untraceable", "--out", str(tmp_path / "p.json"), "--quiet"
    )
    assert rc == 2 and "gemc: error: torch.export could not capture" in text
    assert "Traceback" not in text and "fix:" in text


def test_calibrate_without_a_gpu_says_so(tmp_path, capsys):
    rc, text = run_main(capsys, "calibrate", "--out", str(tmp_path / "c.json"))
    assert rc == 2 and "needs a CUDA GPU" in text
    assert not (tmp_path / "c.json").exists()
