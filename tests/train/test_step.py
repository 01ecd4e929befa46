"""The training step's pieces (flashcp.train.step): vocabulary folding and the gradient sum without a group."""

import torch

from flashcp.runtime import CPLoader
from flashcp.train import all_reduce_gradients, fold_vocab
from tests.train import VOCAB


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
