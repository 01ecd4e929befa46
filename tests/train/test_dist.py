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
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from flashcp.errors import FlashcpError
from flashcp.runtime import CPLoader
from flashcp.train.loop import TrainOptions, run_training
from flashcp.train.loss import tiny_loss_sum
from tests import equivalence
from tests.dist import spawn, torchrun
from tests.equivalence import (
    equivalence_failure,
    forward_loss_of,
    global_batch_training,
    max_difference,
    parameters,
    planned_dataset,
    refusal_failures,
    resume_failures,
    stream_batches,
    tiny_forward_loss,
    train_steps,
)
from tests.plans import llama3_like_plan, plan_builders

REPO = Path(__file__).resolve().parents[2]
HAS_HF = importlib.util.find_spec("transformers") is not None
CONTEXT, NUM_SEQS, STEPS = 256, 3, 3
VOCAB, DIM, LAYERS, HEADS, KV_HEADS = 64, 32, 2, 4, 2
LR, SEED, TOL = 1e-2, 7, 1e-10
COMMS = ("allgather", "a2a", "full")
MODELS = ("tiny", "llama", "qwen2") if HAS_HF else ("tiny",)
WORLD_SIZES = (2, 4)


SHAPE = dict(vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS)
make_model = partial(equivalence.make_model, seed=SEED, **SHAPE)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The dataset, plans ``cp{N}-{builder}`` for N in 2, 4 (and cp8 for the refusal), the sequences."""
    root = tmp_path_factory.mktemp("train") / "data"
    builders = plan_builders()
    plans = {f"cp{cp}-{name}": (build, cp) for cp in WORLD_SIZES for name, build in builders.items()}
    plans["cp8-llama3-like"] = (llama3_like_plan, 8)
    # row 1: one-token documents and one long document spread over every rank
    sequences = planned_dataset(root, CONTEXT, plans, seed=11, num_seqs=NUM_SEQS, cuts=(3, 9),
                                fixed_rows={1: np.r_[1, 1, 200, 54]}, row_group_rows=2)
    return root, list(builders), sequences


@pytest.fixture(scope="module")
def references(planned):
    """Per model: initial parameters, and what training without CP learns (one sequence a step)."""
    _, _, sequences = planned
    out = {}
    for kind in MODELS:
        model = make_model(kind, cp=False)
        init = parameters(model)
        out[kind] = (init, global_batch_training(model, forward_loss_of(kind), stream_batches(sequences, 1, STEPS),
                                                 vocab_size=VOCAB, lr=LR))
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
        init, reference = references[kind]
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
        losses = train_steps(model, optimizer, loader, loss_sum_fn, steps=STEPS, vocab_size=VOCAB, comm=comm)
        failures += equivalence_failure(f"cp{world} plan={builder} model={kind} comm={comm}", losses,
                                        parameters(model), reference, loss_tol=TOL, param_tol=TOL)
    if world == 2:
        failures += _resume_checks(root, ckpt_dir)
    return failures


def _resume_checks(root, ckpt_dir):
    """Stop after step 2, resume: steps 3 and 4 (second epoch) equal the uninterrupted run, bit for bit."""
    base = dict(data=str(root), plan="cp2-random", model="tiny", dtype="float64", vocab_size=VOCAB,
                dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, lr=LR, seed=3,
                comm="a2a")
    full_ckpt, part_ckpt = f"{ckpt_dir}/full.pt", f"{ckpt_dir}/part.pt"
    failures = resume_failures(run_training, partial(TrainOptions, **base), steps=4, stop=2, full_ckpt=full_ckpt,
                               part_ckpt=part_ckpt)
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

    def resume(options, ckpt):
        return lambda: run_training(TrainOptions(**options, steps=4, ckpt=ckpt, resume=True))

    return failures + refusal_failures([
        (resume(dict(base, dim=16), part_ckpt), FlashcpError, "was made by a different run: dim 32 (now 16)"),
        (resume(base, f"{ckpt_dir}/missing.pt"), FlashcpError, "does not exist; run without --resume")])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cp_training_equals_training_without_cp(planned, references, world_size, tmp_path):
    root, builders, _ = planned
    spawn(_worker, world_size, str(root), builders, references, str(tmp_path))


def test_the_comparison_can_fail(planned, references):
    # training moved every model far from its start, and without the document mask the tiny model would
    # have learned something else: equal numbers above are not equal by accident
    for kind, (init, reference) in references.items():
        moved = max_difference(reference.params, init)
        assert moved > 1e-3, f"{kind}: parameters moved at most {moved}"
    _, _, sequences = planned

    def causal_only(model, ids, positions, labels, doc_lens):
        return tiny_forward_loss(model, ids, positions, labels, [len(ids)])

    other = global_batch_training(make_model("tiny", cp=False), causal_only, stream_batches(sequences, 1, STEPS),
                                  vocab_size=VOCAB, lr=LR)
    assert max(abs(a - b) for a, b in zip(other.losses, references["tiny"][1].losses)) > 1e-4


def test_plan_for_another_world_size_stops_every_rank_with_one_sentence(planned):
    root, _, _ = planned
    returncode, output = torchrun(REPO / "examples" / "train_tiny.py", root, "--plan", "cp8-llama3-like",
                                  "--steps", 1, nproc=4, timeout=120)
    sentence = ("error: plan 'cp8-llama3-like' was made for cp 8 but world_size is 4; launch 8 ranks or run "
                "'flashcp plan --cp 4'")
    assert returncode == 1, output
    assert output.count(sentence) == 1, output
    assert "train_tiny.py\", line" not in output and "FlashcpError" not in output, output
