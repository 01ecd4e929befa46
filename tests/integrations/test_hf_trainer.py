"""CPTrainer (flashcp CP inside the Hugging Face Trainer) trains exactly what one process trains.

One dataset (8 packed sequences of 256 tokens, token ids below the tiny models' vocabulary of 64) with plans
for cp 1, 2 and 4. The reference is a plain single-process ``transformers.Trainer`` on the same global batches
(the sequences in the loader's stream order, ``gradient_accumulation_steps`` = dp x the CP run's), each with a
4-D document mask (``sdpa``), labels -100 at every document start (the model shifts them), float32. A torchrun
launch of 2 gloo ranks and one of 4 run the CPTrainer cases (tests/hf_trainer_worker.py); each case's logged
losses and grad norms and its final parameters must equal the reference's within ``LOSS_TOL``,
``GRAD_NORM_RTOL`` and ``PARAM_TOL``. The sums run in another order in float32 (measured: losses within 5e-7,
grad norms within 3e-7 relative); AdamW divides each entry's step by its own gradient scale, so entries with
tiny gradients carry that noise into their update, and parameters are compared to 1% of the learning rate
(measured: within 2e-5 after 3-5 steps at lr 1e-2). Resume from a Trainer checkpoint must be bit-for-bit
exact. The refusals run in this process (one rank).

Evaluation: a second dataset (5 packed sequences) with plans for cp 1, 2 and 4. Its reference is the plain
Trainer's ``evaluate`` with all 5 sequences in one batch (so its ``eval_loss`` is the mean over every label token of
the set, as CPTrainer's), at the same steps of the same training; CPTrainer's ``eval_loss`` must equal it within
``LOSS_TOL``, on 2 ranks as CP 2 and as DP 2 (whose last round has one replica past the end), on 4 ranks as CP 4
and as DP 2 x CP 2 (``eval_strategy="steps"``, and after training with batches).

Batches (``per_device_train_batch_size`` / ``per_device_eval_batch_size`` > 1), float64 models: a third launch of
2 gloo ranks (CP 2 and DP 2, with and without accumulation, CPSFTTrainer, evaluation in rounds with sequences past
the end), the 4-rank launch (CP 4 and DP 2 x CP 2, batches of 2 with accumulation, evaluated in batches of 3 and
2) and one process against a float64 plain Trainer whose loss keeps float64 (``wide_causal_lm_loss``):
parameters within ``F64_TOLS`` (measured 2e-14 on 2 ranks, 3.2e-14 on 4), grad norms and eval_loss equal, and the
logged loss within a float32 ulp (the Trainer sums it in a float32 tensor).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from flashcp.runtime.loader import IGNORE_INDEX  # noqa: E402
from tests.equivalence import planned_dataset  # noqa: E402
from tests.hf_trainer_worker import LR, make_model, training_arguments  # noqa: E402
from tests.integrations.hf_trainer_harness import (  # noqa: E402
    CONTEXT,
    GRAD_NORM_RTOL,
    LOSS_TOL,
    NUM_SEQS,
    PARAM_TOL,
    REPO,
    check_equal,
    launch,
    planned_sequences,
    stream_order,
)
from tests.integrations.hf_zoo import tiny_model  # noqa: E402

HAS_TRL = importlib.util.find_spec("trl") is not None
NUM_EVAL_SEQS = 5
# float64 models: only the order of sums differs; the Trainer sums the logged loss in a float32 tensor (1 ulp: 5e-7)
F64_TOLS = dict(loss_tol=2e-6, grad_tol=1e-10, param_tol=1e-12)
F64_EVAL_TOL = 1e-10


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The dataset with plans ``cp1``, ``cp2``, ``cp4`` (flashcp strategy) and its sequences by (file, row)."""
    return planned_sequences(tmp_path_factory.mktemp("hf_trainer") / "data")


@pytest.fixture(scope="module")
def eval_planned(tmp_path_factory):
    """The evaluation dataset: 5 packed sequences with plans ``cp1``, ``cp2``, ``cp4``, and its sequences in file
    order."""
    from flashcp.planner.planning import plan_sequence

    root = tmp_path_factory.mktemp("hf_trainer_eval") / "eval"
    plans = {f"cp{cp}": (partial(plan_sequence, "flashcp"), cp) for cp in (1, 2, 4)}
    return root, planned_dataset(root, CONTEXT, plans, seed=11, num_seqs=NUM_EVAL_SEQS, cuts=(2, 7),
                                 row_group_rows=2, vocab_size=64)


class ReferenceData(torch.utils.data.Dataset):
    """Whole packed sequences with a 4-D document mask, for a plain Trainer."""

    def __init__(self, sequences, document_mask: bool = True):
        self.items = []
        for tokens, doc_lens in sequences:
            doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.as_tensor(doc_lens))
            position = torch.cat([torch.arange(n) for n in doc_lens])
            ids = torch.as_tensor(tokens, dtype=torch.int64)
            if not document_mask:  # one document: a causal mask over the whole packed sequence
                doc = torch.zeros_like(doc)
                position = torch.arange(len(doc))
            mask = (doc[:, None] == doc[None, :]) & (position[None, :] <= position[:, None])  # (C, C) bool
            self.items.append({"input_ids": ids, "position_ids": position,
                               "labels": torch.where(position == 0, IGNORE_INDEX, ids), "attention_mask": mask[None]})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def reference_run(planned, tmp_path, arch: str, *, dp: int, ga: int, steps: int, batch: int = 1,
                  dtype: str = "float32", shuffle: bool = True, document_mask: bool = True, eval_sequences=None,
                  evaluations: list | None = None, **overrides):
    """Losses per step and final parameters of a plain single-process Trainer on the same global batches.

    A global batch of the CP run is ``batch x ga x dp`` sequences (micro-batches of ``batch`` on ``dp`` replicas,
    ``ga`` of them per step): the reference accumulates them one sequence at a time. ``dtype``: the model's.

    With ``eval_sequences`` it evaluates on them in one batch (``overrides`` say when); ``evaluations`` receives
    the logged ``(step, eval_loss)`` pairs, then those of an ``evaluate()`` after training.
    """
    from transformers import Trainer

    root, sequences = planned
    order = stream_order(root, steps * ga * dp * batch, shuffle=shuffle)
    model = make_model(arch, attn_implementation="sdpa", dtype=dtype)
    if eval_sequences is not None:
        overrides["per_device_eval_batch_size"] = len(eval_sequences)
    args = training_arguments(str(tmp_path / f"ref-{arch}"), gradient_accumulation_steps=ga * dp * batch,
                              max_steps=steps, train_sampling_strategy="sequential", ddp_backend=None, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=ReferenceData([sequences[k] for k in order],
                                                                                 document_mask),
                      eval_dataset=None if eval_sequences is None else ReferenceData(eval_sequences),
                      compute_loss_func=wide_causal_lm_loss if dtype == "float64" else None)
    if steps:
        trainer.train()
    if evaluations is not None:
        trainer.evaluate()
        evaluations += eval_losses(trainer.state.log_history)
    log = [entry for entry in trainer.state.log_history if "loss" in entry]
    return log, {n: p.detach().clone() for n, p in model.named_parameters()}


def wide_causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """transformers' causal-LM loss without its cast of the logits to float32: a float64 reference stays float64.

    The summed next-token loss over the label tokens, divided by ``num_items_in_batch`` (the Trainer's count over
    the accumulated batch) or, in evaluation, by this batch's label tokens.
    """
    logits, target = outputs.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    total = torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else (target != IGNORE_INDEX).sum())


def eval_losses(log_history) -> list[tuple[int, float]]:
    return [(entry["step"], entry["eval_loss"]) for entry in log_history if "eval_loss" in entry]


def check_eval_equal(log_history, reference: list[tuple[int, float]], where: str, tol: float = LOSS_TOL) -> None:
    got = eval_losses(log_history)
    assert [s for s, _ in got] == [s for s, _ in reference], f"{where}: evaluated at {got}, reference {reference}"
    err = max(abs(a - b) for (_, a), (_, b) in zip(got, reference))
    print(f"{where}: max |eval_loss err| {err:.2e} over {len(got)} evaluations")
    assert err < tol, f"{where}: max |eval_loss err| {err:.2e}: {got} != {reference}"


def losses_of(log_history) -> list[float]:
    return [entry["loss"] for entry in log_history if "loss" in entry]


def _cases_2(out: Path, data: Path, eval_data: Path) -> list[dict]:
    full = dict(max_steps=5, save_strategy="steps", save_steps=2)
    evaluating = dict(max_steps=5, eval_strategy="steps", eval_steps=2)
    cases = [
        dict(name="llama", arch="llama", plan="cp2", args=full),
        dict(name="llama-resume-2", arch="llama", plan="cp2", args=full, resume=str(out / "llama" / "checkpoint-2")),
        dict(name="llama-resume-4", arch="llama", plan="cp2", args=full, resume=str(out / "llama" / "checkpoint-4")),
        dict(name="llama-checkpointing", arch="llama", plan="cp2", args=dict(max_steps=5, gradient_checkpointing=True),
             trainer_kwargs=dict(comm="allgather")),
        dict(name="llama-bf16", arch="llama", plan="cp2", args=dict(max_steps=5, bf16=True)),
        dict(name="qwen2", arch="qwen2", plan="cp2", args=dict(train_sampling_strategy="sequential"),
             trainer_kwargs=dict(comm="a2a")),
        dict(name="cp4-on-2", arch="llama", plan="cp4"),
        dict(name="llama-eval", arch="llama", plan="cp2", args=evaluating, evaluate=True,
             trainer_kwargs=dict(eval_dataset=str(eval_data), eval_plan="cp2")),
        # DP 2 x CP 1: 5 sequences in 3 rounds, replica 1 past the end in the last
        dict(name="llama-eval-dp2", arch="llama", plan="cp1", train=False, evaluate=True,
             trainer_kwargs=dict(eval_dataset=str(eval_data), eval_plan="cp1")),
    ]
    if HAS_TRL:
        cases.append(dict(name="llama-sft", arch="llama", plan="cp2", args=dict(max_steps=5), trainer="sft"))
    # last: the example ends the process group, as a user's script does
    cases.append(dict(name="example", script=str(REPO / "examples" / "hf_trainer.py"),
                      argv=[str(data), "cp2", str(out / "example")]))
    return cases


def _cases_4(eval_data: Path) -> list[dict]:
    """CP 4 and DP 2 x CP 2: training, evaluation every 2 steps, and (float64) batches of several sequences."""
    stream = dict(balance_window=0)  # the stream order (no DP balance), which the reference's global batches follow

    def evaluated(plan: str, **trainer_kwargs) -> dict:
        return dict(evaluate=True, trainer_kwargs=dict(eval_dataset=str(eval_data), eval_plan=plan, **trainer_kwargs))

    evaluating = dict(eval_strategy="steps", eval_steps=2)
    batched = dict(per_device_train_batch_size=2)
    return [
        dict(name="llama-dp2", arch="llama", plan="cp2", trainer_kwargs=stream),
        dict(name="qwen2-cp4", arch="qwen2", plan="cp4"),
        dict(name="llama-eval-cp4", arch="llama", plan="cp4", args=dict(evaluating, max_steps=5), **evaluated("cp4")),
        # DP 2: 5 sequences in 3 rounds, replica 1 past the end in the last
        dict(name="llama-eval-dp2-cp2", arch="llama", plan="cp2", args=evaluating, **evaluated("cp2", **stream)),
        # evaluation after training in rounds of 3 (CP 4: one past the end) and of 2 x 2 (DP 2: three past)
        dict(name="batch2-ga2-cp4", arch="llama", plan="cp4", dtype="float64",
             args=dict(batched, per_device_eval_batch_size=3), **evaluated("cp4")),
        dict(name="batch2-ga2-dp2-cp2", arch="llama", plan="cp2", dtype="float64",
             args=dict(batched, per_device_eval_batch_size=2), **evaluated("cp2", **stream)),
    ]


@pytest.fixture(scope="module")
def two_ranks(planned, eval_planned, tmp_path_factory):
    root, _ = planned
    out = tmp_path_factory.mktemp("w2")
    return out, launch(2, root, out, _cases_2(out, root, eval_planned[0]))


@pytest.fixture(scope="module")
def four_ranks(planned, eval_planned, tmp_path_factory):
    root, _ = planned
    out = tmp_path_factory.mktemp("w4")
    return out, launch(4, root, out, _cases_4(eval_planned[0]))


def _batch_cases(eval_data: Path) -> list[dict]:
    """Micro-batches of several sequences (float64): CP 2 and DP 2, with and without accumulation; evaluation."""
    batched = dict(per_device_train_batch_size=2)
    cases = [
        dict(name="batch2", arch="llama", plan="cp2", args=dict(batched, gradient_accumulation_steps=1)),
        dict(name="batch2-ga2", arch="llama", plan="cp2", args=batched),
        # the stream order (no DP balance), which the reference's global batches follow
        dict(name="batch2-ga2-dp2", arch="llama", plan="cp1", args=batched, trainer_kwargs=dict(balance_window=0)),
        # 5 sequences: CP 2 in rounds of 3 (the last has one past the end), DP 2 in rounds of 2 x 2 (three past)
        dict(name="eval-batch3-cp2", arch="llama", plan="cp2", train=False, evaluate=True,
             args=dict(per_device_eval_batch_size=3),
             trainer_kwargs=dict(eval_dataset=str(eval_data), eval_plan="cp2")),
        dict(name="eval-batch2-dp2", arch="llama", plan="cp1", train=False, evaluate=True,
             args=dict(per_device_eval_batch_size=2),
             trainer_kwargs=dict(eval_dataset=str(eval_data), eval_plan="cp1")),
    ]
    if HAS_TRL:
        cases.append(dict(name="batch2-ga2-sft", arch="llama", plan="cp2", args=batched, trainer="sft"))
    return [dict(case, dtype="float64") for case in cases]


@pytest.fixture(scope="module")
def batched_ranks(planned, eval_planned, tmp_path_factory):
    root, _ = planned
    out = tmp_path_factory.mktemp("w2-batched")
    return out, launch(2, root, out, _batch_cases(eval_planned[0]))


@pytest.fixture(scope="module")
def batch_references(planned, eval_planned, tmp_path_factory):
    """float64 plain-Trainer runs of the batched cases (3 steps) and the untrained model's eval_loss."""
    tmp = tmp_path_factory.mktemp("batch_references")
    untrained: list = []
    reference_run(planned, tmp / "untrained", "llama", dp=1, ga=1, steps=0, dtype="float64",
                  eval_sequences=eval_planned[1], evaluations=untrained)
    return {"batch2": reference_run(planned, tmp / "b2", "llama", dp=1, ga=1, steps=3, batch=2, dtype="float64"),
            "batch2-ga2": reference_run(planned, tmp / "b2ga2", "llama", dp=1, ga=2, steps=3, batch=2,
                                        dtype="float64"),
            "batch2-ga2-dp2": reference_run(planned, tmp / "b2ga2dp2", "llama", dp=2, ga=2, steps=3, batch=2,
                                            dtype="float64"),
            "untrained-eval": untrained}


@pytest.fixture(scope="module")
def references(planned, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("references")
    return {
        "llama-5": reference_run(planned, tmp, "llama", dp=1, ga=2, steps=5),
        "qwen2-sequential": reference_run(planned, tmp, "qwen2", dp=1, ga=2, steps=3, shuffle=False),
        "llama-dp2": reference_run(planned, tmp, "llama", dp=2, ga=2, steps=3),
        "qwen2": reference_run(planned, tmp, "qwen2", dp=1, ga=2, steps=3),
    }


@pytest.fixture(scope="module")
def eval_references(planned, eval_planned, tmp_path_factory):
    """(step, eval_loss) of a plain Trainer: evaluating every 2 steps of the ``llama-5`` training, and untrained."""
    tmp = tmp_path_factory.mktemp("eval_references")
    _, eval_sequences = eval_planned
    trained: list = []
    reference_run(planned, tmp / "trained", "llama", dp=1, ga=2, steps=5, eval_sequences=eval_sequences,
                  evaluations=trained, eval_strategy="steps", eval_steps=2)
    untrained: list = []
    reference_run(planned, tmp / "untrained", "llama", dp=1, ga=2, steps=0, eval_sequences=eval_sequences,
                  evaluations=untrained)
    return {"llama-eval": trained, "llama-eval-dp2": untrained}


@pytest.fixture(scope="module")
def four_rank_references(planned, eval_planned, references, eval_references, tmp_path_factory):
    """Per 4-rank evaluating case: the plain Trainer's training (losses, grad norms, parameters), its
    ``(step, eval_loss)`` pairs and the tolerances of its dtype."""
    tmp = tmp_path_factory.mktemp("four_rank_references")
    _, eval_sequences = eval_planned
    f32 = dict(loss_tol=LOSS_TOL, grad_tol=GRAD_NORM_RTOL, param_tol=PARAM_TOL)
    refs = {"llama-eval-cp4": (references["llama-5"], eval_references["llama-eval"], f32, LOSS_TOL)}
    runs = {"llama-eval-dp2-cp2": (dict(dp=2, eval_strategy="steps", eval_steps=2), f32, LOSS_TOL),
            "batch2-ga2-cp4": (dict(dp=1, batch=2, dtype="float64"), F64_TOLS, F64_EVAL_TOL),
            "batch2-ga2-dp2-cp2": (dict(dp=2, batch=2, dtype="float64"), F64_TOLS, F64_EVAL_TOL)}
    for name, (options, tols, eval_tol) in runs.items():
        evaluations: list = []
        trained = reference_run(planned, tmp / name, "llama", ga=2, steps=3, eval_sequences=eval_sequences,
                                evaluations=evaluations, **options)
        refs[name] = (trained, evaluations, tols, eval_tol)
    return refs


@pytest.mark.slow
@pytest.mark.parametrize("name, reference", [("llama", "llama-5"), ("llama-checkpointing", "llama-5"),
                                             ("qwen2", "qwen2-sequential")])
def test_two_ranks_equal_one_process(two_ranks, references, name, reference):
    _, results = two_ranks
    assert results[name]["wrapped"] == "DistributedDataParallel"
    check_equal(results[name], references[reference], f"cp 2 {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name, reference", [("llama-dp2", "llama-dp2"), ("qwen2-cp4", "qwen2")])
def test_four_ranks_equal_one_process(four_ranks, references, name, reference):
    _, results = four_ranks
    assert results[name]["wrapped"] == "DistributedDataParallel"
    check_equal(results[name], references[reference], f"4 ranks {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-eval-cp4", "llama-eval-dp2-cp2", "batch2-ga2-cp4", "batch2-ga2-dp2-cp2"])
def test_four_ranks_evaluate_and_batch_as_one_process(four_ranks, four_rank_references, name):
    _, results = four_ranks
    reference, evaluations, tols, eval_tol = four_rank_references[name]
    assert evaluations, f"{name}: the reference never evaluated"
    check_equal(results[name], reference, f"4 ranks {name}", **tols)
    check_eval_equal(results[name]["log_history"], evaluations, f"4 ranks {name}", tol=eval_tol)


@pytest.mark.slow
def test_bf16_trains_close_to_float32(two_ranks, references):
    _, results = two_ranks
    check_equal(results["llama-bf16"], references["llama-5"], "bf16", loss_tol=2e-2, grad_tol=5e-2, param_tol=5 * LR)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRL, reason="needs trl (pip install 'flashcp[trl]')")
def test_sft_trainer_equals_one_process(two_ranks, references):
    _, results = two_ranks
    check_equal(results["llama-sft"], references["llama-5"], "CPSFTTrainer")


@pytest.mark.slow
@pytest.mark.parametrize("step", [2, 4])
def test_resume_from_a_checkpoint_is_exact(two_ranks, step):
    out, results = two_ranks
    full, resumed = results["llama"], results[f"llama-resume-{step}"]
    assert "error" not in resumed, resumed.get("error")
    # the resumed log is the checkpoint's (steps 1 .. step) and then the resumed run's own steps
    def steps(result):
        return [(e["step"], e["loss"], e["grad_norm"]) for e in result["log_history"] if "loss" in e]

    assert steps(resumed) == steps(full) and len(steps(full)) == 5
    assert all(torch.equal(resumed["params"][n], p) for n, p in full["params"].items())
    saved = json.loads((out / "llama" / "checkpoint-5" / "flashcp_loader.json").read_text())
    again = json.loads((out / "llama-resume-2" / "checkpoint-5" / "flashcp_loader.json").read_text())
    assert saved == again and saved["loader"]["epoch"] == 1 and saved["loader"]["position"] == 2, saved


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-eval", "llama-eval-dp2"])
def test_two_ranks_evaluate_as_one_process(two_ranks, references, eval_references, name):
    _, results = two_ranks
    assert "error" not in results[name], results[name].get("error")
    check_eval_equal(results[name]["log_history"], eval_references[name], f"2 ranks {name}")
    if name == "llama-eval":  # evaluating leaves the training as it was
        check_equal(results[name], references["llama-5"], f"cp 2 {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name, reference, sequences_per_step", [
    ("batch2", "batch2", 2), ("batch2-ga2", "batch2-ga2", 4), ("batch2-ga2-dp2", "batch2-ga2-dp2", 8),
    pytest.param("batch2-ga2-sft", "batch2-ga2", 4,
                 marks=pytest.mark.skipif(not HAS_TRL, reason="needs trl (pip install 'flashcp[trl]')"))])
def test_two_ranks_with_batches_equal_one_process(batched_ranks, batch_references, name, reference,
                                                  sequences_per_step):
    _, results = batched_ranks
    check_equal(results[name], batch_references[reference], f"2 ranks {name}", **F64_TOLS)
    # a step is per_device_train_batch_size x gradient_accumulation_steps x dp sequences, as the Trainer counts
    epochs = [(e["step"], e["epoch"]) for e in results[name]["log_history"] if "loss" in e]
    assert epochs == [(step, step * sequences_per_step / NUM_SEQS) for step in (1, 2, 3)], epochs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eval-batch3-cp2", "eval-batch2-dp2"])
def test_two_ranks_evaluate_batches_as_one_process(batched_ranks, batch_references, name):
    _, results = batched_ranks
    assert "error" not in results[name], results[name].get("error")
    check_eval_equal(results[name]["log_history"], batch_references["untrained-eval"], f"2 ranks {name}",
                     tol=F64_EVAL_TOL)


@pytest.mark.slow
def test_plan_for_another_launch_is_refused(two_ranks):
    _, results = two_ranks
    assert results["cp4-on-2"] == {"error": "plan 'cp4' was made for cp 4 but 2 ranks were launched; launch a "
                                            "multiple of 4 ranks (dp x cp)"}


@pytest.mark.slow
def test_example_script_trains_and_saves(two_ranks):
    out, results = two_ranks
    assert "error" not in results["example"], results["example"].get("error")
    state = json.loads((out / "example" / "checkpoint-4" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"]] == [1, 2, 3, 4]
    assert (out / "example" / "checkpoint-2" / "flashcp_loader.json").is_file()


def test_the_comparison_can_fail(planned, eval_planned, references, tmp_path):
    # the parameters moved far more than the tolerance, and attending across documents (one causal mask over
    # the whole packed sequence) trains parameters that differ by far more too: equal numbers are not by accident
    log, final = references["llama-5"]
    init = dict(make_model("llama", attn_implementation="sdpa").named_parameters())
    assert max((final[n] - p).abs().max().item() for n, p in init.items()) > 100 * PARAM_TOL
    causal = reference_run(planned, tmp_path, "llama", dp=1, ga=2, steps=5, document_mask=False)
    assert max((final[n] - p).abs().max().item() for n, p in causal[1].items()) > 100 * PARAM_TOL
    # and the trained model's eval_loss over the eval set with one causal mask differs by far more than LOSS_TOL
    from transformers import Trainer

    _, eval_sequences = eval_planned
    trained = make_model("llama", attn_implementation="sdpa")
    trained.load_state_dict(final, strict=False)
    args = training_arguments(str(tmp_path / "eval"), ddp_backend=None, per_device_eval_batch_size=NUM_EVAL_SEQS)
    losses = [Trainer(model=trained, args=args, eval_dataset=ReferenceData(eval_sequences, document_mask))
              .evaluate()["eval_loss"] for document_mask in (True, False)]
    assert abs(losses[0] - losses[1]) > 100 * LOSS_TOL, losses


def test_one_process_with_a_cp1_plan_equals_the_plain_trainer(planned, references, tmp_path):
    from flashcp.integrations.hf_trainer import CPTrainer

    root, _ = planned
    args = training_arguments(str(tmp_path / "cp1"), ddp_backend=None)
    trainer = CPTrainer(model=make_model("qwen2"), args=args, train_dataset=str(root), plan="cp1")
    trainer.train()
    result = {"log_history": trainer.state.log_history, "params": dict(trainer.model.named_parameters())}
    check_equal(result, references["qwen2"], "one process, cp 1")


def test_one_process_evaluation_equals_the_plain_trainer(planned, eval_planned, tmp_path):
    from flashcp.integrations.hf_trainer import CPTrainer

    root, _ = planned
    eval_root, eval_sequences = eval_planned
    schedule = dict(eval_strategy="steps", eval_steps=2)
    evaluations: list = []
    reference = reference_run(planned, tmp_path, "llama", dp=1, ga=2, steps=5, eval_sequences=eval_sequences,
                              evaluations=evaluations, **schedule)
    assert [step for step, _ in evaluations] == [2, 4, 5, 5]  # the last step evaluates, then evaluate()
    args = training_arguments(str(tmp_path / "cp1-eval"), ddp_backend=None, max_steps=5, **schedule)
    trainer = CPTrainer(model=make_model("llama"), args=args, train_dataset=str(root), plan="cp1",
                        eval_dataset=str(eval_root), eval_plan="cp1")
    trainer.train()
    metrics = trainer.evaluate()
    assert set(metrics) == {"eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"}
    check_eval_equal(trainer.state.log_history, evaluations, "one process, cp 1")
    result = {"log_history": trainer.state.log_history, "params": dict(trainer.model.named_parameters())}
    check_equal(result, reference, "one process, cp 1, evaluating")
    if HAS_TRL:  # CPSFTTrainer evaluates the same way (SFTTrainer looks at the eval data's columns first)
        from flashcp.integrations.hf_trainer import CPSFTTrainer
        from tests.hf_trainer_worker import tiny_tokenizer

        untrained: list = []
        reference_run(planned, tmp_path / "untrained", "llama", dp=1, ga=2, steps=0, eval_sequences=eval_sequences,
                      evaluations=untrained)
        sft = CPSFTTrainer(model=make_model("llama"), args=training_arguments(str(tmp_path / "sft"), ddp_backend=None),
                           train_dataset=str(root), plan="cp1", eval_dataset=str(eval_root), eval_plan="cp1",
                           processing_class=tiny_tokenizer())
        sft.evaluate()
        check_eval_equal(sft.state.log_history, untrained, "one process, CPSFTTrainer")


def test_one_process_batches_equal_the_plain_trainer(planned, eval_planned, tmp_path):
    from flashcp.integrations.hf_trainer import CPTrainer

    root, _ = planned
    eval_root, eval_sequences = eval_planned
    evaluations: list = []
    reference = reference_run(planned, tmp_path, "llama", dp=1, ga=2, steps=3, batch=2, dtype="float64",
                              eval_sequences=eval_sequences, evaluations=evaluations)
    args = training_arguments(str(tmp_path / "cp1-batch2"), ddp_backend=None, per_device_train_batch_size=2,
                              per_device_eval_batch_size=2)
    trainer = CPTrainer(model=make_model("llama", dtype="float64"), args=args, train_dataset=str(root), plan="cp1",
                        eval_dataset=str(eval_root), eval_plan="cp1")
    trainer.train()
    trainer.evaluate()
    assert trainer.num_examples(trainer.get_train_dataloader()) == NUM_SEQS  # 4 micro-batches of 2 sequences
    check_eval_equal(trainer.state.log_history, evaluations, "one process, batch 2", tol=F64_EVAL_TOL)
    result = {"log_history": trainer.state.log_history, "params": dict(trainer.model.named_parameters())}
    check_equal(result, reference, "one process, batch 2", **F64_TOLS)


def test_refusals_are_one_sentence(planned, eval_planned, tmp_path):
    from flashcp.errors import FlashcpError
    from flashcp.integrations.hf_trainer import CPTrainer

    root, sequences = planned
    eval_root = str(eval_planned[0])
    model = make_model("llama")

    def build(*, args=None, **kwargs):
        kwargs = {"train_dataset": str(root), "plan": "cp1", **kwargs}
        args = training_arguments(str(tmp_path / "refused"), ddp_backend=None, **(args or {}))
        return CPTrainer(model=model, args=args, **kwargs)

    cases = [
        (dict(args=dict(auto_find_batch_size=True)), "set auto_find_batch_size=False"),
        (dict(args=dict(dataloader_num_workers=2)), "dataloader_num_workers=2; set it to 0"),
        (dict(args=dict(label_smoothing_factor=0.1)), "no label smoothing"),
        (dict(args=dict(train_sampling_strategy="group_by_length")), "train_sampling_strategy='group_by_length'"),
        (dict(args=dict(eval_strategy="steps", eval_steps=1)),
         "eval_strategy='steps' needs data to evaluate on: pass CPTrainer(eval_dataset=DATA, eval_plan=PLAN)"),
        (dict(eval_dataset=ReferenceData([sequences[0, 0]])), "got a ReferenceData as eval_dataset; pass the folder"),
        (dict(eval_dataset=eval_root), "CPTrainer needs eval_plan, the name of a plan of"),
        (dict(eval_dataset=eval_root, eval_plan="cp2"), "eval plan 'cp2' was made for cp 2 but plan 'cp1' trains "
                                                        "with cp 1"),
        (dict(compute_metrics=lambda p: {}), "cannot honour compute_metrics: each rank holds only its shard"),
        (dict(preprocess_logits_for_metrics=lambda a, b: a), "cannot honour preprocess_logits_for_metrics"),
        (dict(data_collator=lambda rows: rows), "cannot honour data_collator"),
        (dict(compute_loss_func=lambda *a, **k: 0), "cannot honour compute_loss_func"),
        (dict(train_dataset=ReferenceData([sequences[0, 0]])), "got a ReferenceData; pass the folder's path"),
        (dict(plan="cp2", cp=4), "plan 'cp2' was made for cp 2 but cp is 4"),
        (dict(plan="cp2"), "plan 'cp2' was made for cp 2 but 1 ranks were launched"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)) as refused:
            build(**kwargs)
        assert "\n" not in str(refused.value)
    with pytest.raises(FlashcpError, match="plan 'cp9' does not exist"):
        build(plan="cp9")
    with pytest.raises(FlashcpError, match="plan 'cp9' does not exist"):
        build(eval_dataset=eval_root, eval_plan="cp9")
    evaluating = build(eval_dataset=eval_root, eval_plan="cp1")
    for call, message in [(lambda: evaluating.evaluate(eval_dataset=ReferenceData([sequences[0, 0]])),
                           "CPTrainer evaluates the flashcp dataset given as CPTrainer(eval_dataset=DATA"),
                          (lambda: build().evaluate(), "CPTrainer has no data to evaluate on; pass"),
                          (lambda: evaluating.predict(ReferenceData([sequences[0, 0]])), "CPTrainer cannot predict")]:
        with pytest.raises(ValueError, match=re.escape(message)) as refused:
            call()
        assert "\n" not in str(refused.value)
    for model_type, class_name, overrides, names in [
            ("jamba", "JambaForCausalLM", {}, "layer 0 is linear_attention"),  # a hybrid flashcp does not run
            ("llama4_text", "Llama4ForCausalLM", {"no_rope_layers": [1, 0]}, "layer 1 has no RoPE")]:
        with pytest.raises(ValueError, match=f"{class_name} cannot train under flashcp .*{names}") as refused:
            CPTrainer(model=tiny_model(model_type, class_name, **overrides), train_dataset=str(root), plan="cp1",
                      args=training_arguments(str(tmp_path / "refused"), ddp_backend=None))
        assert "\n" not in str(refused.value)
    with pytest.raises(FlashcpError, match="is not a dataset folder"):
        build(train_dataset=str(tmp_path / "missing"))

    trainer = build(args=dict(max_steps=1, save_strategy="steps", save_steps=1))
    trainer.train()
    checkpoint = tmp_path / "refused" / "checkpoint-1"
    assert json.loads((checkpoint / "flashcp_loader.json").read_text())["loader"]["position"] == 2
    batch = next(iter(trainer.get_train_dataloader()))
    padded = dict(batch, attention_mask=torch.ones_like(batch["input_ids"]).index_fill_(1, torch.tensor([3]), 0))
    with pytest.raises(ValueError, match="have no padding; remove the attention_mask"):
        trainer.compute_loss(trainer.model, padded, num_items_in_batch=batch["num_label_tokens"])
    (checkpoint / "flashcp_loader.json").unlink()  # a checkpoint another trainer wrote
    with pytest.raises(ValueError, match="has no flashcp_loader.json: it was not saved by CPTrainer"):
        build(args=dict(max_steps=2)).train(resume_from_checkpoint=str(checkpoint))


def test_what_would_fail_later_is_refused_at_construction(planned, tmp_path):
    from flashcp.integrations.hf import tiny_hf_model
    from flashcp.integrations.hf_trainer import CPTrainer
    from tests.faults.workspace import tree

    root, _ = planned
    small = tiny_hf_model("llama", vocab_size=32, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=64)
    # the data's tokenizer has more ids than the model embeds (the manifest says how many)
    recorded = tmp_path / "recorded"
    shutil.copytree(root, recorded)
    manifest = json.loads((recorded / "manifest.json").read_text())
    manifest["tokenizer"] = {"name": "tiny-words", "sha256": None, "vocab_size": 64}
    (recorded / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"tokenized with tiny-words \(64 token ids\) but the model embeds only 32"):
        CPTrainer(model=small, train_dataset=str(recorded), plan="cp1",
                  args=training_arguments(str(tmp_path / "out"), ddp_backend=None))
    # no vocabulary recorded: the first micro-batch says it, before the embedding would fail
    trainer = CPTrainer(model=small, train_dataset=str(root), plan="cp1",
                        args=training_arguments(str(tmp_path / "out"), ddp_backend=None, max_steps=1))
    with pytest.raises(ValueError, match=r"holds token id \d+ but the model embeds only 32 ids"):
        trainer.train()
    # no plan named; an output_dir inside the dataset (nothing written there)
    before = tree(root)
    for kwargs, message in [(dict(plan=None), "needs the name of a plan of .*, got None"),
                            (dict(output_dir=root / "runs"), "output_dir .*/runs lies inside the dataset")]:
        output_dir = kwargs.pop("output_dir", tmp_path / "out")
        with pytest.raises(ValueError, match=message) as refused:
            CPTrainer(model=make_model("llama"), train_dataset=str(root), **{"plan": "cp1", **kwargs},
                      args=training_arguments(str(output_dir), ddp_backend=None))
        assert "\n" not in str(refused.value)
    assert tree(root) == before


def test_a_plan_for_another_model_warns_once(planned, tmp_path):
    """The trainer hands the loader its model's config: a plan priced for another model warns once, one
    priced for this model's config never."""
    import shutil
    import warnings

    from flashcp.integrations.hf_trainer import CPTrainer
    from flashcp.planner.pipeline import plan_dataset

    root = shutil.copytree(planned[0], tmp_path / "data")
    model = make_model("qwen2")
    plan_dataset(root, 1, "flashcp", compare=0, model="llama-3-8b", name="llama")
    plan_dataset(root, 1, "flashcp", compare=0, model=model.config, name="own")
    args = training_arguments(str(tmp_path / "out"), ddp_backend=None)
    trainer = CPTrainer(model=model, args=args, train_dataset=str(root), plan="llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.get_train_dataloader()
        trainer.get_train_dataloader()  # a second loader of the same trainer says it again: one per loader
    told = [str(w.message) for w in caught if "priced for" in str(w.message)]
    assert len(told) == 2 and "plan 'llama' was priced for model llama-3-8b but the model trained is qwen2" in told[0]
    trainer = CPTrainer(model=model, args=args, train_dataset=str(root), plan="own")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.get_train_dataloader()
    assert not [w for w in caught if "priced for" in str(w.message)]
