"""Inductor's CUDA lowering of ``searchsorted`` over a sliced boundary tensor, against eager
and against gemc's packed-token row map (which counts instead of searching).

Why kept: gemc's packed history regions map each token slot to its row inside the graph
Inductor compiles. With ``searchsorted(offsets[1:], t, right=True)`` Inductor (torch 2.11 on
the H200) answered one row too far for every slot (pytorch/pytorch#182343), silently; the
row map now counts row ends instead. Rerun this on a new torch to see whether the upstream
bug is still there (then the counted form is still needed). GPU only.

    python3 benchmarks/inductor_searchsorted_check.py
"""

from __future__ import annotations

import sys

import torch
from gemc.backends.triton.packed_tokens import TokenLayout


def main() -> int:
    if not torch.cuda.is_available():
        print("inductor_searchsorted_check: needs a CUDA device", file=sys.stderr)
        return 2
    off = torch.tensor([0, 3, 7, 12], device="cuda")

    def searched(o: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(o[1:], torch.arange(12, device="cuda"), right=True)

    def counted(o: torch.Tensor) -> torch.Tensor:
        return TokenLayout.bounded(o, 0, 12, 12).index("row_out")

    want = searched(off).tolist()
    got_searched = torch.compile(searched)(off).tolist()
    got_counted = torch.compile(counted)(off).tolist()
    print("eager                ", want)
    print("compiled searchsorted", got_searched)
    print("compiled gemc layout ", got_counted)
    if got_counted != want:
        print("gemc's packed row map is wrong under Inductor", file=sys.stderr)
        return 1
    print("upstream bug", "present" if got_searched != want else "fixed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
