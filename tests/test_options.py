"""The typed policy options (kvoffload.policies.options): strict parsing, ranges, unknown and repeated options,
a flag and an option setting the same thing, and a fuzz test of the parser over random strings and values."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.cli import main
from kvoffload.engine import generate
from kvoffload.errors import KVOffloadError
from kvoffload.models import tiny_random_model
from kvoffload.policies import available_policies, make_policy
from kvoffload.policies.base import check_options, policy_schema
from kvoffload.policies.options import PolicyOptionError


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model("llama", seed=3)


def one_line_error(capsys, argv, *needles):
    rc = main([str(a) for a in argv])
    _, err = capsys.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.mark.parametrize("word,want", [("no", False), ("NO", False), ("false", False), ("0", False), ("off", None),
                                       ("yes", True), ("True", True), ("1", True), ("maybe", None)])
def test_booleans_are_parsed_strictly(word, want):
    if want is None:
        with pytest.raises(PolicyOptionError, match="offload_weights must be true or false"):
            make_policy("offload", offload_weights=word)
    else:
        assert make_policy("offload", offload_weights=word).options.offload_weights is want


@pytest.mark.parametrize("opts,needle", [
    (dict(block_tokens=64.5), "block_tokens must be an integer >= 1, got 64.5"),
    (dict(block_tokens="64.5"), "block_tokens must be an integer"),
    (dict(block_tokens="abc"), "block_tokens must be an integer >= 1, got 'abc'"),
    (dict(gpu_memory_limit_gb="nan"), "gpu_memory_limit_gb must be a finite number > 0, got 'nan'"),
    (dict(gpu_memory_limit_gb=float("inf")), "gpu_memory_limit_gb must be a finite number"),
    (dict(schedule="diagonal"), "schedule must be one of row, column, got 'diagonal'"),
    (dict(gpu_batches=0), "gpu_batches must be an integer >= 1, got 0"),
    (dict(gpu_batches=True), "gpu_batches must be an integer"),
])
def test_numbers_and_choices_are_checked(opts, needle):
    with pytest.raises(PolicyOptionError, match="policy 'offload' option") as e:
        make_policy("offload", **opts)
    assert needle in str(e.value) and e.value.option == next(iter(opts))


def test_integral_values_and_none_are_taken():
    pol = make_policy("offload", block_tokens="32", gpu_batches=2.0, extent_mb="none")
    assert pol.options.block_tokens == 32 and pol.options.gpu_batches == 2 and isinstance(pol.options.gpu_batches, int)
    assert make_policy("clo", persistent_heads="none").pipeline.hooks.persistent_heads == "none"  # a choice, not unset


def test_unknown_options_are_refused_for_policy_objects_too(tiny):
    with pytest.raises(PolicyOptionError, match="got unknown option nonsense"):
        generate(tiny, [[1, 2, 3]], 2, policy=make_policy("offload"), policy_options={"nonsense": 1})
    with pytest.raises(PolicyOptionError, match="would be ignored"):  # a known option beside a built policy
        generate(tiny, [[1, 2, 3]], 2, policy=make_policy("offload"), policy_options={"block_tokens": 32})


def test_a_repeated_option_is_refused():
    with pytest.raises(PolicyOptionError, match="split_point is given twice"):
        check_options("kvpr", [("split_point", "1"), ("split_point", "2")])


@pytest.mark.parametrize("argv,needles", [
    (["--policy", "kvpr", "--split-point", "3", "--policy-option", "split_point=5"],
     ["--split-point and --policy-option split_point both set split_point"]),
    (["--policy", "offload", "--schedule", "row", "--policy-option", "schedule=column"],
     ["--schedule and --policy-option schedule both set schedule"]),
    (["--policy", "kvpr", "--policy-option", "split_point=1", "--policy-option", "split_point=2"],
     ["--policy-option split_point is given twice"]),
    (["--policy", "offload", "--policy-option", "block_tokens=64.5"], ["block_tokens must be an integer"]),
    (["--policy", "offload", "--policy-option", "offload_weights=perhaps"], ["offload_weights must be true or false"]),
    (["--policy", "offload", "--policy-option", "gpu_memory_limit_gb=nan"], ["gpu_memory_limit_gb", "'nan'"]),
])
def test_cli_option_errors_are_one_line_naming_the_option(capsys, monkeypatch, argv, needles):
    import kvoffload.models as models

    def no_model(*a, **k):  # every one of these must be refused before the model loads
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", no_model)
    one_line_error(capsys, ["generate", "hi", *argv], *needles)


def test_cli_offload_weights_no_is_false():
    from kvoffload.cli import _policy_options, build_parser

    args = build_parser().parse_args(["generate", "hi", "--policy-option", "offload_weights=no", "--split-point", "0"])
    pairs, spelled = _policy_options(args)
    assert check_options("offload", pairs, spelled) == {"offload_weights": False, "split_point": 0}


def test_eval_spec_options_are_typed(capsys, tmp_path):
    from kvoffload.eval.parse import parse_policies

    spec = parse_policies("offload:offload_weights=no,block_tokens=32")[0]
    assert spec.options_dict == {"offload_weights": False, "block_tokens": 32}
    with pytest.raises(PolicyOptionError, match="split_point is given twice"):
        parse_policies("kvpr:split_point=1,split_point=2")
    one_line_error(capsys, ["eval", "ppl", "--model", "tiny", "--policy", "offload:block_tokens=abc", "--out", tmp_path,
                            "--quiet"], "block_tokens must be an integer")


def test_every_policy_has_a_schema_with_help_and_defaults():
    for name in available_policies():
        schema = policy_schema(name)
        assert schema, name
        for opt in schema.values():
            assert opt.help and opt.range_text(), (name, opt.name)
            if opt.default is not None and opt.kind not in ("object", "any"):
                assert opt.parse(opt.default, name) == opt.default, (name, opt.name)  # defaults are legal values
    assert policy_schema("hybrid")["offload_weights"].default is True  # hybrid's own default
    assert policy_schema("offload")["offload_weights"].default is False


# ------------------------------------------------------------------ fuzz: never another exception

_ALL = [(name, opt) for name in available_policies() for opt in policy_schema(name).values()]
_values = st.one_of(st.text(max_size=12), st.integers(-10**20, 10**20), st.floats(allow_nan=True, allow_infinity=True),
                    st.booleans(), st.none(), st.lists(st.integers(-3, 3), max_size=3),
                    st.lists(st.lists(st.integers(-2, 40), min_size=1, max_size=3), max_size=2),
                    st.sampled_from(["true", "No", " 12 ", "1e3", "-0", "auto", "none", "[0.5, 2]", "[[0, 1]]", "nan"]))
_KIND_TYPES = {"bool": (bool,), "int": (int, str), "float": (float, str), "choice": (str,), "path": (str,),
               "floats": (float, list, str), "pairs": (str, list), "object": (object,), "any": (object,)}


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_ALL), _values)
def test_option_parser_fuzz(policy_and_option, value):
    policy, opt = policy_and_option
    try:
        got = opt.parse(value, policy)
    except KVOffloadError as e:
        assert isinstance(e, PolicyOptionError) and e.option == opt.name and opt.name in str(e)
        assert "\n" not in str(e)
        return
    if got is None:
        return  # unset: the default
    assert isinstance(got, _KIND_TYPES[opt.kind]), (opt.name, value, got)
    if isinstance(got, str) and opt.kind in ("int", "float", "floats"):
        assert got in opt.words, (opt.name, got)  # the only strings a number option keeps are its words
    if opt.kind == "int":
        assert not isinstance(got, bool)
    if opt.kind in ("float", "int") and not isinstance(got, str):
        assert math.isfinite(got) and opt._in_range(got)
    if opt.kind == "choice":
        assert got in opt.choices
    again = opt.parse(got, policy)  # idempotent: the CLI's parse and the policy's agree (an object passes as itself)
    assert again is got or again == got, (opt.name, got, again)


def test_user_errors_doc_is_generated_from_the_schema_and_up_to_date():
    from kvoffload.errors import KVOffloadError
    from kvoffload.user_errors_doc import DOC, error_classes, render

    text = render()
    with open(DOC, encoding="utf-8") as f:
        assert f.read() == text, "docs/USER_ERRORS.md is out of date: run python -m kvoffload.user_errors_doc"
    for name in available_policies():  # every option of every policy has its row
        for opt in policy_schema(name).values():
            assert f"| `{opt.name}` |" in text, (name, opt.name)
    classes = error_classes()
    assert PolicyOptionError in classes and all(issubclass(c, KVOffloadError) for c in classes)
    assert all(f"`{c.__name__}`" in text for c in classes)
