"""End to end: training with CP on 2 and 4 gloo ranks learns exactly what training without CP learns.

One dataset (3 packed sequences of 256 tokens) with plans from every builder of ``tests.plans.plan_builders``
(stand-ins now, the real strategies too once ``flashcp.planner.registry`` exists). For every plan and model
(the plain-PyTorch TinyDecoder and, with transformers installed, stock LlamaForCausalLM and Qwen2ForCausalLM
attending through flashcp), 3 AdamW steps with CP must give the losses and parameters of 3 steps on the whole
sequences in one process with a document-masked dense attention (float64, 1e-10). The comm modes rotate over
the cases so that every model and every plan meets every mode on 2 ranks; on 4 every plan runs once, the
models and modes rotating. One spawn per world size runs all cases, the
resume checks (2 ranks) and the checkpoint refusals; a torchrun launch checks the refusal of a plan made for
another number of ranks.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashcp.errors import FlashcpError
from flashcp.models.tiny import TinyConfig, TinyDecoder
from flashcp.runtime import CPLoader
from flashcp.train import fold_vocab, train_step
from flashcp.train.loop import TrainOptions, run_training
from flashcp.train.loss import tiny_loss_sum
from tests.dist import free_port, spawn
from tests.naive import naive_document_attention, naive_training
from tests.plans import llama3_like_plan, plan_builders, random_rows, write_dataset, write_plan

REPO = Path(__file__).resolve().parents[2]
HAS_HF = importlib.util.find_spec("transformers") is not None
CONTEXT, NUM_SEQS, STEPS = 256, 3, 3
VOCAB, DIM, LAYERS, HEADS, KV_HEADS = 64, 32, 2, 4, 2
LR, SEED, TOL = 1e-2, 7, 1e-10
COMMS = ("allgather", "a2a", "full")
MODELS = ("tiny", "llama", "qwen2") if HAS_HF else ("tiny",)
WORLD_SIZES = (2, 4)


def make_model(kind: str, cp: bool) -> torch.nn.Module:
    """A float64 model; ``cp`` picks flashcp attention (HF) — the tiny model takes attention per call."""
    torch.manual_seed(SEED)
    if kind == "tiny":
        cfg = TinyConfig(vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                         ffn_dim=2 * DIM)
        return TinyDecoder(cfg).double()
    from flashcp.integrations.hf import tiny_hf_model

    return tiny_hf_model(kind, vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, num_heads=HEADS,
                         num_kv_heads=KV_HEADS, ffn_dim=2 * DIM, dtype=torch.float64,
                         attn_implementation="cp_attention" if cp else "sdpa")


def reference_logits(kind):
    """Whole-sequence logits with a document mask: dense naive attention, or stock transformers sdpa, which
    builds the packed-sequence document mask itself from position ids that restart at 0."""
    if kind == "tiny":
        def logits(model, ids, positions, doc_lens):
            return model(ids, positions, lambda q, k, v: naive_document_attention(q, k, v, doc_lens))
    else:
        def logits(model, ids, positions, doc_lens):
            return model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
    return logits


def parameters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The dataset, plans ``cp{N}-{builder}`` for N in 2, 4 (and cp8 for the refusal), the sequences."""
    root = tmp_path_factory.mktemp("train") / "data"
    rng = np.random.default_rng(11)
    rows = random_rows(rng, NUM_SEQS, CONTEXT, (3, 9))
    rows[1] = np.r_[1, 1, 200, 54]  # one-token documents and one long document spread over every rank
    dataset, tokens = write_dataset(root, [rows], CONTEXT, rng, row_group_rows=2)
    builders = plan_builders()
    for cp in WORLD_SIZES:
        for name, build in builders.items():
            write_plan(dataset, f"cp{cp}-{name}", [[build(lens, cp) for lens in rows]], cp)
    write_plan(dataset, "cp8-llama3-like", [[llama3_like_plan(lens, 8) for lens in rows]], 8)
    sequences = list(zip(tokens[0], rows))
    return root, list(builders), sequences


@pytest.fixture(scope="module")
def references(planned):
    """Per model: initial parameters, and the losses and final parameters of training without CP."""
    _, _, sequences = planned
    out = {}
    for kind in MODELS:
        model = make_model(kind, cp=False)
        init = parameters(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = naive_training(model, reference_logits(kind), sequences, optimizer, VOCAB)
        out[kind] = (init, losses, parameters(model))
    return out


def _cases(builders, world):
    """On 2 ranks every (plan, model) pair; on 4 every plan once, the models and comm modes rotating."""
    cases = [(builder, kind, COMMS[(i + j) % len(COMMS)])
             for i, builder in enumerate(builders) for j, kind in enumerate(MODELS)]
    if world == 2:
        return cases
    return [cases[i * len(MODELS) + i % len(MODELS)] for i in range(len(builders))]


def _worker(rank, world, root, builders, references, ckpt_dir):
    failures = []
    for builder, kind, comm in _cases(builders, world):
        where = f"cp{world} plan={builder} model={kind} comm={comm}"
        init, ref_losses, ref_params = references[kind]
        model = make_model(kind, cp=True)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init[name])
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        if kind == "tiny":
            loss_sum_fn = tiny_loss_sum
        else:
            from flashcp.integrations.hf import hf_loss_sum as loss_sum_fn
        loader = CPLoader(root, f"cp{world}-{builder}", rank, world, shuffle=False)
        losses = [train_step(model, optimizer, fold_vocab(batch, VOCAB), loss_sum_fn, comm=comm).loss
                  for _, batch in zip(range(STEPS), loader)]
        loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        got = parameters(model)
        param_err = max((got[name] - ref).abs().max().item() for name, ref in ref_params.items())
        if not loss_err < TOL or not param_err < TOL:
            failures.append(f"{where}: max |loss err| {loss_err:.2e}, max |param err| {param_err:.2e} "
                            f"(losses {losses}, reference {ref_losses})")
    if world == 2:
        failures += _resume_checks(root, ckpt_dir)
    return failures


def _resume_checks(root, ckpt_dir):
    """Stop after step 2, resume: steps 3 and 4 (second epoch) equal the uninterrupted run, bit for bit."""
    failures = []
    base = dict(data=str(root), plan="cp2-random", model="tiny", dtype="float64", vocab_size=VOCAB,
                dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, lr=LR, seed=3,
                comm="a2a")
    full_ckpt, part_ckpt = f"{ckpt_dir}/full.pt", f"{ckpt_dir}/part.pt"
    full = run_training(TrainOptions(**base, steps=4, ckpt=full_ckpt))
    first = run_training(TrainOptions(**base, steps=2, ckpt=part_ckpt))
    second = run_training(TrainOptions(**base, steps=4, ckpt=part_ckpt, resume=True))
    if [s.step for s in first + second] != [1, 2, 3, 4]:
        failures.append(f"resume ran steps {[s.step for s in first + second]}")
    if [s.loss for s in first + second] != [s.loss for s in full]:
        failures.append(f"resumed losses {[s.loss for s in first + second]} != {[s.loss for s in full]}")
    a, b = (torch.load(p, weights_only=True) for p in (full_ckpt, part_ckpt))
    if any(not torch.equal(a["model"][k], b["model"][k]) for k in a["model"]):
        failures.append("resumed weights differ from the uninterrupted run's")
    for key in ("loader", "step", "config"):
        if a[key] != b[key]:
            failures.append(f"checkpoint {key}: {b[key]} after resuming, {a[key]} uninterrupted")
    for state_a, state_b in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        if any(not torch.equal(state_a[k], state_b[k]) for k in state_a):
            failures.append("resumed optimizer state differs from the uninterrupted run's")
            break
    refusals = [(dict(base, dim=16), part_ckpt, "was made by a different run: dim 32 (now 16)"),
                (base, f"{ckpt_dir}/missing.pt", "does not exist; run without --resume")]
    for options, ckpt, expected in refusals:
        try:
            run_training(TrainOptions(**options, steps=4, ckpt=ckpt, resume=True))
            failures.append(f"resuming from {ckpt} with {options} was accepted")
        except FlashcpError as e:
            if expected not in str(e):
                failures.append(f"resume refusal says '{e}', expected '{expected}'")
    return failures


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cp_training_equals_training_without_cp(planned, references, world_size, tmp_path):
    root, builders, _ = planned
    spawn(_worker, world_size, str(root), builders, references, str(tmp_path))


def test_the_comparison_can_fail(planned, references):
    # training moved every model far from its start, and without the document mask the tiny model would
    # have learned something else: equal numbers above are not equal by accident
    for kind, (init, _, final) in references.items():
        moved = max((final[name] - init[name]).abs().max().item() for name in init)
        assert moved > 1e-3, f"{kind}: parameters moved at most {moved}"
    _, _, sequences = planned
    model = make_model("tiny", cp=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def causal_only(model, ids, positions, doc_lens):
        return model(ids, positions, lambda q, k, v: naive_document_attention(q, k, v, [len(ids)]))

    losses = naive_training(model, causal_only, sequences, optimizer, VOCAB)
    assert max(abs(a - b) for a, b in zip(losses, references["tiny"][1])) > 1e-4


def test_plan_for_another_world_size_stops_every_rank_with_one_sentence(planned):
    root, _, _ = planned
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
               str(free_port()), str(REPO / "examples" / "train_tiny.py"), str(root),
               "--plan", "cp8-llama3-like", "--steps", "1"]
    # a session of its own, so that a hang can be ended together with the workers torchrun started
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=REPO, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the ranks did not stop within 120 s:\n{output}")
    sentence = ("error: plan 'cp8-llama3-like' was made for cp 8 but world_size is 4; launch 8 ranks or run "
                "'flashcp plan --cp 4'")
    assert proc.returncode == 1, output
    assert output.count(sentence) == 1, output
    assert "train_tiny.py\", line" not in output and "FlashcpError" not in output, output
