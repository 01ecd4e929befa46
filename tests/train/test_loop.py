"""Training pieces in one process (no process group): the loop on a cp-1 plan, checkpoints, refusals."""

import importlib.util
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from flashcp.errors import FlashcpError
from flashcp.models.tiny import TinyConfig, TinyDecoder
from flashcp.runtime import CPLoader
from flashcp.train import all_reduce_gradients, fold_vocab, load_checkpoint, save_checkpoint
from flashcp.train.loop import TrainOptions, agree_on_errors, run_training
from tests.naive import naive_document_attention, naive_training
from tests.plans import llama3_like_plan, write_dataset, write_plan

REPO = Path(__file__).resolve().parents[2]
CONTEXT, VOCAB = 40, 16
SHAPE = dict(vocab_size=VOCAB, dim=16, num_layers=1, num_heads=2, num_kv_heads=1)


@pytest.fixture
def planned(tmp_path):
    rng = np.random.default_rng(4)
    rows = [np.array([7, 1, 20, 12]), np.array([40]), np.array([3, 3, 34])]
    dataset, tokens = write_dataset(tmp_path / "data", [rows], CONTEXT, rng)
    for cp in (1, 2):
        write_plan(dataset, f"cp{cp}-llama3-like", [[llama3_like_plan(lens, cp) for lens in rows]], cp)
    return tmp_path / "data", list(zip(tokens[0], rows))


def options(root, **kwargs):
    return TrainOptions(**{"data": str(root), "plan": "cp1-llama3-like", "steps": 3, "dtype": "float64",
                           "shuffle": False, "lr": 1e-2, "seed": 5, **SHAPE, **kwargs})


def test_single_process_run_equals_reference(planned):
    root, sequences = planned
    logs = run_training(options(root))
    torch.manual_seed(5)
    model = TinyDecoder(TinyConfig(**SHAPE, ffn_dim=32)).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)

    def logits(model, ids, positions, doc_lens):
        return model(ids, positions, lambda q, k, v: naive_document_attention(q, k, v, doc_lens))

    ref = naive_training(model, logits, sequences, optimizer, VOCAB)
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


def test_fold_vocab_keeps_ignored_labels(planned):
    root, _ = planned
    batch = next(iter(CPLoader(root, "cp1-llama3-like", 0, 1, shuffle=False)))
    folded = fold_vocab(batch, VOCAB)
    assert folded.input_ids.max() < VOCAB and (folded.input_ids == batch.input_ids % VOCAB).all()
    ignored = batch.labels == -100
    assert (folded.labels[ignored] == -100).all()
    assert (folded.labels[~ignored] == batch.labels[~ignored] % VOCAB).all()


def test_all_reduce_without_a_group_keeps_gradients():
    a = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    b = torch.nn.Parameter(torch.ones(2, dtype=torch.float32))
    a.grad = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    loss, nbytes = all_reduce_gradients([a, b], extra=torch.tensor(0.5, dtype=torch.float32))
    assert loss == 0.5 and nbytes == 3 * 8 + 2 * 4
    assert a.grad.tolist() == [1.0, 2.0, 3.0] and b.grad.tolist() == [0.0, 0.0]


def test_checkpoint_refusals(planned, tmp_path):
    root, _ = planned
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    loader = CPLoader(root, "cp1-llama3-like", 0, 1)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, step=4, model=model, optimizer=optimizer, loader=loader, config={"dim": 2})
    assert load_checkpoint(path, model=model, optimizer=optimizer, loader=loader, config={"dim": 2}) == 4
    assert not list(tmp_path.glob(".ckpt.pt.*"))  # no temporary file left behind
    with pytest.raises(FlashcpError, match=r"different run: dim 2 \(now 3\)"):
        load_checkpoint(path, model=model, optimizer=optimizer, loader=loader, config={"dim": 3})
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(FlashcpError, match="cannot be read"):
        load_checkpoint(path, model=model, optimizer=optimizer, loader=loader, config={"dim": 2})
    torch.save({"format": 99}, path)
    with pytest.raises(FlashcpError, match="has format 99"):
        load_checkpoint(path, model=model, optimizer=optimizer, loader=loader, config={"dim": 2})


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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sharded_checkpoint_in_one_process(planned, tmp_path):
    import os

    from flashcp.train.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint

    root, _ = planned
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    loader = CPLoader(root, "cp1-llama3-like", 0, 1)
    next(iter(loader))
    folder = tmp_path / "ckpts"
    folder.mkdir()
    path = folder / "ck"
    save_sharded_checkpoint(path, step=2, model=model, optimizer=optimizer, loader=loader, config={"dim": 3})
    save_sharded_checkpoint(path, step=3, model=model, optimizer=optimizer, loader=loader, config={"dim": 3})
    assert sorted(p.name for p in folder.iterdir()) == ["ck"], "no staging or old folder left behind"
    os.replace(path, folder / ".ck.old")  # as if a save was killed between its two renames
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh_loader = CPLoader(root, "cp1-llama3-like", 0, 1)
    assert load_sharded_checkpoint(path, model=fresh, optimizer=fresh_opt, loader=fresh_loader,
                                   config={"dim": 3}) == 3
    assert torch.equal(fresh.weight, model.weight) and fresh_loader.state_dict() == loader.state_dict()
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    user_folder = folder / "mine"
    user_folder.mkdir()
    (user_folder / "notes.txt").write_text("keep")
    with pytest.raises(FlashcpError, match="exists and is not a flashcp sharded checkpoint"):
        save_sharded_checkpoint(user_folder, step=1, model=model, optimizer=optimizer, loader=loader, config={})
    assert [p.name for p in user_folder.iterdir()] == ["notes.txt"]
