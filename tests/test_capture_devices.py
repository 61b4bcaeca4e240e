"""Capture takes a model as its author wrote it: real example inputs, ``.to("cpu")`` calls.

gemc builds on meta; example inputs built on the CPU follow the model there (shapes and
dtypes kept), a ``.to("cpu")`` in the build keeps a meta tensor on meta, and a mismatch
gemc cannot resolve is named as a device mismatch.
"""

from __future__ import annotations

import pytest
import torch

from gemc.api import load_model
from gemc.capture import capture
from gemc.errors import CaptureError
from gemc.spec import ModelSpec
from tests.models import authored

ENTRY = "tests/models/authored.py:build"



def test_cpu_example_inputs_are_captured_on_meta_with_their_shapes():
    spec = load_model(ENTRY)
    assert all(t.device.type == "cpu" for t in spec.example_inputs)
    assert all(p.is_meta for p in spec.model.parameters())
    captured = capture(spec)
    user_inputs = [
        n.meta["val"] for n in captured.gm.graph.nodes
        if n.op == "placeholder" and n.name not in captured.param_fqns
    ]
    assert [tuple(v.shape) for v in user_inputs] == [tuple(t.shape) for t in spec.example_inputs]
    assert [v.dtype for v in user_inputs] == [t.dtype for t in spec.example_inputs]
    assert all(v.device.type == "meta" for v in user_inputs)
    # the user's batch itself is left where it was
    assert all(t.device.type == "cpu" for t in spec.example_inputs)

    meta_inputs = ModelSpec(
        model=load_model(ENTRY).model,
        example_inputs=tuple(t.to("meta") for t in spec.example_inputs),
        make_batch=spec.make_batch,
    )
    assert capture(meta_inputs).fingerprint == captured.fingerprint


def test_to_cpu_calls_in_the_build_keep_parameters_on_meta():
    spec = load_model(ENTRY, {"params_on_cpu": True})
    assert all(t.is_meta for t in (*spec.model.parameters(), *spec.model.buffers()))
    assert capture(spec).fingerprint == capture(load_model(ENTRY)).fingerprint


def test_stay_on_meta_keeps_a_dtype_change():
    spec = load_model(ENTRY, {"params_on_cpu": True})
    with torch.device("meta"):
        from gemc.entrypoint import stay_on_meta

        with stay_on_meta():
            t = torch.zeros(3).to("cpu", torch.float16)
            u = torch.zeros(3).cpu()
    assert t.is_meta and t.dtype == torch.float16
    assert u.is_meta and u.dtype == torch.float32
    assert spec.model.tower[0].weight.dtype == torch.float32


def test_a_model_with_cpu_and_meta_state_is_captured_on_meta():
    model = authored.AuthoredModel()  # real, on the CPU
    model.tower.to("meta")  # half of it on meta
    spec = ModelSpec(model=model, example_inputs=authored.make_batch(0, "cpu"),
                     make_batch=authored.make_batch, batch_size=authored.B)
    captured = capture(spec)
    assert captured.fingerprint == capture(load_model(ENTRY)).fingerprint


def test_a_real_model_on_cpu_is_captured_as_is():
    spec = authored.build()  # outside gemc: parameters and inputs on the CPU
    assert all(not p.is_meta for p in spec.model.parameters())
    captured = capture(spec)
    assert all(not p.is_meta for p in spec.model.parameters())  # not moved: a real capture
    assert all(
        n.meta["val"].device.type == "cpu"
        for n in captured.gm.graph.nodes
        if n.op == "placeholder"
    )


def test_device_mismatch_gemc_cannot_resolve_is_named_as_such():
    spec = load_model("tests/models/authored.py:build_cpu_constant")
    with pytest.raises(CaptureError) as info:
        capture(spec, entrypoint="tests/models/authored.py:build_cpu_constant")
    err = info.value
    assert "different devices" in err.what
    assert "example inputs given on cpu" in err.what
    assert "parameters and buffers on meta" in err.what
    assert "data-dependent" not in str(err)
    assert "authored.py" in (err.where or "")
    assert "device=x.device" in (err.fix or "") and "register_buffer" in (err.fix or "")


def test_other_capture_failures_keep_their_message():
    class Branchy(authored.AuthoredModel):
        def forward(self, ids, offsets, hist_ids, labels):  # noqa: ANN001, ANN201
            if labels.sum() > 1:  # data-dependent branching
                return labels.mean()
            return labels.sum()

    spec = ModelSpec(model=Branchy(), example_inputs=authored.make_batch(0, "cpu"),
                     make_batch=authored.make_batch, batch_size=authored.B)
    with pytest.raises(CaptureError) as info:
        capture(spec)
    assert "data-dependent" in (info.value.fix or "")
    assert "different devices" not in info.value.what


def test_a_real_model_with_meta_inputs_is_named_as_a_device_mismatch():
    spec = authored.build()  # parameters on the CPU, for real
    spec.example_inputs = tuple(t.to("meta") for t in spec.example_inputs)
    with pytest.raises(CaptureError) as info:
        capture(spec)
    assert "example inputs given on meta, parameters and buffers on cpu" in info.value.what
    assert "moved to meta" not in info.value.what


@pytest.mark.parametrize("text", [
    # torch 2.11 (the GPU machine) has no FakeTensorDeviceMismatchError: a bare RuntimeError
    "Unhandled FakeTensor Device Propagation for aten.mul.Tensor, found two different "
    "devices cpu, cuda:0",
    "Expected all tensors to be on the same device, but found at least two devices",
])
def test_a_device_mismatch_is_recognised_in_each_torch_versions_words(text):
    from gemc.capture import is_device_mismatch

    try:
        try:
            raise RuntimeError(text)
        except RuntimeError as inner:
            raise ValueError("export failed") from inner
    except ValueError as outer:
        assert is_device_mismatch(outer)
    assert not is_device_mismatch(RuntimeError("a shape mismatch: 3 vs 4"))
