"""CPLoader(model=...): a stored plan priced for another model warns once, the same model never; online
planning plans for the model it is given; plan_dataset refuses a shape parameter conflicting with its model."""

import json
import warnings

import numpy as np
import pytest

from flashcp.costmodel.models import BUILTIN_MODELS, model_from_config
from flashcp.errors import FlashcpError
from flashcp.planner.pipeline import plan_dataset
from flashcp.runtime import CPLoader
from tests.naive_meta import assert_same_batches
from tests.plans import write_dataset

CONTEXT, CP = 256, 2


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A dataset of 4 rows planned by flashcp for qwen3-8b (``cp2-flashcp``) and by llama3 with no model
    recorded (``old``, plan.json as written before plans recorded their model)."""
    root = tmp_path_factory.mktemp("loader-model") / "data"
    rng = np.random.default_rng(7)
    rows = [np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, CONTEXT), size=3, replace=False)), CONTEXT])
            for _ in range(4)]
    write_dataset(root, [rows], CONTEXT, rng, row_group_rows=2)
    plan_dataset(root, CP, "flashcp", compare=0, model="qwen3-8b")
    plan_dataset(root, CP, "llama3", compare=0, name="old")
    meta_path = root / "plans" / "old" / "plan.json"
    meta = json.loads(meta_path.read_text())
    del meta["model"]
    meta_path.write_text(json.dumps(meta))
    return root


def _tiny_llama():
    from transformers import LlamaConfig

    return LlamaConfig(num_key_value_heads=2, num_attention_heads=4, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, vocab_size=1000)


def test_same_model_does_not_warn(planned):
    same_fields_other_name = model_from_config({**_qwen3_config(), "_name_or_path": "Qwen/Qwen3-8B"})
    assert same_fields_other_name.name != "qwen3-8b"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for model in ("qwen3-8b", BUILTIN_MODELS["qwen3-8b"], _qwen3_config(), same_fields_other_name, None):
            CPLoader(planned, "cp2-flashcp", 0, CP, model=model)


def _qwen3_config() -> dict:
    """Qwen/Qwen3-8B's config.json, the fields flashcp reads."""
    return {"model_type": "qwen3", "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "vocab_size": 151936,
            "sliding_window": None, "use_sliding_window": False}


def test_another_model_warns_once(planned):
    loader = CPLoader(planned, "cp2-flashcp", 1, CP)
    with pytest.warns(UserWarning, match="plan 'cp2-flashcp' was priced for model qwen3-8b but the model trained "
                                         r"is llama \(4 heads / 2 K/V x 16, 2 layers\)") as caught:
        loader.check_model(_tiny_llama())  # a transformers config object
        loader.check_model(_tiny_llama().to_dict())
        loader.check_model("llama-3-8b")
    assert len(caught) == 1
    with pytest.warns(UserWarning, match="priced for model qwen3-8b but the model trained is llama-3-8b") as caught:
        CPLoader(planned, "cp2-flashcp", 0, CP, model="llama-3-8b")
    assert len(caught) == 1


def test_plan_without_a_model_reads_as_the_old_shape(planned):
    with pytest.warns(UserWarning, match=r"priced for H=32, H_kv=32, D=128 \(no model recorded\) but the model "
                                         "trained is llama-3-8b"):
        CPLoader(planned, "old", 0, CP, model="llama-3-8b")
    with warnings.catch_warnings():  # the same attention shape: nothing to say
        warnings.simplefilter("error")
        CPLoader(planned, "old", 0, CP, model=_tiny_mha_config())


def _tiny_mha_config() -> dict:
    return {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 2, "vocab_size": 1000}


def test_online_planning_plans_for_the_model(planned):
    plan_dataset(planned, CP, "flashcp2", compare=0, model="qwen3-8b", name="qwen3")
    for rank in range(CP):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            online = CPLoader(planned, None, rank, CP, model="qwen3-8b", seed=2)
            stored = CPLoader(planned, "qwen3", rank, CP, model="qwen3-8b", seed=2)
        assert_same_batches(list(online), list(stored))
    assert online._online.params["num_kv_heads"] == 8 and online._online.params["layers"] == 36


def test_bad_model_is_refused(planned):
    with pytest.raises(FlashcpError, match="the loader's model cannot be read: unknown model 'gpt-9'"):
        CPLoader(planned, "cp2-flashcp", 0, CP, model="gpt-9")


def test_plan_dataset_refuses_a_shape_parameter_conflicting_with_its_model(planned):
    with pytest.raises(FlashcpError, match=r"flashcp2's num_kv_heads=32 conflicts with the model llama-3-8b "
                                           r"\(num_kv_heads 8\): drop the parameter"):
        plan_dataset(planned, CP, "flashcp2", compare=0, overrides={"num_kv_heads": 32})
    assert not (planned / "plans" / "cp2-flashcp2").exists()
