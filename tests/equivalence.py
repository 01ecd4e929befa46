"""The training-equivalence harness: CP training on gloo ranks against one process on the same global batches.

The training tests (tests/train/test_dist.py, test_parallel.py, test_accumulation.py, test_loop.py,
tests/integrations/test_torchtitan.py; test_hf_trainer.py for its datasets) follow one recipe:

1. a packed dataset of random rows with plans (``planned_dataset``), its sequences as ``(tokens, doc_lens)``;
2. the reference: one process trains each global batch whole, with a document-masked dense attention
   (``global_batch_training``; the global batches of a run of ``dp`` replicas: ``stream_batches``);
3. on the ranks: ``train_steps`` over the loader's batches, epoch after epoch (``batches_forever``);
4. the comparison: ``max_errors`` of the losses and parameters, worded by ``equivalence_failure``;
5. the refusals and the resume check run on the same ranks (``refusal_failures``, ``resume_failures``).

A worker collects failure messages instead of asserting (see tests/dist.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from flashcp.train import fold_vocab, train_step
from tests.naive import naive_document_attention, naive_sequence_views
from tests.plans import random_rows, write_dataset, write_plan

ForwardLoss = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray], torch.Tensor]
"""``forward(model, ids, positions, labels, doc_lens) -> summed token loss`` of one whole sequence (a 0-d tensor);
``ids``, ``positions``, ``labels``: (C,) int64 from ``naive_sequence_views``; labels -100 at each document's end."""


class Reference(NamedTuple):
    """What one process trained: per step the loss and the gradient norm (before clipping), and the parameters."""

    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor]


def make_model(kind: str, cp: bool, *, seed: int, vocab_size: int, dim: int, num_layers: int, num_heads: int,
               num_kv_heads: int) -> torch.nn.Module:
    """A seeded float64 ``tiny`` TinyDecoder or transformers ``llama`` / ``qwen2`` model (ffn 2 x dim).

    ``cp`` picks flashcp attention for a transformers model (else stock ``sdpa``); the tiny model takes its
    attention per call.
    """
    torch.manual_seed(seed)
    if kind == "tiny":
        from flashcp.models.tiny import TinyConfig, TinyDecoder

        cfg = TinyConfig(vocab_size=vocab_size, dim=dim, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, ffn_dim=2 * dim)
        return TinyDecoder(cfg).double()
    from flashcp.integrations.hf import tiny_hf_model

    return tiny_hf_model(kind, vocab_size=vocab_size, dim=dim, num_layers=num_layers, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, ffn_dim=2 * dim, dtype=torch.float64,
                         attn_implementation="cp_attention" if cp else "sdpa")


def tiny_forward_loss(model, ids, positions, labels, doc_lens) -> torch.Tensor:
    """The tiny model with dense document-masked attention: summed cross-entropy over the labels."""
    logits = model(ids, positions, lambda q, k, v: naive_document_attention(q, k, v, doc_lens))
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def hf_forward_loss(model, ids, positions, labels, doc_lens) -> torch.Tensor:
    """A transformers model with stock ``sdpa``, which masks documents from position ids that restart at 0."""
    logits = model(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def forward_loss_of(kind: str) -> ForwardLoss:
    """The reference forward of a ``make_model`` kind."""
    return tiny_forward_loss if kind == "tiny" else hf_forward_loss


def stream_batches(sequences: Sequence, dp: int, steps: int) -> list[list]:
    """The global batches of ``dp`` replicas reading the stream in order: step s takes sequences [s*dp, (s+1)*dp)
    (epoch after epoch)."""
    return [[sequences[g % len(sequences)] for g in range(step * dp, (step + 1) * dp)] for step in range(steps)]


def global_batch_training(model: torch.nn.Module, forward: ForwardLoss, batches: Iterable[Sequence], *,
                          vocab_size: int, lr: float, weight_decay: float = 0.01,
                          max_grad_norm: float | None = None) -> Reference:
    """One process, one AdamW step per global batch of ``(tokens, doc_lens)`` sequences, each trained whole.

    The loss of a step is the summed token losses of its sequences over their label tokens; with
    ``max_grad_norm`` the gradients are clipped to that global norm (``grad_norms`` is then the norm before
    clipping, else empty). ``weight_decay`` 0.01 is ``torch.optim.AdamW``'s default.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses, norms = [], []
    for batch in batches:
        optimizer.zero_grad()
        total, labels_total = 0, 0
        for tokens, doc_lens in batch:
            ids, positions, labels = naive_sequence_views(tokens, doc_lens, vocab_size)
            total = total + forward(model, ids, positions, labels, doc_lens)
            labels_total += int((labels != -100).sum())
        loss = total / labels_total
        loss.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        optimizer.step()
        losses.append(loss.item())
    return Reference(losses, norms, parameters(model))


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two sets of parameters of the same names."""
    return max((a[name] - b[name]).abs().max().item() for name in b)


def batches_forever(loader) -> Iterator:
    """The loader's batches, epoch after epoch (a new pass over ``loader`` each time it ends)."""
    while True:
        yield from loader


def train_steps(model, optimizer, loader, loss_sum_fn, *, steps: int, vocab_size: int, **step_kwargs) -> list[float]:
    """``steps`` calls of ``train_step``, one batch each (token ids folded into ``vocab_size``); their losses."""
    batches = batches_forever(loader)
    return [train_step(model, optimizer, fold_vocab(next(batches), vocab_size), loss_sum_fn, **step_kwargs).loss
            for _ in range(steps)]


def loss_error(losses: Sequence[float], reference_losses: Sequence[float], *, relative: bool = False) -> float:
    """Largest loss difference, step by step; ``relative``: relative to the reference's losses."""
    return max(abs(a - b) / (abs(b) if relative else 1.0) for a, b in zip(losses, reference_losses, strict=True))


def max_errors(losses: Sequence[float], params: dict[str, torch.Tensor], reference: Reference, *,
               relative: bool = False) -> tuple[float, float]:
    """``(loss_error, largest |parameter error|)`` against ``reference``."""
    return loss_error(losses, reference.losses, relative=relative), max_difference(params, reference.params)


def equivalence_failure(where: str, losses, params, reference: Reference, *, loss_tol: float,
                        param_tol: float, relative: bool = False) -> list[str]:
    """``[]`` when the run matches ``reference`` within the tolerances, else one message with both errors."""
    loss_err, param_err = max_errors(losses, params, reference, relative=relative)
    if loss_err <= loss_tol and param_err <= param_tol:
        return []
    return [f"{where}: max {'rel ' if relative else '|'}loss err{'' if relative else '|'} {loss_err:.2e}, "
            f"max |param err| {param_err:.2e} (losses {list(losses)}, reference {reference.losses})"]


def refusal_failures(cases: Iterable[tuple[Callable[[], object], type[Exception], str]]) -> list[str]:
    """Each case ``(make, error type, expected words)``: ``make()`` must raise that error saying those words."""
    failures = []
    for make, error, expected in cases:
        try:
            make()
            failures.append(f"accepted: expected a refusal saying '{expected}'")
        except error as e:
            if expected not in str(e):
                failures.append(f"refusal says '{e}', expected '{expected}'")
    return failures


def resume_failures(run_training, options, *, steps: int, stop: int, full_ckpt: str, part_ckpt: str,
                    first_overrides: dict | None = None) -> list[str]:
    """Train ``steps`` steps at once and, into another checkpoint, ``stop`` steps then a resume to ``steps``: the
    step numbers must run on and the losses must equal the uninterrupted run's, bit for bit.

    ``options(**fields)`` builds the run's options; ``first_overrides`` go to the first, interrupted run only.
    """
    full = run_training(options(steps=steps, ckpt=full_ckpt))
    first = run_training(options(steps=stop, ckpt=part_ckpt, **(first_overrides or {})))
    second = run_training(options(steps=steps, ckpt=part_ckpt, resume=True))
    failures = []
    if [s.step for s in first + second] != list(range(1, steps + 1)):
        failures.append(f"resume ran steps {[s.step for s in first + second]}")
    if [s.loss for s in first + second] != [s.loss for s in full]:
        failures.append(f"resumed losses {[s.loss for s in first + second]} != {[s.loss for s in full]}")
    return failures


def planned_dataset(root: Path, context_len: int, plans: dict[str, tuple[Callable, int]], *, seed: int,
                    num_seqs: int, cuts: tuple[int, int], fixed_rows: dict[int, np.ndarray] | None = None,
                    **write_options) -> list[tuple[np.ndarray, np.ndarray]]:
    """Write one data file of ``num_seqs`` random rows of document lengths (``random_rows`` with ``cuts``; row
    ``i`` replaced by ``fixed_rows[i]``) and, per ``name: (build, cp)``, the plan ``build(doc_lens, cp)`` of every
    row; returns the sequences as ``(tokens, doc_lens)`` in file order. The rows and the tokens come from one
    generator seeded with ``seed``."""
    rng = np.random.default_rng(seed)
    rows = random_rows(rng, num_seqs, context_len, cuts)
    for i, doc_lens in (fixed_rows or {}).items():
        rows[i] = doc_lens
    dataset, tokens = write_dataset(root, [rows], context_len, rng, **write_options)
    for name, (build, cp) in plans.items():
        write_plan(dataset, name, [[build(lens, cp) for lens in rows]], cp)
    return list(zip(tokens[0], rows))
