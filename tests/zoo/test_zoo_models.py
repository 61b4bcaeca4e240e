"""The zoo's models as their authors would check them, without gemc (CPU, tiny; h200 on meta).

For every model of ``examples/zoo``: the tiny preset trains (a finite scalar loss whose
backward reaches every parameter, fast), ``make_batch`` is deterministic in the step and
shaped like the example inputs with every id inside its table and every jagged structure
well formed (some empty, some full rows, about half filled), and the h200 preset, built
under ``torch.device("meta")`` as gemc builds it, has the parameter count its docstring
states while its example inputs stay a real CPU batch. The idioms issue #15 lists are each
checked to be present somewhere in the zoo.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from examples.zoo import MODELS  # noqa: E402
from gemc.spec import ModelSpec  # noqa: E402

# The h200 parameter counts stated in each module's docstring.
H200_PARAMS = {
    "dlrm_dcnv2": 1_694_973_441,
    "hstu": 522_515_968,
    "sasrec_bst": 465_481_729,
    "din": 1_288_633_602,
    "wukong": 1_169_760_578,
    "mmoe": 806_748_443,
    "transact": 1_561_192_323,
}
H200_BATCH = {"dlrm_dcnv2": 16384, "hstu": 128, "sasrec_bst": 2048, "din": 2048,
              "wukong": 8192, "mmoe": 2048, "transact": 4096}


TINY_BATCH = {name: 16 if name == "dlrm_dcnv2" else 8 for name in MODELS}


def _samples(name: str, batch: tuple[torch.Tensor, ...]) -> int:
    """The number of samples a batch holds, read from its structure (not from info)."""
    if name == "hstu":
        return batch[1].numel() - 1  # x_offsets has B + 1 entries
    return batch[-1].shape[0]  # the labels


def _module(name: str) -> Any:
    return importlib.import_module(f"examples.zoo.{name}")


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_zoo_lists_every_module() -> None:
    files = {p.stem for p in (REPO / "examples" / "zoo").glob("*.py") if p.stem != "__init__"}
    assert files == set(MODELS)
    assert len(MODELS) >= 6


# ------------------------------------------------------------------- jagged structure per model

def _lengths(
    name: str, spec: ModelSpec, batch: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, int] | None:
    """Per-row history lengths and the padded/max length, for the models with a history."""
    info = spec.info
    if name == "hstu":
        offsets = batch[1]
        assert offsets[0] == 0 and offsets[-1] == batch[0].numel()
        return offsets[1:] - offsets[:-1], info["max_seq_len"]
    if name == "sasrec_bst":
        mask = batch[2]
        assert mask.dtype == torch.bool
        lengths = mask.sum(1)
        # the mask is a prefix: True then False, and the padded ids are 0 exactly there
        assert torch.equal(mask, torch.arange(mask.size(1))[None, :] < lengths[:, None])
        assert torch.equal(batch[0] == 0, ~mask)
        return lengths, info["max_len"]
    if name == "din":
        return batch[2], info["max_len"]
    if name == "mmoe":
        lengths = batch[4]
        valid = torch.arange(batch[3].size(1))[None, :] < lengths[:, None]
        assert torch.equal(batch[3] == 0, ~valid)
        return lengths, info["max_len"]
    if name == "transact":  # action type 0 is padding, at the end; latest action first
        real = batch[0] > 0
        lengths = real.sum(1)
        assert torch.equal(real, torch.arange(real.size(1))[None, :] < lengths[:, None])
        assert (batch[2][:, 1:] < batch[2][:, :-1]).all()  # times fall along the sequence
        return lengths, info["max_len"]
    return None


def _bag_inputs(model: nn.Module) -> Iterator[tuple[nn.Module, Callable[[], list]]]:
    """Every embedding module with a hook recording the (ids, offsets) it is called with."""
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            seen: list[tuple[torch.Tensor, ...]] = []

            def hook(mod: nn.Module, args: tuple, kwargs: dict, seen: list = seen) -> None:
                seen.append(tuple(a for a in args if isinstance(a, torch.Tensor)))

            module.register_forward_pre_hook(hook, with_kwargs=True)
            yield module, (lambda seen=seen: seen)


# ------------------------------------------------------------------------------------ tiny

@pytest.mark.parametrize("name", MODELS)
def test_tiny_trains_on_cpu(name: str) -> None:
    spec = _module(name).build("tiny")
    assert isinstance(spec, ModelSpec)
    assert all(t.device.type == "cpu" for t in spec.example_inputs)
    model = spec.model
    loss = model(*spec.example_inputs)  # warm-up (first calls import lazily)
    loss.backward()
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = model(*spec.make_batch(1, "cpu"))
    loss.backward()
    elapsed = time.perf_counter() - start
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    zero = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.any()]
    assert not missing, f"backward does not reach {missing}"
    assert not zero, f"zero gradient for {zero}"
    assert elapsed < 1.0, f"tiny fwd+bwd took {elapsed:.2f}s"


@pytest.mark.parametrize("name", MODELS)
def test_make_batch_is_deterministic_and_shaped_like_example(name: str) -> None:
    spec = _module(name).build("tiny")
    a, b = spec.make_batch(3, "cpu"), spec.make_batch(3, torch.device("cpu"))
    other = spec.make_batch(4, "cpu")
    assert len(a) == len(spec.example_inputs)
    for x, y, ex in zip(a, b, spec.example_inputs, strict=True):
        assert x.shape == ex.shape and x.dtype == ex.dtype and x.device.type == "cpu"
        assert torch.equal(x, y)
    assert any(not torch.equal(x, z) for x, z in zip(a, other)), "step 3 and 4 gave one batch"
    assert torch.equal(spec.make_batch(0, "cpu")[0], spec.example_inputs[0])
    assert spec.batch_size == spec.info["batch_size"] == TINY_BATCH[name] == _samples(name, a)
    five = _module(name).build("tiny", batch_size=5)
    assert five.batch_size == 5 == _samples(name, five.example_inputs)


@pytest.mark.parametrize("name", MODELS)
def test_ids_in_range_and_jagged_well_formed(name: str) -> None:
    spec = _module(name).build("tiny")
    recorders = list(_bag_inputs(spec.model))
    assert recorders
    batches = [spec.make_batch(s, "cpu") for s in range(4)]
    for batch in batches:
        spec.model(*batch)
        got = _lengths(name, spec, batch)
        if got is not None:
            lengths, max_len = got
            assert (lengths == 0).any() and (lengths == max_len).any(), lengths
            assert lengths.min() >= 0 and lengths.max() <= max_len
            fill = lengths.float().mean().item() / max_len
            assert 0.2 < fill < 0.8, f"mean fill {fill:.2f}, expected ~0.5"
    for module, seen in recorders:
        calls = seen()
        assert calls, f"{module} never called"
        for args in calls:
            ids = args[0]
            assert ids.dtype == torch.int64
            assert ids.min() >= 0 and ids.max() < module.num_embeddings
            if isinstance(module, nn.EmbeddingBag) and len(args) > 1 and args[1].dim() == 1:
                offsets = args[1]
                assert not module.include_last_offset and offsets[0] == 0
                assert (offsets[1:] >= offsets[:-1]).all() and offsets[-1] <= ids.numel()


# ------------------------------------------------------------------------------------ h200

@pytest.mark.parametrize("name", MODELS)
def test_h200_on_meta_has_stated_size(name: str) -> None:
    with torch.device("meta"):
        spec = _module(name).build("h200")
    params = list(spec.model.parameters())
    assert all(p.device.type == "meta" for p in params), "h200 must not allocate weights"
    assert sum(p.numel() for p in params) == H200_PARAMS[name]
    assert f"{H200_PARAMS[name]:,}" in _module(name).__doc__, "the docstring states the count"
    assert spec.batch_size == H200_BATCH[name] == _samples(name, spec.example_inputs)
    # the example inputs are a user's real batch: on the CPU even under the meta device
    assert all(t.device.type == "cpu" for t in spec.example_inputs)
    gb = 16 * H200_PARAMS[name] / 1e9  # fp32 weight + grad + Adam m, v
    assert gb < 40, f"{gb:.0f} GB of parameter state leaves no room under 60 GB"


# ------------------------------------------------------------------------------------ idioms

def _all_modules() -> list[nn.Module]:
    return [_module(n).build("tiny").model for n in MODELS]


def test_zoo_carries_every_idiom_of_issue_15() -> None:
    models = dict(zip(MODELS, _all_modules(), strict=True))
    mods = [m for model in models.values() for m in model.modules()]
    sources = {n: inspect.getsource(_module(n)) for n in MODELS}

    def uses(text: str) -> list[str]:
        return [n for n, src in sources.items() if text in src]

    # parameters created in __init__ by modules that have no reset_parameters
    own = [m for m in mods if any(True for _ in m.parameters(recurse=False))
           and not hasattr(m, "reset_parameters")]
    assert len({type(m).__name__ for m in own}) >= 4, [type(m).__name__ for m in own]
    assert len(uses("nn.init.")) >= 5
    bags = [m for m in mods if isinstance(m, nn.EmbeddingBag)]
    assert any(not b.include_last_offset for b in bags)
    assert uses("per_sample_weights=weights")
    assert any(isinstance(m, nn.Embedding) and m.padding_idx == 0 for m in mods)
    assert any(isinstance(m, nn.MultiheadAttention) and m.batch_first for m in mods)
    assert uses("key_padding_mask=")
    assert uses("F.scaled_dot_product_attention(q, k, v, is_causal=True)")
    assert uses("-10000.0")  # an additive float mask
    # nn.TransformerEncoder under an additive float key mask that is no prefix (TransAct's
    # time window masks the latest actions)
    assert any(isinstance(m, nn.TransformerEncoder) for m in mods)
    assert uses('masked_fill_(key_padding_mask, float("-inf"))') and uses("src_key_padding_mask=")
    # boolean mask input and lengths / offsets as the jagged input
    example = {n: _module(n).build("tiny").example_inputs for n in MODELS}
    assert any(t.dtype == torch.bool for t in example["sasrec_bst"])
    assert uses("x_offsets") and uses("hist_len") and uses("history_len")
    # a dataclass batch flattened by the entrypoint, and labels for several tasks
    assert uses("@dataclass\nclass RankingBatch")
    assert uses("labels: dict[str, torch.Tensor]")
    assert len(_module("mmoe").TASKS) >= 2 and example["wukong"][-1].shape[1] >= 2
    # example inputs created on the CPU, not following a default device
    for name in MODELS:
        with torch.device("meta"):
            spec = _module(name).build("tiny")
        assert all(t.device.type == "cpu" for t in spec.example_inputs), name


def test_hstu_attention_is_pointwise_silu_and_causal() -> None:
    """The paper's attention: silu(QK^T + rab) / n, no softmax; a later token never
    changes an earlier token's output (causal), and padding never leaks in."""
    hstu = _module("hstu")
    spec = hstu.build("tiny")
    layer = spec.model._attention_layers[0]
    torch.manual_seed(0)
    n, d = 4, layer._embedding_dim
    x = torch.randn(n, d)
    row, col = torch.zeros(n, dtype=torch.long), torch.arange(n)
    ts8 = F.pad(torch.arange(n)[None, :] * 60, (0, 8 - n))  # padded [1, 8] timestamps
    mask = torch.tril(torch.ones(8, 8))
    full = layer(x, row, col, 1, 8, ts8, mask)
    prefix = layer(x[:2], row[:2], col[:2], 1, 8, ts8, mask)
    torch.testing.assert_close(full[:2], prefix)
    assert "softmax" not in inspect.getsource(hstu.SequentialTransductionUnitJagged.forward)
    assert math.isfinite(spec.model(*spec.example_inputs).item())
