"""The author's build: the model for real on the CPU, its tables left on meta.

The runner and the precision probe take from it the values of tensors no
``reset_parameters()`` writes; a table is never allocated by it (tables are the large part).
"""

from __future__ import annotations

import torch

from gemc.api import load_model
from gemc.entrypoint import AuthorBuild
from gemc.probe import ProbeConfig, build_probe_model
from gemc.probe import derive_seed as probe_seed
from tests.models import authored

ENTRY = "tests/models/authored.py:build"
TABLE = (authored.ROWS, authored.DIM)


def test_tables_stay_on_meta_and_dense_is_real_and_seeded():
    origin = load_model(ENTRY).origin
    assert origin == (ENTRY, {})
    model = AuthorBuild(origin, {TABLE}, seed=5)()
    assert model.bag.weight.is_meta and model.items.weight.is_meta
    assert not any(p.is_meta for n, p in model.named_parameters() if not n.startswith(("bag", "items")))
    again = AuthorBuild(origin, {TABLE}, seed=5)()
    torch.testing.assert_close(model.pos.data, again.pos.data)  # deterministic in the seed
    other = AuthorBuild(origin, {TABLE}, seed=6)()
    assert not torch.equal(model.pos.data, other.pos.data)


def test_the_build_leaves_the_global_rng_alone():
    origin = load_model(ENTRY).origin
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    AuthorBuild(origin, {TABLE}, seed=5)()
    torch.testing.assert_close(torch.rand(3), expected)


def test_probe_folds_tables_and_its_author_build_keeps_the_originals_on_meta(monkeypatch):
    built = []
    original = AuthorBuild.__call__

    def spy(self):  # noqa: ANN001, ANN202
        model = original(self)
        built.append(model)
        return model

    monkeypatch.setattr(AuthorBuild, "__call__", spy)
    spec, info = build_probe_model(ENTRY, {}, ProbeConfig(fold_rows=16))
    assert info["folded_tables"] == 2
    assert sorted(info["author_init"]) == ["pos", "query", "temperature"]
    (real,) = built
    assert real.bag.weight.is_meta and real.items.weight.is_meta  # the unfolded 40-row tables
    with torch.random.fork_rng():
        torch.manual_seed(probe_seed(ProbeConfig().seed, "author-build"))
        pos = torch.randn(authored.HIST, authored.DIM) * 0.02
    torch.testing.assert_close(spec.model.pos.data, pos)
    assert all(torch.isfinite(t).all() for t in spec.model.state_dict().values())
