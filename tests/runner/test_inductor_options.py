"""The Inductor options gemc compiles its graph with (graph_mode.inductor_options): the
pointwise kernels' first-launch autotuning off by default, on when asked, and a
torch.compile mode's own options kept (torch.compile takes a mode or options, not both)."""

from __future__ import annotations

import torch
from gemc.backends.torch import graph_mode as G


def test_pointwise_autotune_off_by_default_and_mode_options_kept() -> None:
    assert G.inductor_options(None, False) == {G.POINTWISE_AUTOTUNE: False}
    assert G.inductor_options(None, True) is None  # Inductor's defaults
    cudagraphs = G.inductor_options("reduce-overhead", False)
    assert cudagraphs is not None and cudagraphs[G.POINTWISE_AUTOTUNE] is False
    assert cudagraphs.get("triton.cudagraphs") is True
    assert G.inductor_options("reduce-overhead", True) == {"triton.cudagraphs": True}
    # every key is one of Inductor's config names (a misspelt key would be ignored silently)
    for key in cudagraphs:
        section, _, name = key.rpartition(".")
        owner = getattr(torch._inductor.config, section) if section else torch._inductor.config
        assert hasattr(owner, name), key


def test_the_warming_backend_hands_the_options_to_inductor() -> None:
    backend = G._WarmingBackend("inductor", None, executor=None,  # type: ignore[arg-type]
                                options=G.inductor_options(None, False))
    assert backend.inner.config[G.POINTWISE_AUTOTUNE] is False
    with_mode = G._WarmingBackend("inductor", "reduce-overhead", executor=None,  # type: ignore[arg-type]
                                  options=G.inductor_options("reduce-overhead", False))
    assert with_mode.inner.config["triton.cudagraphs"] is True
    plain = G._WarmingBackend("inductor", None, executor=None)  # type: ignore[arg-type]
    assert G.POINTWISE_AUTOTUNE not in plain.inner.config


def test_cli_flag_reaches_the_run_options_and_the_relaunch() -> None:
    import argparse

    from gemc.backends.torch import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["plan.json", "--pointwise-autotune"])
    assert cli.options_from_args(args).pointwise_autotune is True
    assert "--pointwise-autotune" in cli.argv_of(args)
    args = parser.parse_args(["plan.json"])
    assert cli.options_from_args(args).pointwise_autotune is False
    assert "--pointwise-autotune" not in cli.argv_of(args)
