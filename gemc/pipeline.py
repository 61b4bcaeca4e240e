"""The default pass pipeline, in order (see ARCHITECTURE.md's typical order)."""

from __future__ import annotations

from gemc.pass_manager import Pass
from gemc.passes.assign_regions import AssignRegions
from gemc.passes.classify_ops import ClassifyOps
from gemc.passes.collect_tables import CollectTables
from gemc.passes.count_flops_bytes import CountFlopsBytes
from gemc.passes.fold_transposed_linear import FoldTransposedLinear
from gemc.passes.fuse import Fuse
from gemc.passes.group_embeddings import GroupEmbeddings
from gemc.passes.match_jagged_attention import MatchJaggedAttention
from gemc.passes.match_silu_attention import MatchSiluAttention
from gemc.passes.match_softmax_attention import MatchSoftmaxAttention
from gemc.passes.pack_jagged_tokens import PackJaggedTokens
from gemc.passes.parallelize import Parallelize
from gemc.passes.place_default import PlaceDefault
from gemc.passes.precision import ChoosePrecision, PrecisionOptions
from gemc.passes.predict_time import PredictTime


def annotation_passes() -> list[Pass]:
    """The passes that turn a captured graph into an annotated one (no decisions yet)."""
    return [ClassifyOps(), CollectTables(), CountFlopsBytes(), AssignRegions()]


def placement_pass(planner: str) -> Pass:
    """``default``: the place-default placeholder; ``cpsat`` / ``greedy`` / ``naive``: the
    parallelize pass with that planner."""
    return PlaceDefault() if planner == "default" else Parallelize(planner)


def default_pipeline(planner: str = "default",
                     precision: PrecisionOptions | None = None) -> list[Pass]:
    """Every pass of a compile; ``precision``: choose-precision's options (None: defaults)."""
    return [*annotation_passes(), PredictTime(), *kernel_passes(), ChoosePrecision(precision),
            placement_pass(planner)]


def kernel_passes() -> list[Pass]:
    """Kernel selection, after predict-time (they price groups with its per-node times):
    recommendation kernels first, so generic fusion does not take their nodes; the packed
    token region last (it spans the groups and attentions that run inside it)."""
    return [MatchJaggedAttention(), MatchSoftmaxAttention(), MatchSiluAttention(),
            GroupEmbeddings(), FoldTransposedLinear(), Fuse(),
            PackJaggedTokens()]
