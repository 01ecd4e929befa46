"""Helpers of the training tests: a tiny model shape and its one-process options."""

from flashcp.train.loop import TrainOptions

CONTEXT, VOCAB = 40, 16
SHAPE = dict(vocab_size=VOCAB, dim=16, num_layers=1, num_heads=2, num_kv_heads=1)


def options(root, **kwargs):
    return TrainOptions(**{"data": str(root), "plan": "cp1-llama3-like", "steps": 3, "dtype": "float64",
                           "shuffle": False, "lr": 1e-2, "seed": 5, **SHAPE, **kwargs})
