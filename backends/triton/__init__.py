"""gemc's hand-written Triton kernels for recommendation models (forward and backward).

* ``jagged_attention``: softmax or HSTU-silu attention within each sequence of a jagged batch.
* ``BatchedEmbeddingBag``: many pooled embedding tables in one launch, the optimizer update
  fused into the backward.
* ``jagged_to_padded`` / ``padded_to_jagged``: layout conversions, each the other's backward.
* ``ops``: the kernels (and the generated groups) as ``torch.library`` custom ops with fake
  and autograd implementations, registered on import; ``inductor_graph`` emits the plan's
  rewritten graph calling them, for ``torch.compile``.

Every kernel runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (see ``runtime``).
"""

from .embedding_bag import BatchedEmbeddingBag
from .jagged import (
    jagged_to_padded,
    jagged_to_padded_reference,
    padded_to_jagged,
    padded_to_jagged_reference,
)
from .jagged_attention import jagged_attention, jagged_attention_reference
from .runtime import is_interpreted

__all__ = [
    "BatchedEmbeddingBag",
    "is_interpreted",
    "jagged_attention",
    "jagged_attention_reference",
    "jagged_to_padded",
    "jagged_to_padded_reference",
    "padded_to_jagged",
    "padded_to_jagged_reference",
]
