"""The reference models in examples/: the ModelSpec contract, capture on meta, and scale.

Fast by design (tiny presets run for real on CPU; h200 / gem-xl / xl are only built on the
meta device and never allocated). ``GEMC_SLOW_TESTS=1`` adds the GEM-scale exports (~30 s
each).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.dlrm import model as dlrm  # noqa: E402
from examples.gem import model as gem  # noqa: E402
from gemc.spec import ModelSpec  # noqa: E402

MODELS: dict[str, Any] = {"gem": gem, "dlrm": dlrm}
SLOW = pytest.mark.skipif(not os.environ.get("GEMC_SLOW_TESTS"), reason="set GEMC_SLOW_TESTS=1")


def _build(name: str, device: str = "cpu", **kwargs: Any) -> ModelSpec:
    with torch.device(device):
        return MODELS[name].build(**kwargs)


def _num_tables(spec: ModelSpec) -> int:
    return spec.info["num_tables"]


def _pairs(spec: ModelSpec, batch: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids_t, offsets_t) per table: the interleaved layout both modules document."""
    n = _num_tables(spec)
    return [(batch[1 + 2 * t], batch[2 + 2 * t]) for t in range(n)]


def _table_rows(spec: ModelSpec) -> list[int]:
    return [bag.num_embeddings for bag in spec.model.bags]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    """Tiny models on one intra-op thread: on a small shared machine, OpenMP threads
    spin-waiting for a busy core turn a 20 ms step into hundreds of ms (measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["gem", "dlrm"])
def tiny(request: pytest.FixtureRequest) -> tuple[str, ModelSpec]:
    return request.param, _build(request.param, preset="tiny")


# ----------------------------------------------------------------------------- runs on CPU


def test_forward_is_finite_scalar(tiny: tuple[str, ModelSpec]) -> None:
    _, spec = tiny
    for batch in (spec.make_batch(0, "cpu"), spec.example_inputs):
        loss = spec.model(*batch)
        assert loss.dim() == 0 and loss.dtype == torch.float32
        assert torch.isfinite(loss), loss


def test_backward_reaches_every_parameter(tiny: tuple[str, ModelSpec]) -> None:
    _, spec = tiny
    spec.model.zero_grad(set_to_none=True)
    spec.model(*spec.make_batch(1, "cpu")).backward()
    missing = [n for n, p in spec.model.named_parameters() if p.grad is None]
    assert not missing, f"no grad: {missing}"
    dead = [n for n, p in spec.model.named_parameters() if not p.grad.abs().sum() > 0]
    assert not dead, f"all-zero grad: {dead}"
    bad = [n for n, p in spec.model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite grad: {bad}"


def test_make_batch_deterministic_and_shaped(tiny: tuple[str, ModelSpec]) -> None:
    _, spec = tiny
    a, b, c = spec.make_batch(3, "cpu"), spec.make_batch(3, "cpu"), spec.make_batch(4, "cpu")
    assert len(a) == len(spec.example_inputs) == len(c)
    for x, y, ex in zip(a, b, spec.example_inputs):
        assert torch.equal(x, y)
        assert x.shape == ex.shape and x.dtype == ex.dtype and x.device.type == "cpu"
    differs = [i for i, (x, z) in enumerate(zip(a, c)) if not torch.equal(x, z)]
    # dense, every ids/offsets, labels: nearly every input changes between steps
    assert len(differs) >= len(a) - 1, differs
    # another seed gives another stream
    other = MODELS[tiny[0]].build(preset="tiny", seed=1).make_batch(3, "cpu")
    assert not torch.equal(a[0], other[0])


def _check_jagged(ids: torch.Tensor, offsets: torch.Tensor, rows: int, b: int) -> torch.Tensor:
    assert ids.dtype == offsets.dtype == torch.int64
    assert offsets.shape == (b + 1,)
    assert offsets[0] == 0 and offsets[-1] == ids.numel()
    lengths = offsets[1:] - offsets[:-1]
    assert (lengths >= 0).all()
    assert ids.numel() == 0 or (ids.min() >= 0 and ids.max() < rows)
    return lengths


def test_jagged_inputs_are_valid_with_empty_rows(tiny: tuple[str, ModelSpec]) -> None:
    name, spec = tiny
    batch = spec.make_batch(0, "cpu")
    b = spec.info["batch_size"]
    assert batch[0].shape[0] == b
    for t, ((ids, offs), rows) in enumerate(zip(_pairs(spec, batch), _table_rows(spec))):
        lengths = _check_jagged(ids, offs, rows, b)
        assert (lengths == 0).any(), f"table {t} has no empty bag"
        assert lengths.float().std() > 0, f"table {t} bags all of one length"
    labels = batch[-1]
    assert labels.dtype == torch.float32 and set(labels.unique().tolist()) <= {0.0, 1.0}
    if name == "gem":
        assert labels.shape == (b, 2)
        assert (labels[:, 1] <= labels[:, 0]).all(), "a conversion without a click"
        seq_ids, seq_offs = batch[-3], batch[-2]
        lengths = _check_jagged(seq_ids, seq_offs, spec.model.item_emb.num_embeddings, b)
        assert (lengths == 0).any() and lengths.max() <= spec.info["history_len"]
        assert lengths.max() > lengths.float().mean()  # skewed, not uniform
    else:
        assert labels.shape == (b, 1)


def test_rows_are_independent_and_empty_history_is_sane() -> None:
    """Changing one user's history changes only that user's logits (the jagged->padded
    conversion routes every item to its own row), and an empty history gives finite output
    that does not depend on anything in the padding."""
    spec = _build("gem", preset="tiny")
    model = spec.model.eval()
    logits: list[torch.Tensor] = []
    model.ctr_head.register_forward_hook(lambda m, i, o: logits.append(o.detach()))
    batch = list(spec.make_batch(0, "cpu"))
    seq_ids, seq_offs = batch[-3], batch[-2]
    lengths = seq_offs[1:] - seq_offs[:-1]
    r = int(torch.nonzero(lengths >= 2)[0])
    empty = torch.nonzero(lengths == 0).flatten()
    assert empty.numel() > 0
    with torch.no_grad():
        model(*batch)
        changed = seq_ids.clone()
        changed[seq_offs[r] : seq_offs[r + 1]] = (changed[seq_offs[r] : seq_offs[r + 1]] + 7) % 1000
        batch[-3] = changed
        model(*batch)
    base, new = logits[0], logits[1]
    assert torch.isfinite(base).all()
    diff = (base - new).abs().flatten()
    assert diff[r] > 1e-6, "the perturbed user's logit did not move"
    others = torch.cat([diff[:r], diff[r + 1 :]])
    torch.testing.assert_close(others, torch.zeros_like(others), atol=1e-5, rtol=0)


def test_tiny_step_is_fast(tiny: tuple[str, ModelSpec]) -> None:
    _, spec = tiny
    batch = spec.make_batch(0, "cpu")
    spec.model(*batch).backward()  # warm-up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        spec.model(*batch).backward()
        times.append(time.perf_counter() - t0)
    assert sorted(times)[1] < 0.3, times


def test_materializes_from_meta_like_the_runner(tiny: tuple[str, ModelSpec]) -> None:
    """Runner path: build on meta, ``to_empty`` + ``reset_parameters``, then train a step."""
    name, _ = tiny
    spec = _build(name, "meta", preset="tiny")
    for mod in spec.model.modules():
        if list(mod.parameters(recurse=False)):
            assert hasattr(mod, "reset_parameters"), f"{type(mod).__name__} cannot be re-initialized"
    model = spec.model.to_empty(device="cpu")
    torch.manual_seed(0)
    for mod in model.modules():
        if list(mod.parameters(recurse=False)):
            mod.reset_parameters()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    loss = model(*spec.make_batch(0, "cpu"))
    assert torch.isfinite(loss)
    loss.backward()


# ----------------------------------------------------------------------------- meta / export


def _export(spec: ModelSpec) -> torch.export.ExportedProgram:
    return torch.export.export(spec.model, spec.example_inputs, strict=False)


def test_exports_on_meta(tiny: tuple[str, ModelSpec]) -> None:
    name, _ = tiny
    spec = _build(name, "meta", preset="tiny")
    assert all(p.device.type == "meta" for p in spec.model.parameters())
    assert all(x.device.type == "meta" for x in spec.example_inputs)
    ep = _export(spec)
    gm = ep.graph_module
    ops = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    bags = sum(v for k, v in ops.items() if k.startswith("aten.embedding_bag"))
    assert bags == spec.info["num_tables"], ops
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    val = out[0].meta["val"]
    assert val.dim() == 0 and val.is_floating_point()
    if name == "gem":
        sdpa = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
        assert len(sdpa) == 2 * spec.info["num_blocks"]
        # the key-padding mask: arange(L)[None, :] < lengths[:, None], then mask[:, None, None, :]
        for node in sdpa:
            mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
            assert isinstance(mask, torch.fx.Node), f"SDPA without a mask: {node.format_node()}"
            assert tuple(mask.meta["val"].shape) == (spec.info["batch_size"], 1, 1, spec.info["history_len"])
            seen, stack = set(), [mask]
            while stack:
                n = stack.pop()
                if not isinstance(n, torch.fx.Node) or n.name in seen:
                    continue
                seen.add(n.name)
                if str(n.target).startswith("aten.lt"):
                    break
                stack.extend(a for a in n.all_input_nodes)
            else:
                pytest.fail("attention mask not built by a '<' comparison against lengths")
        assert ops["aten.repeat_interleave.self_Tensor"] == 1
        assert ops["aten.index_put.default"] == 1


def test_entrypoint_through_gemc_loader() -> None:
    """What `gemc compile examples/gem/model.py:build --set preset=tiny` does first."""
    from gemc.entrypoint import build_spec, load_entrypoint

    for rel in ("examples/gem/model.py", "examples/dlrm/model.py"):
        fn = load_entrypoint(f"{REPO / rel}:build")
        spec = build_spec(fn, {"preset": "tiny", "batch_size": 8}, entrypoint=rel, device="meta")
        assert spec.info["batch_size"] == 8 and spec.example_inputs[0].shape[0] == 8
        assert next(spec.model.parameters()).device.type == "meta"


def _count_params(model: nn.Module) -> tuple[int, int]:
    """(embedding, dense) by module type, independent of the model's own bookkeeping."""
    emb = sum(
        p.numel()
        for m in model.modules() if isinstance(m, (nn.EmbeddingBag, nn.Embedding))
        for p in m.parameters(recurse=False)
    )
    if hasattr(model, "pos_emb"):  # the position table is dense: every row trains every step
        emb -= model.pos_emb.weight.numel()
    return emb, sum(p.numel() for p in model.parameters()) - emb


def test_gem_xl_scale() -> None:
    spec = _build("gem", "meta", preset="gem-xl")
    info = spec.info
    bags = [m for m in spec.model.modules() if isinstance(m, nn.EmbeddingBag)]
    assert info["num_tables"] == len(bags) >= 1000
    assert info["total_rows"] == sum(m.num_embeddings for m in bags) >= 10**10
    emb, dense = _count_params(spec.model)
    assert (info["embedding_params"], info["dense_params"]) == (emb, dense)
    assert dense >= 10**9
    assert info["history_len"] >= 1024 and spec.model.pos_emb.num_embeddings == info["history_len"]
    assert 0.3 <= info["mean_fill"] <= 0.7
    b = info["batch_size"]
    assert spec.example_inputs[-3].shape == (round(b * info["history_len"] * info["mean_fill"]),)
    assert info["preset"] == "gem-xl"


def test_gem_h200_fits_one_gpu() -> None:
    spec = _build("gem", "meta", preset="h200")
    info, model = spec.info, spec.model
    assert 80 <= info["num_tables"] <= 120
    rows = _table_rows(spec)
    assert min(rows) >= 10**5 and max(rows) <= 10**7 and max(rows) >= 10 * min(rows)
    dims = {bag.embedding_dim for bag in model.bags}
    assert min(dims) >= 64 and max(dims) <= 128 and len(dims) > 1
    assert 3000 <= info["batch_size"] <= 5000
    assert 256 <= info["history_len"] <= 512 and 0.4 <= info["mean_fill"] <= 0.6
    assert info["d_model"] == 256 and 2 <= info["num_blocks"] <= 4
    emb, dense = _count_params(model)
    assert (info["embedding_params"], info["dense_params"]) == (emb, dense)
    # fp32 weights + grads + Adam, plus bf16 activations: well under 60 GB
    assert 16 * (emb + dense) / 1e9 < 30
    assert info["est_memory_gb"] < 50
    # ~30-80 ms at 300-600 TFLOP/s effective bf16
    assert 5e12 < info["est_step_flops"] < 40e12


def test_dlrm_scale_presets() -> None:
    for preset, min_tables, min_rows in (("xl", 1000, 10**10), ("h200", 26, 10**7)):
        spec = _build("dlrm", "meta", preset=preset)
        info = spec.info
        assert info["num_tables"] == len(spec.model.bags) >= min_tables
        assert info["total_rows"] == sum(_table_rows(spec)) >= min_rows
        emb, dense = _count_params(spec.model)
        assert (info["embedding_params"], info["dense_params"]) == (emb, dense)
        assert info["history_len"] == 0
        if preset == "h200":
            assert info["est_memory_gb"] < 50


@pytest.mark.parametrize(("name", "preset"), [("gem", "tiny"), ("gem", "h200"), ("dlrm", "h200")])
def test_flop_estimate_matches_flop_counter(name: str, preset: str) -> None:
    """info's analytic FLOPs agree with torch's FLOP counter on a meta fwd+bwd."""
    spec = _build(name, "meta", preset=preset)
    with FlopCounterMode(display=False) as counter:
        spec.model(*spec.example_inputs).backward()
    measured = counter.get_total_flops()
    assert math.isclose(spec.info["est_step_flops"], measured, rel_tol=0.02), (
        spec.info["est_step_flops"], measured
    )


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("name", ["gem", "dlrm"])
def test_bad_preset_names_the_valid_ones(name: str) -> None:
    mod = MODELS[name]
    with pytest.raises(ValueError, match="unknown preset 'huge'") as err:
        mod.build(preset="huge")
    for valid in mod.PRESETS:
        assert valid in str(err.value)
    with pytest.raises(ValueError, match="unknown .* option"):
        mod.build(preset="tiny", not_a_field=3)


def test_dlrm_dot_interaction_runs_and_exports() -> None:
    spec = _build("dlrm", preset="tiny", interaction="dot")
    loss = spec.model(*spec.make_batch(0, "cpu"))
    assert torch.isfinite(loss)
    loss.backward()
    _export(_build("dlrm", "meta", preset="tiny", interaction="dot"))
    with pytest.raises(ValueError, match="interaction"):
        dlrm.build(preset="tiny", interaction="cross")


# ----------------------------------------------------------------------------- slow (opt-in)


@SLOW
@pytest.mark.parametrize(("name", "preset"), [("gem", "gem-xl"), ("dlrm", "xl"), ("gem", "h200")])
def test_scale_presets_export(name: str, preset: str) -> None:
    t0 = time.perf_counter()
    ep = _export(_build(name, "meta", preset=preset))
    assert time.perf_counter() - t0 < 60
    assert len(ep.graph.nodes) > 1000
