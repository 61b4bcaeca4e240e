import pytest

from gemc.api import load_model
from gemc.entrypoint_args import parse_sets
from gemc.errors import EntrypointError, GemcUserError
from gemc.spec import ModelSpec


def test_parse_sets_json_scalars_else_strings():
    got = parse_sets(
        ["preset=tiny", "batch_size=64", "lr=1e-3", "flag=true", "x=null", 'q="7"', "l=[1,2]"]
    )
    assert got == {
        "preset": "tiny",
        "batch_size": 64,
        "lr": 1e-3,
        "flag": True,
        "x": None,
        "q": "7",
        "l": "[1,2]",
    }


@pytest.mark.parametrize("bad", ["preset", "=tiny", "two words=1", "a=1 a=2"])
def test_parse_sets_rejects_bad_items(bad):
    with pytest.raises(GemcUserError, match="--set"):
        parse_sets(bad.split(" ") if bad.startswith("a=") else [bad])


def test_loads_file_entrypoint_on_meta(toy_entrypoint):
    spec = load_model(toy_entrypoint, {"hidden": 8})
    assert isinstance(spec, ModelSpec)
    assert all(p.device.type == "meta" for p in spec.model.parameters())


def test_loads_module_entrypoint():
    spec = load_model("tests.models.toy:build")
    assert isinstance(spec, ModelSpec)


@pytest.mark.parametrize(
    ("entrypoint", "message"),
    [
        ("tests/models/toy.py", "no ':FUNC' part"),
        ("tests/models/missing.py:build", "does not exist"),
        ("tests/models/toy.py:nope", "has no function 'nope'"),
        ("tests/models/toy.py:not_a_function", "not a function"),
        ("no_such_package.mod:build", "no module named"),
        ("tests/models/toy.py:build_wrong_type", "returned dict, not a gemc.ModelSpec"),
        ("tests/models/toy.py:build_raises", "the model author's bug"),
    ],
)
def test_entrypoint_errors_name_the_thing(entrypoint, message):
    with pytest.raises(EntrypointError) as info:
        load_model(entrypoint)
    assert message in str(info.value)
    assert info.value.fix


def test_unknown_keyword_lists_accepted_parameters(toy_entrypoint):
    with pytest.raises(EntrypointError, match="use its parameters: hidden"):
        load_model(toy_entrypoint, {"hiden": 3})


def test_syntax_error_in_model_file_names_the_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def build(:\n    pass\n")
    with pytest.raises(EntrypointError) as info:
        load_model(f"{bad}:build")
    assert "SyntaxError" in str(info.value)
    assert f"{bad}:1" in str(info.value)
