"""Training pieces in one process (no process group): the loop on a cp-1 plan, checkpoints, refusals."""

import importlib.util
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from flashcp.errors import FlashcpError
from flashcp.models.tiny import TinyConfig, TinyDecoder
from flashcp.train.loop import agree_on_errors, run_training
from tests.equivalence import global_batch_training, tiny_forward_loss
from tests.train import CONTEXT, SHAPE, VOCAB, options

REPO = Path(__file__).resolve().parents[2]


def test_single_process_run_equals_reference(planned):
    root, sequences = planned
    logs = run_training(options(root))
    torch.manual_seed(5)
    model = TinyDecoder(TinyConfig(**SHAPE, ffn_dim=32)).double()
    ref = global_batch_training(model, tiny_forward_loss, [[s] for s in sequences], vocab_size=VOCAB, lr=1e-2,
                                weight_decay=0.0).losses
    assert [s.step for s in logs] == [1, 2, 3]
    assert max(abs(s.loss - r) for s, r in zip(logs, ref)) < 1e-12
    assert all(s.num_tokens == CONTEXT and s.kv_bytes_total == 0 and s.grad_bytes > 0 for s in logs)


def test_progress_and_model_come_from_the_caller(planned):
    """``run_training`` advances the caller's progress once per step run, and builds with the caller's builder
    (the default builds ``tiny`` only; ``flashcp.integrations.models.build_model`` knows every name)."""
    from flashcp.integrations.models import MODELS, build_model
    from flashcp.train.loop import TrainModel, build_tiny_model

    root, _ = planned
    calls = []

    @contextmanager
    def progress(description, total):
        calls.append(("open", description, total))
        yield lambda: calls.append("advance")
        calls.append("close")

    built = []

    def builder(options, device, context_len):
        built.append((options.model, device, context_len))
        return build_tiny_model(options, device, context_len)

    logs = run_training(options(root, steps=2), progress=progress, build_model=builder)
    assert calls == [("open", "training", 2), "advance", "advance", "close"]
    assert built == [("tiny", torch.device("cpu"), CONTEXT)]
    assert [s.loss for s in logs] == [s.loss for s in run_training(options(root, steps=2), build_model=build_model)]
    assert "llama" in MODELS and isinstance(build_tiny_model(options(root), torch.device("cpu")), TrainModel)
    with pytest.raises(FlashcpError, match=r"^model 'llama' needs its builder: pass build_model=flashcp"):
        run_training(options(root, model="llama"))
    with pytest.raises(FlashcpError, match=r"^unknown model 'gpt5' \(choose from tiny, llama, qwen2, "):
        run_training(options(root, model="gpt5"), build_model=build_model)


def test_option_and_setup_refusals(planned):
    root, _ = planned
    with pytest.raises(ValueError, match="--resume needs --ckpt"):
        options(root, resume=True)
    with pytest.raises(ValueError, match="unknown dtype"):
        options(root, dtype="float16")
    with pytest.raises(FlashcpError, match="plan 'cp2-llama3-like' was made for cp 2 but world_size is 1"):
        run_training(options(root, plan="cp2-llama3-like"))
    with pytest.raises(FlashcpError, match="--dp 2 with --sharding replicate needs a process group; launch with"):
        run_training(options(root, dp=2))
    with pytest.raises(ValueError, match="unknown sharding 'zero3'"):
        options(root, sharding="zero3")
    with pytest.raises(FlashcpError, match="boom"):
        agree_on_errors(FlashcpError("boom"))
    agree_on_errors(None)


def test_script_prints_one_sentence_and_exits_1(planned, capsys):
    root, _ = planned
    spec = importlib.util.spec_from_file_location("train_tiny", REPO / "examples" / "train_tiny.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(root), "--plan", "cp2-llama3-like", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("error: plan 'cp2-llama3-like' was made for cp 2 but world_size is 1; launch 2 "
                           "ranks or run 'flashcp plan --cp 1'")
    assert script.main([str(root), "--plan", "cp1-llama3-like", "--steps", "2", "--dim", "16", "--heads", "2",
                        "--kv-heads", "1", "--vocab", "16"]) == 0
    err = capsys.readouterr().err
    assert "step 2/2  loss" in err and "tok/s" in err
    assert script.main([str(root), "--plan", "cp1-llama3-like", "--dp", "2", "--sharding", "fsdp",
                        "--prefetch", "0"]) == 1
    assert capsys.readouterr().err.strip() == ("error: --dp 2 with --sharding fsdp needs a process group; "
                                                "launch with torchrun")




def test_a_plan_for_another_model_warns_once(planned):
    """The loop hands the loader its model (``TrainModel.spec``): a plan priced for another model warns once."""
    import warnings

    from flashcp.planner.pipeline import plan_dataset
    from flashcp.train.loop import build_tiny_model

    root, _ = planned
    spec = build_tiny_model(options(root), torch.device("cpu")).spec
    assert (spec.name, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.num_layers) == ("tiny", 2, 1, 8, 1)
    plan_dataset(root, 1, "llama3", compare=0, name="llama")
    plan_dataset(root, 1, "llama3", compare=0, name="own", model=spec)
    with pytest.warns(UserWarning, match="plan 'llama' was priced for model llama-3-8b but the model trained is "
                                         r"tiny \(2 heads / 1 K/V x 8, 1 layer\)") as caught:
        run_training(options(root, plan="llama", steps=2))
    assert len([w for w in caught if "priced for" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_training(options(root, plan="own", steps=1))
