"""The fault suite, file formats and registrations: plan.json fields, newer plan formats, hardware profiles,
strategies registered from outside flashcp.

Each case: exit 1 (or ValueError for the library call), one sentence naming the thing, no traceback, and the
whole tree byte-identical.
"""

from __future__ import annotations

import json

import pytest

from tests.faults.workspace import docs, pack_args, run, unchanged, workspace, write_jsonl


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A packed dataset (byte tokenizer, 64-token sequences, 3 data files) with one plan."""
    base = tmp_path_factory.mktemp("formats")
    src = write_jsonl(base / "in.jsonl", docs(40))
    assert run(*pack_args(src, base / "data")).exit_code == 0
    assert run("plan", base / "data", "--cp", 2, "--strategy", "flashcp", "--compare", 0).exit_code == 0
    return base


@pytest.fixture
def ws(template, tmp_path):
    return workspace(template, tmp_path, {"victim/precious.txt": "do not touch"})


# ---- case 13: plan.json fields of the wrong type, and newer plan formats ----

@pytest.mark.parametrize("field,value,needle", [
    ("params", [1, 2], "params is [1, 2], not an object"),
    ("params", None, "params is null, not an object"),
    ("summary", "x", "summary is \"x\", not an object"),
    ("strategy", 5, "strategy is 5, not a string"),
    ("cp", "2", "cp is \"2\", not a whole number"),
    ("cp", True, "cp is true, not a whole number"),
    ("format_version", "1", "format_version is \"1\", not a whole number"),
    ("format_version", 0, "format_version is 0, not a plan format version"),
    ("data_files", [["a", "b"]], "an entry of data_files is not an object"),
    ("params", {"token_slack": "a lot"}, "params.token_slack is a lot"),
])
def test_a_plan_json_field_of_the_wrong_type(ws, field, value, needle):
    path = ws / "data" / "plans" / "cp2-flashcp" / "plan.json"
    meta = json.loads(path.read_text())
    meta[field] = value
    path.write_text(json.dumps(meta))
    for command in (["show", ws / "data", "--plan", "cp2-flashcp"], ["verify", ws / "data"]):
        unchanged(ws, command, "plan.json is damaged", needle)


def test_a_newer_plan_format_is_refused_by_name(ws):
    path = ws / "data" / "plans" / "cp2-flashcp" / "plan.json"
    meta = json.loads(path.read_text())
    meta["format_version"] = 2
    path.write_text(json.dumps(meta))
    for command in (["show", ws / "data", "--plan", "cp2-flashcp"], ["verify", ws / "data"]):
        unchanged(ws, command, "plan format version 2, written by a newer flashcp", "reads version 1",
                  "upgrade flashcp")


# ---- cases 14 and 7: hardware profiles whose attention curve no kernel can price ----

@pytest.mark.parametrize("key,values,needle", [
    ("lengths", [512, 1e30], "lengths must be increasing whole numbers in [1, 16777216]"),
    ("lengths", [512, 1e300, 1e301], "lengths must be increasing whole numbers"),
    ("forward", "NaN", "forward must be finite numbers, got [nan, nan"),
    ("backward", "Infinity", "backward must be finite numbers, got [inf, inf"),
    ("forward", [-1, 2], "forward values must be positive finite TFLOP/s"),
    ("lengths", [512.5, 1024], "lengths must be whole numbers"),
])
def test_a_profile_curve_no_kernel_can_price(ws, key, values, needle):
    from flashcp.costmodel.profile import load_profile

    profile = load_profile().to_json()
    curve = profile["attention_tflops"]
    if isinstance(values, str):  # every point NaN or Infinity, as JSON writers spell them
        values = [float(values.lower().replace("infinity", "inf"))] * len(curve[key])
    else:
        for name in ("lengths", "forward", "backward"):
            curve[name] = curve[name][:len(values)]
    curve[key] = values
    path = ws / "victim" / "profile.json"
    path.write_text(json.dumps(profile))
    unchanged(ws, ["plan", ws / "data", "--cp", 2, "--profile", path, "--name", "p"], f"hardware profile {path}",
              needle)


# ---- case 17: register() refuses what could never plan ----

def _plain_function(lens, cp):
    return lens, lens, lens, lens


@pytest.mark.parametrize("case,needle", [
    ("plain function", "needs a Numba kernel (decorated with flashcp._numba.njit), got function '_plain_function'"),
    ("untypable kernel", "numba cannot compile its kernel as the planner calls it, kernel(lens: array(int64, "
                         "1d, C), cp: int64) (TypeError: Signature mismatch: 2 argument types given"),
    ("wrong parameters", "kernel(lens: array(int64, 1d, C), cp: int64, chunk: int64) (TypeError"),
    ("wrong result", "returns array(int64, 1d, C), not the four (doc, start, len, rank)"),
    ("failing kernel", "its kernel fails on a sequence of two documents"),
    ("empty name", "a strategy name must be letters, digits and . _ + -"),
    ("path name", "got 'a/b'"),
])
def test_register_refuses_what_could_never_plan(case, needle):
    from flashcp._numba import njit
    from flashcp.planner.registry import STRATEGIES, Strategy, register

    @njit(cache=False)
    def one_argument(lens):  # the planner calls kernel(lens, cp)
        return lens

    @njit(cache=False)
    def two_arguments(lens, cp):
        return lens, lens, lens, lens

    @njit(cache=False)
    def one_result(lens, cp):
        return lens

    @njit(cache=False)
    def fails(lens, cp):
        if lens[0] > 0:
            raise ValueError("no plan")
        return lens, lens, lens, lens

    kernel, name, params = {"plain function": (_plain_function, "mine", ()),
                            "untypable kernel": (one_argument, "mine", ()),
                            "wrong parameters": (two_arguments, "mine", ("chunk",)),
                            "failing kernel": (fails, "mine", ()),
                            "wrong result": (one_result, "mine", ()),
                            "empty name": (two_arguments, "", ()),
                            "path name": (two_arguments, "a/b", ())}[case]
    before = dict(STRATEGIES)
    with pytest.raises(ValueError) as refused:
        register(Strategy(name=name, defaults={"chunk_size": 8} if params else {}, kernel=kernel,
                          kernel_params=params, description="mine"))
    message = str(refused.value)
    assert needle in message and "\n" not in message, message
    assert STRATEGIES == before
