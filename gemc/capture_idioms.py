"""PyTorch idioms that torch.export cannot trace as written, and what capture does about them.

Two kinds, both found by writing sequence recommenders in their authors' styles:

* **A hint read from a tensor's values.** ``nn.TransformerEncoder`` (and ``nn.Transformer``'s
  decoder) given ``mask=`` without ``is_causal=`` compares the mask with a freshly built
  causal mask (``bool((mask == causal).all())``) to decide whether it may call the causal
  kernel: SASRec's ``encoder(x, mask=generate_square_subsequent_mask(L),
  src_key_padding_mask=pad)``. On fake tensors that is a data-dependent branch and the
  export fails. PyTorch documents the hint as a speed choice only (``is_causal=False``
  for a causal mask "may lead to reduced performance"; the mask is applied as given), so
  :func:`undetermined_causal_hint` answers False while tracing: the graph applies the
  mask the model passes, the numbers eager PyTorch computes.
* **An API with no traceable form.** ``pack_padded_sequence`` (its ``batch_sizes`` are a
  host tensor computed from the lengths' values) and ``torch.nested`` jagged tensors
  (a symbolic ragged dimension non-strict export cannot trace) fail inside torch with a
  message about torch's internals. :func:`untraceable_call` finds which of them the
  user's code called when the export failed, so the capture error names it and the
  rewrite gemc can take.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from types import CodeType

import torch

_PACKED_FIX = (
    "run the RNN on the padded tensor and read each row's state at its last real "
    "position: out, _ = self.gru(x); h = out.gather(1, (lengths - 1).view(-1, 1, 1)"
    ".expand(-1, 1, out.size(-1))).squeeze(1) (for a unidirectional RNN over right-padded "
    "rows this is the h_n packing gives: padding comes after a row's last state)"
)
NESTED_FIX = (
    "keep the jagged data as its two dense tensors, values and offsets, and write the "
    "jagged ops on them: nn.EmbeddingBag(values, offsets) to pool, or pad with index_put "
    "at positions from torch.repeat_interleave(..., output_size=N) as "
    "examples/zoo/hstu.py's jagged_to_padded_dense does"
)


def _untraceable() -> dict[CodeType, tuple[str, str]]:
    """The code object of each untraceable API -> (its public name, the fix)."""
    found: dict[CodeType, tuple[str, str]] = {}
    apis: list[tuple[str, Callable[..., object] | None, str]] = [
        ("torch.nn.utils.rnn.pack_padded_sequence",
         getattr(torch.nn.utils.rnn, "pack_padded_sequence", None), _PACKED_FIX),
        ("torch.nn.utils.rnn.pack_sequence",
         getattr(torch.nn.utils.rnn, "pack_sequence", None), _PACKED_FIX),
    ]
    for name in ("nested_tensor_from_jagged", "nested_tensor", "as_nested_tensor", "narrow"):
        apis.append((f"torch.nested.{name}", getattr(torch.nested, name, None), NESTED_FIX))
    for name, fn, fix in apis:
        code = getattr(fn, "__code__", None)
        if isinstance(code, CodeType):
            found[code] = (name, fix)
    return found


def untraceable_call(exc: BaseException) -> tuple[str, str, str] | None:
    """``(api, call site, fix)`` when ``exc`` was raised inside one of the APIs above (the
    outermost such frame: the call the user's code made), else None."""
    known = _untraceable()
    cur: BaseException | None = exc
    seen: set[int] = set()
    while cur is not None and id(cur) not in seen:  # the export may re-raise a cause
        seen.add(id(cur))
        frames = list(traceback.walk_tb(cur.__traceback__))
        for i, (frame, _) in enumerate(frames):
            if frame.f_code in known:
                name, fix = known[frame.f_code]
                caller = frames[i - 1] if i else None
                site = (f"{caller[0].f_code.co_filename}:{caller[1]}" if caller
                        else frame.f_code.co_filename)
                return name, site, fix
        cur = cur.__cause__ or cur.__context__
    return None


@contextlib.contextmanager
def undetermined_causal_hint() -> Iterator[None]:
    """While tracing, ``nn.Transformer*``'s ``is_causal`` hint is False unless the model
    states it: the mask given is applied as is (see the module docstring). Nothing is
    changed where this torch has no such detection (the export then fails as before)."""
    from torch.nn.modules import transformer

    detect = getattr(transformer, "_detect_is_causal_mask", None)
    if detect is None:
        yield
        return

    def stated_or_false(mask: torch.Tensor | None, is_causal: bool | None = None,
                        size: int | None = None) -> bool:
        return bool(is_causal)

    transformer._detect_is_causal_mask = stated_or_false
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = detect
