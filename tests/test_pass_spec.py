"""The pipeline from a pass-spec string (``--passes``): options reach the passes as their
dataclass fields, and every malformed spec is one named error before any capture."""

import pytest

from gemc.config import CompileConfig
from gemc.errors import GemcUserError
from gemc.pipeline import default_pipeline, pipeline_from_spec

BASE = "classify-ops,collect-tables,count-flops-bytes,assign-regions"


def test_a_spec_selects_passes_and_sets_their_fields():
    passes = pipeline_from_spec(
        f"{BASE},predict-time{{eager=true}},fuse{{max_outputs=2,kinds=norm|pointwise}},"
        "place-default")
    # emit-plan, the plan's emission, is appended where the spec leaves it out
    assert [p.name for p in passes] == [*BASE.split(","), "predict-time", "fuse",
                                        "place-default", "emit-plan"]
    fuse = passes[-3]
    assert fuse.max_outputs == 2 and fuse.kinds == ("norm", "pointwise")
    assert passes[4].eager is True


def test_the_full_spec_is_the_default_pipeline():
    names = ",".join(p.name for p in default_pipeline("greedy"))
    assert pipeline_from_spec(names, "greedy") == default_pipeline("greedy")


@pytest.mark.parametrize("spec, says", [
    (f"{BASE},fusion,place-default", "unknown pass 'fusion'"),
    (f"{BASE},fuse{{max_outputs=two}},place-default", "is not a int"),
    (f"{BASE},fuse{{width=2}},place-default", "has no option 'width'"),
    (f"{BASE},fuse{{max_outputs}},place-default", "is not key=value"),
    (f"{BASE},fuse{{max_outputs=2,place-default", "unclosed"),
    (f"{BASE},fuse,predict-time,place-default", "comes after 'fuse'"),
    ("classify-ops,fuse,place-default", "leaves out collect-tables"),
    (f"{BASE},fuse", "leaves out place-default"),
    (f"{BASE},,place-default", "empty pass name"),
    (f"{BASE},choose-precision{{options=x}},place-default", "cannot be set"),
])
def test_a_bad_spec_is_named_with_its_fix(spec, says):
    with pytest.raises(GemcUserError) as err:
        CompileConfig(passes=spec).validate()
    assert says in str(err.value) and "--passes" in str(err.value)


def test_compile_runs_the_spec(tmp_path):
    from gemc.api import compile
    from tests.conftest import TOY

    spec = f"{BASE},predict-time,fuse{{kinds=norm}},place-default"
    plan = compile(f"{TOY}:build", topology="h200:1x2", passes=spec)
    kinds = {k["kind"] for k in plan["kernels"]}
    assert kinds <= {"norm"}
    full = compile(f"{TOY}:build", topology="h200:1x2")
    assert {k["kind"] for k in full["kernels"]} - {"norm"}  # the default fuses more kinds
