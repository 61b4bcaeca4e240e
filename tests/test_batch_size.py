"""The batch size is stated by the model, checked against its inputs, never guessed.

The model of these tests has flat jagged ids (12 values for 4 samples) as its first input,
so a guess from the first input's first dimension would be 3x wrong.
"""

from __future__ import annotations

import warnings

import pytest

from gemc.api import load_model
from gemc.errors import EntrypointError
from gemc.probe import ProbeConfig, ProbeSkipped, build_probe_model
from gemc.spec import BATCH_SIZE_MISSING, BatchSizeWarning, batch_size_of
from tests.models import authored

ENTRY = "tests/models/authored.py:build"


def test_stated_batch_size_wins_over_the_first_input():
    spec = load_model(ENTRY)
    assert spec.example_inputs[0].shape[0] == authored.N_IDS != authored.B
    assert batch_size_of(spec) == (authored.B, "ModelSpec.batch_size")


def test_info_batch_size_is_the_fallback_and_nothing_else_is_guessed():
    assert batch_size_of(load_model(ENTRY, {"state_batch": False, "info_batch": True})) == (
        authored.B, "ModelSpec.info['batch_size']"
    )
    assert batch_size_of(load_model(ENTRY, {"state_batch": False})) == (None, None)


@pytest.mark.parametrize(
    ("value", "message"),
    [(0, "must be a positive integer"), (-4, "must be a positive integer"),
     (True, "must be a positive integer"), (7, "no example input has 7")],
)
def test_a_wrong_batch_size_is_refused_with_the_inputs_shapes(value, message):
    with pytest.raises(EntrypointError) as info:
        load_model(ENTRY, {"batch_size": value})
    assert message in info.value.what
    assert "ModelSpec.batch_size" in (info.value.where or "")
    assert info.value.fix
    if value == 7:
        assert "12, 4, 4x5, 4" in info.value.what  # the shapes, so the user sees the batch


def test_offsets_with_a_last_offset_count_as_the_batch():
    # B + 1 offsets (include_last_offset=True) match a stated B
    spec = load_model("tests/models/toy.py:build")
    spec.batch_size = spec.example_inputs[2].shape[0] - 1
    from gemc.entrypoint import check_spec

    check_spec(spec, "toy")


def test_the_runner_warns_loudly_when_the_batch_is_unstated():
    from gemc.backends.torch.runner import local_batch_size

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert local_batch_size(load_model(ENTRY, {"state_batch": False}), 0) == (None, None)
        assert local_batch_size(load_model(ENTRY, {"state_batch": False}), 1) == (None, None)
    assert [w.category for w in caught] == [BatchSizeWarning]  # rank 0 only
    assert str(caught[0].message) == BATCH_SIZE_MISSING
    assert local_batch_size(load_model(ENTRY), 0) == (authored.B, "ModelSpec.batch_size")


def _skip_reason(entrypoint: str, args: dict) -> str:
    config = ProbeConfig(max_fwd_flops=1)  # every model is over this budget
    with pytest.raises(ProbeSkipped) as info:
        build_probe_model(entrypoint, args, config, fwd_flops=1e6)
    return str(info.value)


def test_probe_gives_the_true_reason_it_cannot_shrink_the_batch():
    # the entrypoint takes batch_size, and the batch is already below the probe's minimum
    reason = _skip_reason(ENTRY, {})
    assert "takes no batch_size" not in reason
    assert f"already {authored.B} samples" in reason
    # no batch stated: say so, rather than blame the entrypoint's signature
    reason = _skip_reason(ENTRY, {"state_batch": False})
    assert "states no batch size" in reason
    # an entrypoint without the argument
    reason = _skip_reason("tests/models/toy.py:build", {})
    assert "takes no batch_size argument" in reason


def test_the_plan_records_the_stated_batch_and_warns_when_there_is_none():
    from gemc.api import compile as gemc_compile

    stated = gemc_compile(ENTRY, {}, topology="h200:1x1", planner="naive")
    assert stated["model"]["batch_size"] == authored.B
    assert BATCH_SIZE_MISSING not in stated["warnings"]
    unstated = gemc_compile(ENTRY, {"state_batch": False}, topology="h200:1x1", planner="naive")
    assert unstated["model"]["batch_size"] is None
    assert BATCH_SIZE_MISSING in unstated["warnings"]
