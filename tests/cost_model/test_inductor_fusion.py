"""What Inductor fuses and saves, on a hand-annotated graph: the memory-bound chain
between two GEMMs is one fused kernel priced by the bytes entering and leaving it, and the
backward keeps the GEMM's output to recompute the chain instead of its large
intermediates."""

from __future__ import annotations

import pytest
import torch
from gemc.cost_model import op_cost
from gemc.cost_model.activations import activation_profile
from gemc.cost_model.hardware import get_gpu
from gemc.cost_model.inductor_fusion import fused_ms, fusion_groups, recompute_sources
from torch import fx

from gemc import ir
from gemc.ir import OpKind


def _chain(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    h = torch.mm(x, w1)                      # [256, 64]
    outer = h[:, :, None] * h[:, None, :]    # [256, 64, 64]: 64x larger than h
    r = torch.relu(outer)
    s = torch.sum(r, dim=-1)                 # back to [256, 64]
    return torch.mm(s, w2)


class _Record(fx.Interpreter):
    def run_node(self, n: fx.Node):  # noqa: ANN201
        out = super().run_node(n)
        n.meta["val"] = out
        return out


@pytest.fixture()
def graph() -> fx.GraphModule:
    gm = fx.symbolic_trace(_chain)
    _Record(gm).run(torch.randn(256, 64), torch.randn(64, 64), torch.randn(64, 64))
    kinds = {"mm": OpKind.GEMM, "getitem": OpKind.VIEW, "mul": OpKind.POINTWISE,
             "relu": OpKind.POINTWISE, "sum": OpKind.REDUCTION}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            n.meta[ir.KIND] = OpKind.INPUT if n.name == "x" else OpKind.PARAM
            if n.name != "x":
                n.meta[ir.PARAM] = n.name
        elif n.op == "output":
            n.meta[ir.KIND] = OpKind.OUTPUT
        else:
            name = getattr(n.target, "__name__", str(n.target))
            n.meta[ir.KIND] = kinds[name]
            n.meta[ir.PREDICTED_MS] = 1.0
            n.meta[ir.BYTES] = ir.nbytes(n) + sum(ir.nbytes(a) for a in n.all_input_nodes)
            if name == "mm":
                n.meta[ir.GEMM] = {"batch": 1, "m": 256, "n": 64, "k": 64}
    return gm


def _by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def test_the_chain_between_gemms_is_one_group(graph):
    nodes = _by_name(graph)
    groups = fusion_groups(graph)
    assert set(groups) == {nodes["mul"], nodes["relu"], nodes["sum_1"]}
    assert len(set(groups.values())) == 1


def test_a_group_costs_what_enters_and_leaves_it(graph):
    nodes = _by_name(graph)
    gpu = get_gpu("h200")

    def nbytes(n: fx.Node) -> float:
        return float(ir.nbytes(n))

    ms = fused_ms(graph, gpu, None, nbytes)
    h, s = nbytes(nodes["mm"]), nbytes(nodes["sum_1"])
    fwd, _ = op_cost.memory_time(h + s, gpu, None)       # read h once, write s
    bwd, _ = op_cost.memory_time(s + 2 * h, gpu, None)   # read ds and h, write dh
    assert sum(ms.values()) == pytest.approx(1e3 * (fwd + bwd))
    op_by_op = sum(op_cost.node_cost(nodes[k], gpu, None).total_ms
                   for k in ("mul", "relu", "sum_1"))
    assert sum(ms.values()) < 0.2 * op_by_op  # the [256, 64, 64] tensors never hit HBM


def test_the_backward_recomputes_the_chain_from_the_gemm_output(graph):
    nodes = _by_name(graph)
    assert recompute_sources(graph)[nodes["relu"]] == {nodes["mm"]}
    compiled = activation_profile(graph)
    eager = activation_profile(graph, runtime=False)
    h = ir.nbytes(nodes["mm"])
    # eager keeps relu's [256, 64, 64] output; compiled keeps h alone (the sum that the
    # second GEMM needs is recomputed from it too)
    assert eager.saved_total > 64 * h
    assert compiled.saved_total == h
    # the compiled step never allocates the fused intermediates, and its backward holds
    # the saved tensors together with the first gradients
    assert compiled.peak < eager.peak
    assert compiled.peak >= compiled.saved_total + h


def test_module_mode_on_several_ranks_runs_eager(graph):
    """No gemc kernel and several ranks: the runner does not compile (module mode stays
    eager there), so nothing is fused and every saved tensor is kept."""
    from gemc.cost_model.inductor_fusion import PRICING, runs_compiled

    assert runs_compiled(graph)
    graph.meta[PRICING] = {"world_size": 8}
    assert not runs_compiled(graph) and fusion_groups(graph) == {}
    assert activation_profile(graph).saved_total == \
        activation_profile(graph, runtime=False).saved_total
    graph.meta[PRICING] = {"world_size": 1}
    assert runs_compiled(graph)
