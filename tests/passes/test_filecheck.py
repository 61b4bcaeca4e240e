"""The FileCheck helper itself: each directive holds where it should and fails where it
should not, naming the directive."""

from __future__ import annotations

import pytest

from tests.passes.filecheck import CheckFailure, check_graph, parse

DUMP = """\
# after fuse
%x = input :: f32[4,8]
%linear = aten.linear.default(%x, %p_w, %p_b) :: f32[4,8]  {group=gemm_epilogue_0 kind=gemm}
%gelu = aten.gelu.default(%linear) :: f32[4,8]  {group=gemm_epilogue_0 kind=pointwise}
%sum = aten.sum.default(%gelu) :: f32[]  {kind=reduction}
return %sum :: f32[]
"""


@pytest.mark.parametrize("directives", [
    "CHECK: aten.linear\nCHECK: aten.gelu",
    "CHECK: aten.linear\nCHECK-NEXT: aten.gelu\nCHECK-NEXT: aten.sum",
    "CHECK: %linear = \nCHECK-SAME: group=gemm_epilogue_0\nCHECK-SAME: kind=gemm",
    "CHECK: aten.linear\nCHECK-NOT: kind=reduction\nCHECK: aten.gelu",
    "CHECK: aten.sum\nCHECK-NOT: group=",
    "CHECK-NOT: jagged\nCHECK: input",
    "CHECK-COUNT-2: group=gemm_epilogue_0\nCHECK-NOT: group=gemm_epilogue_0",
    "CHECK: %{{linear|gelu}} = aten.{{\\w+}}.default(%x",
    "CHECK: group=gemm_epilogue_0\nCHECK-NOT: kind=pointwise\nCHECK-SAME: kind=gemm",
])
def test_directives_that_hold_pass(directives: str):
    check_graph(DUMP, directives)


@pytest.mark.parametrize("directives,why", [
    ("CHECK: aten.gelu\nCHECK: aten.linear", "not found after the last match"),  # order
    ("CHECK: aten.linear\nCHECK-NEXT: aten.sum", "not on the next line"),
    ("CHECK: %gelu\nCHECK-SAME: kind=gemm", "not found on the last matched line"),
    ("CHECK: aten.linear\nCHECK-NOT: aten.gelu\nCHECK: aten.sum", "matched"),
    ("CHECK: aten.linear\nCHECK-NOT: kind=reduction", "matched"),  # to the end
    ("CHECK-NOT: %x = input\nCHECK: aten.linear", "matched"),  # from the start
    ("CHECK-COUNT-3: group=gemm_epilogue_0", "not found after the last match"),
    ("CHECK-COUNT-1: group=gemm_epilogue_0\nCHECK-NOT: group=gemm_epilogue_0", "matched"),
    ("CHECK: %{{lin.*}} = aten.gelu", "not found"),  # a regex part matches only itself
    ("CHECK: aten.linear.default(%x, %p_w, %p_b) :: f32[4,9]", "not found"),  # literal [
    # a NOT before a SAME covers only the stretch between the two matches
    ("CHECK: %linear\nCHECK-NOT: group=\nCHECK-SAME: kind=gemm", "matched"),
])
def test_directives_that_do_not_hold_fail_naming_themselves(directives: str, why: str):
    with pytest.raises(CheckFailure, match=why) as info:
        check_graph(DUMP, directives)
    last = directives.splitlines()[-1]
    assert "directive line" in str(info.value) and "| " in str(info.value), str(info.value)
    assert any(d in str(info.value) for d in (last, *directives.splitlines())), str(info.value)


@pytest.mark.parametrize("directives", ["", "CHECK aten.linear", "CHEK: aten.linear",
                                        "CHECK:", "CHECK-COUNT-0: x"])
def test_malformed_directives_are_errors_not_silent_passes(directives: str):
    with pytest.raises(ValueError):
        parse(directives)


def test_a_graph_is_dumped_before_checking():
    import torch

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x).sum()

    gm = torch.export.export(M(), (torch.randn(2, 3),), strict=False).graph_module
    check_graph(gm, "CHECK: aten.relu.default(%x) :: f32[2,3]\nCHECK-NEXT: aten.sum")
