"""Hybrid transformers models (recurrent layers beside attention) train under flashcp CP equal to one process.

Tiny Qwen3-Next (a Gated DeltaNet layer, then gated full attention) and Nemotron-H (a Mamba-2 block, then an
attention block), their recurrent mixers run by ``flashcp.integrations.hf_recurrent``. The reference is one
process running every document alone through the unmodified transformers model (eager attention, transformers'
own pure-PyTorch recurrent path), so the recurrent state and the convolution inputs start at zero at each
document's start, on the same packed sequences.

- Fast: one step through ``hf_loss_sum`` on 2 gloo ranks (Qwen3.5 too), a plan that cuts documents (one head on
  rank 1 and tail on rank 0, one in three pieces over both ranks): loss and every gradient against the reference,
  float32.
- Slow (torchrun launches of 2 and 4 gloo ranks, ``tests/hf_trainer_worker.py``): ``CPTrainer`` trains 3 steps
  of 2 accumulated sequences (``test_hf_trainer``'s dataset from ``hf_trainer_harness``: 256 tokens, plans
  ``cp2`` and ``cp4`` that cut documents) against a plain single-process ``Trainer`` whose loss runs each document alone
  (``DocumentsApartTrainer``): logged losses, grad norms and final parameters within ``test_hf_trainer``'s
  float32 tolerances (Gated DeltaNet's decay parameters within one learning rate: ``DECAY_PARAM_TOL``). bf16
  (``bf16=True``, autocast on CPU) against the float32 reference within the tolerances
  ``test_hf_trainer`` states for Llama in bf16 (bf16 rounding of every matmul input, not the recurrence: the
  scans run in float32 on both sides).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from flashcp.planner.plan import SequencePlan  # noqa: E402
from flashcp.runtime import CPAttnMeta, CPLoader  # noqa: E402
from flashcp.runtime.loader import IGNORE_INDEX, Batch  # noqa: E402
from flashcp.runtime.meta import rank_token_positions  # noqa: E402
from flashcp.runtime.recurrent import RecurrentMeta  # noqa: E402
from tests.dist import spawn  # noqa: E402
from tests.hf_trainer_worker import LR, SEED, SHAPE, make_model, training_arguments  # noqa: E402
from tests.integrations.hf_trainer_harness import (  # noqa: E402
    check_equal,
    launch,
    planned_sequences,
    stream_order,
)

HYBRIDS = ("qwen3_next", "nemotron_h")
ONE_STEP_ARCHS = ("qwen3_next", "qwen3_5", "nemotron_h")  # the one-step check takes Qwen3.5's projections too
STEPS, GA = 3, 2
# Gated DeltaNet's decay parameters: transformers' initialisation draws A up to 16, so some heads forget almost
# everything at each token (exp(g) ~ 1e-9) and their dt_bias / A_log gradients are ~1e-7 and below, under the
# float32 noise of either run (measured on the one-step sequence against a float64 run: true dt_bias gradients
# 1.0e-7 and -2.5e-9, off by 7.2e-7 and 4.0e-8 under CP and by 9.9e-7 and 2.0e-9 in the one-process float32
# reference). AdamW's step normalises each entry by its own gradient scale, so such an entry moves by up to the
# learning rate in a direction the noise picks, in both runs alike (measured after 3 steps: up to 2.5e-3 on
# cp 2, 2.9e-3 on cp 4, in dt_bias, A_log and the ``a`` rows of in_proj_ba). Every other parameter keeps
# ``test_hf_trainer``'s tolerance, and the losses and grad norms theirs.
DECAY_PARAMETERS = ("linear_attn.dt_bias", "linear_attn.A_log", "linear_attn.in_proj_ba.weight")
DECAY_PARAM_TOL = LR
# one-step check, float32: the sums and the scans' chunks run in another order (measured: losses equal to the last
# bit, gradients within 6.3e-5 of each parameter's largest gradient, Qwen3-Next's dt_bias, which sums small
# per-token terms of both signs; Nemotron-H within 1.1e-6)
ONE_STEP_LOSS_RTOL, ONE_STEP_GRAD_RTOL = 1e-6, 5e-4

# 512 tokens, 4 documents: doc 1's head on rank 1 and its tail on rank 0, doc 3 in three pieces over both ranks
DOC_LENS = np.array([100, 156, 60, 196])
PLAN = SequencePlan.from_arrays(shard_doc=[0, 1, 3, 3, 1, 2, 3], shard_start=[0, 100, 0, 120, 0, 0, 56],
                                shard_len=[100, 56, 56, 76, 100, 60, 64], shard_rank=[0, 0, 0, 0, 1, 1, 1], cp=2)


def rank_batch(tokens: torch.Tensor, rank: int) -> Batch:
    """This rank's shards of the packed sequence ``tokens`` under ``PLAN``, as ``CPLoader`` builds a batch."""
    global_pos, position, doc = rank_token_positions(PLAN, DOC_LENS, rank)
    is_last = position + 1 == DOC_LENS[doc]
    labels = np.where(is_last, IGNORE_INDEX, tokens.numpy()[np.minimum(global_pos + 1, tokens.numel() - 1)])
    return Batch(input_ids=tokens[torch.from_numpy(global_pos)], position_ids=torch.from_numpy(position),
                 labels=torch.from_numpy(labels), attn=CPAttnMeta.from_plan(PLAN, DOC_LENS, rank),
                 num_label_tokens=int(DOC_LENS.sum() - DOC_LENS.size), file_index=0, row=0, plan=PLAN,
                 doc_lens=DOC_LENS)


def documents_apart_loss_sum(model, ids: torch.Tensor, doc_lens) -> torch.Tensor:
    """Summed next-token loss of a packed sequence, every document alone through ``model``."""
    total = torch.zeros((), dtype=torch.float32)
    for doc in torch.split(ids, [int(n) for n in doc_lens]):
        logits = model(input_ids=doc[None], use_cache=False).logits[0]
        total = total + F.cross_entropy(logits[:-1].float(), doc[1:], reduction="sum")
    return total


def _one_step(rank, world_size):
    import torch.distributed as dist

    from flashcp.integrations.hf import hf_loss_sum
    from flashcp.integrations.hf_recurrent import recurrent_mixers
    from flashcp.runtime import CPAttention
    from flashcp.runtime.comm import CommStats

    failures = []
    tokens = torch.randint(0, SHAPE["vocab_size"], (int(DOC_LENS.sum()),), generator=torch.Generator().manual_seed(3))
    num_labels = int(DOC_LENS.sum() - DOC_LENS.size)
    for arch in ONE_STEP_ARCHS:
        reference = make_model(arch, attn_implementation="eager")
        want_loss = documents_apart_loss_sum(reference, tokens, DOC_LENS) / num_labels
        want_loss.backward()
        model = make_model(arch)
        batch = rank_batch(tokens, rank)
        stats = CommStats()
        loss = hf_loss_sum(model, batch, CPAttention(meta=batch.attn, stats=stats)) / num_labels
        loss.backward()
        # the plan cuts documents 1 and 3 across the ranks: every recurrent layer sends maps and inputs both ways
        mixers = sum(1 for _ in recurrent_mixers(model))
        counts = {t: sum(r.tensor == t and r.sent_bytes > 0 for r in stats.records)
                  for t in ("state", "conv", "dstate", "dconv")}
        if mixers == 0 or counts != dict.fromkeys(counts, mixers):
            failures.append(f"{arch}: flashcp_stats recorded {counts} recurrent all-to-alls, the model has "
                            f"{mixers} recurrent layers")
        got_loss = loss.detach().clone()
        dist.all_reduce(got_loss)
        loss_err = abs(got_loss.item() / want_loss.item() - 1)
        if loss_err > ONE_STEP_LOSS_RTOL:
            failures.append(f"{arch}: loss {got_loss.item()} vs {want_loss.item()} (relative error {loss_err:.1e})")
        worst, where = 0.0, ""
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            err = (grad - q.grad).abs().max().item() / q.grad.abs().max().item()
            worst, where = max((worst, where), (err, name))
        if rank == 0:
            print(f"{arch}: loss relative error {loss_err:.1e}, worst gradient error {worst:.1e} ({where})")
        if worst > ONE_STEP_GRAD_RTOL:
            failures.append(f"{arch}: gradient of {where} off by {worst:.1e} of its largest entry")
    return failures


def test_hf_loss_sum_one_step_equals_one_process():
    for arch in ONE_STEP_ARCHS:  # transformers' model modules load lazily: once here, then the ranks fork
        make_model(arch, attn_implementation="eager")
    spawn(_one_step, 2, start_method="fork")


def test_a_batch_gives_its_recurrent_meta_from_its_plan():
    tokens = torch.arange(int(DOC_LENS.sum())) % SHAPE["vocab_size"]
    for rank in (0, 1):
        meta = rank_batch(tokens, rank).recurrent()
        assert meta.rank == rank and meta.num_tokens == int(PLAN.shard_len[PLAN.shard_rank == rank].sum())
        assert meta.active and meta.cu_seqlens == RecurrentMeta.from_plan(PLAN, DOC_LENS, rank).cu_seqlens
    by_hand = Batch(input_ids=tokens[:4], position_ids=torch.arange(4), labels=tokens[:4],
                    attn=CPAttnMeta.from_plan(SequencePlan.from_arrays([0], [0], [4], [0], 1), np.array([4]), 0),
                    num_label_tokens=3, file_index=0, row=0)
    with pytest.raises(ValueError, match="without its plan and doc_lens has no RecurrentMeta"):
        by_hand.recurrent()


def test_the_plan_cuts_documents_across_ranks():
    pieces = np.bincount(PLAN.shard_doc)
    assert pieces[1] == 2 and pieces[3] == 3
    assert {int(r) for r in PLAN.shard_rank[PLAN.shard_doc == 3]} == {0, 1}


# ---- CPTrainer, 2 and 4 gloo ranks -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """``test_hf_trainer``'s dataset: plans ``cp1``, ``cp2``, ``cp4``; sequences by (file, row)."""
    return planned_sequences(tmp_path_factory.mktemp("hf_hybrid") / "data")


class _Sequences(torch.utils.data.Dataset):
    """Whole packed sequences: ids, per-document positions, labels -100 at each document's start (model shift)."""

    def __init__(self, sequences):
        self.items = []
        for tokens, doc_lens in sequences:
            position = torch.cat([torch.arange(n) for n in doc_lens])
            ids = torch.as_tensor(tokens, dtype=torch.int64)
            self.items.append({"input_ids": ids, "position_ids": position,
                               "labels": torch.where(position == 0, IGNORE_INDEX, ids)})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _documents_apart_trainer():
    from transformers import Trainer

    class DocumentsApartTrainer(Trainer):
        """A plain Trainer whose loss runs every document of a packed sequence alone through the model."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            assert num_items_in_batch is not None, "the Trainer counts the global batch's label tokens"
            position = inputs["position_ids"][0]
            starts = [*torch.nonzero(position == 0).flatten().tolist(), position.numel()]
            total = documents_apart_loss_sum(model, inputs["input_ids"][0], np.diff(starts))
            return total / num_items_in_batch

    return DocumentsApartTrainer


def documents_apart_run(planned, tmp_path, arch: str):
    """Logged losses and final parameters of one process training the CP run's global batches, documents apart."""
    root, sequences = planned
    order = stream_order(root, STEPS * GA, shuffle=True)
    model = make_model(arch, attn_implementation="eager")
    args = training_arguments(str(tmp_path / f"ref-{arch}"), gradient_accumulation_steps=GA, max_steps=STEPS,
                              train_sampling_strategy="sequential", ddp_backend=None)
    trainer = _documents_apart_trainer()(model=model, args=args,
                                         train_dataset=_Sequences([sequences[k] for k in order]))
    trainer.train()
    log = [entry for entry in trainer.state.log_history if "loss" in entry]
    return log, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def hybrid_references(planned, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hybrid_references")
    return {arch: documents_apart_run(planned, tmp, arch) for arch in HYBRIDS}


@pytest.fixture(scope="module")
def hybrid_two_ranks(planned, tmp_path_factory):
    root, _ = planned
    cases = [dict(name=arch, arch=arch, plan="cp2", args=dict(max_steps=STEPS)) for arch in HYBRIDS]
    cases += [dict(name=f"{arch}-bf16", arch=arch, plan="cp2", args=dict(max_steps=STEPS, bf16=True))
              for arch in HYBRIDS]
    return launch(2, root, tmp_path_factory.mktemp("hybrid-w2"), cases)


@pytest.fixture(scope="module")
def hybrid_four_ranks(planned, tmp_path_factory):
    root, _ = planned
    cases = [dict(name=arch, arch=arch, plan="cp4", args=dict(max_steps=STEPS)) for arch in HYBRIDS]
    return launch(4, root, tmp_path_factory.mktemp("hybrid-w4"), cases)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["cp2", "cp4"])
def test_the_trained_sequences_have_documents_cut_across_ranks(planned, plan):
    root, _ = planned
    cp = int(plan[2:])
    order = stream_order(root, STEPS * GA, shuffle=True)
    cut = 0
    for batch in CPLoader(root, plan, 0, cp, seed=SEED, shuffle=True):
        if (batch.file_index, batch.row) in order:
            cut += int((np.bincount(batch.plan.shard_doc) > 1).sum())
    assert cut >= 2, f"plan {plan} cuts only {cut} documents of the trained sequences"


def check_hybrid_equal(result, reference, where: str) -> None:
    """``check_equal`` on every parameter but the Gated DeltaNet decays, which get ``DECAY_PARAM_TOL``."""
    log, params = reference
    decays = {n for n in params if n.endswith(DECAY_PARAMETERS)}
    check_equal(result, (log, {n: p for n, p in params.items() if n not in decays}), where)
    worst = max(((result["params"][n] - params[n]).abs().max().item(), n) for n in decays) if decays else (0.0, "")
    print(f"{where}: max |decay param err| {worst[0]:.2e} ({worst[1]})")
    assert worst[0] < DECAY_PARAM_TOL, f"{where}: {worst[1]} off by {worst[0]:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("arch", HYBRIDS)
def test_two_ranks_train_hybrids_equal_one_process(hybrid_two_ranks, hybrid_references, arch):
    check_hybrid_equal(hybrid_two_ranks[arch], hybrid_references[arch], f"cp 2 {arch}")


@pytest.mark.slow
@pytest.mark.parametrize("arch", HYBRIDS)
def test_four_ranks_train_hybrids_equal_one_process(hybrid_four_ranks, hybrid_references, arch):
    check_hybrid_equal(hybrid_four_ranks[arch], hybrid_references[arch], f"cp 4 {arch}")


@pytest.mark.slow
@pytest.mark.parametrize("arch", HYBRIDS)
def test_bf16_trains_hybrids_close_to_float32(hybrid_two_ranks, hybrid_references, arch):
    check_equal(hybrid_two_ranks[f"{arch}-bf16"], hybrid_references[arch], f"bf16 {arch}", loss_tol=2e-2,
                grad_tol=5e-2, param_tol=5 * LR)
