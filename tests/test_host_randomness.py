"""A forward that draws from Python's or NumPy's generator while torch.export traces it
keeps the drawn value as a constant of every step: the capture names the line and
refuses it, or (asked to freeze) keeps it reproducibly and says so; the user's generator
states are left as they were; a draw with torch stays in the graph and passes."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from gemc.api import load_model
from gemc.capture import capture
from gemc.errors import CaptureError
from gemc.host_randomness import CAPTURE_SEED
from tests.test_cli import run_main

ENTRY = "tests/models/host_random.py:build"


def _spec(how: str):  # noqa: ANN202
    return load_model(ENTRY, {"how": how})


@pytest.mark.parametrize("how, site", [("random", "host_random.py:25 in forward"),
                                       ("numpy", "host_random.py:27 in forward"),
                                       ("bound", "bound before the capture")])
def test_a_host_draw_is_refused_naming_its_line_and_the_fix(how: str, site: str) -> None:
    with pytest.raises(CaptureError) as err:
        capture(_spec(how), entrypoint=ENTRY)
    text = str(err.value)
    assert site in text and "constant" in text
    assert "torch.randint" in err.value.fix and "--host-randomness freeze" in err.value.fix


def test_capture_leaves_the_callers_generators_where_they_were() -> None:
    random.seed(123)
    np.random.seed(123)
    expected_py, expected_np = random.random(), np.random.rand()
    random.seed(123)
    np.random.seed(123)
    with pytest.raises(CaptureError):
        capture(_spec("random"))
    capture(_spec("numpy"), host_randomness="freeze")
    assert random.random() == expected_py and np.random.rand() == expected_np
    assert random.randint is not None and random.randint.__name__ == "randint"


def test_freeze_keeps_the_seeded_draw_so_compile_and_runner_captures_agree() -> None:
    first = capture(_spec("random"), host_randomness="freeze")
    random.seed(99)  # the caller's state does not reach the capture's draw
    second = capture(_spec("random"), host_randomness="freeze")
    assert first.frozen_draws == second.frozen_draws
    assert first.frozen_draws[0].startswith("host_random.py:25 in forward")
    assert first.fingerprint == second.fingerprint
    random.seed(CAPTURE_SEED)
    drawn = random.randint(0, 100)
    consts = [a for n in first.gm.graph.nodes for a in n.args if isinstance(a, int)]
    assert drawn in consts  # the graph compares t with the value drawn under the seed


def test_a_draw_with_torch_stays_in_the_graph() -> None:
    captured = capture(_spec("torch"))
    assert captured.frozen_draws == ()
    ops = {str(n.target) for n in captured.gm.graph.nodes if n.op == "call_function"}
    assert any("randint" in op for op in ops)


def test_cli_refuses_then_freezes_with_a_plan_warning(tmp_path, capsys) -> None:  # noqa: ANN001
    plan = tmp_path / "plan.json"
    args = ("compile", ENTRY, "--out", str(plan), "--quiet", "--planner", "greedy",
            "--topology", "h200:1x1")
    rc, text = run_main(capsys, *args)
    assert rc != 0 and not plan.exists()
    assert "host_random.py:25 in forward" in text and "Traceback" not in text
    rc, text = run_main(capsys, *args, "--host-randomness", "freeze")
    assert rc == 0, text
    assert "warning: capture: the forward draws" in text
    assert any("host_random.py:25" in w for w in json.loads(plan.read_text())["warnings"])


def test_a_bad_mode_is_named() -> None:
    from gemc.config import CompileConfig
    from gemc.errors import GemcUserError

    with pytest.raises(GemcUserError, match="host randomness mode 'sometimes'"):
        CompileConfig(host_randomness="sometimes").validate()
