"""The recurrent-layer cases the recurrent tests share: plans, inputs, the two small layers and their reference.

The layers are Qwen3-Next's Gated DeltaNet core (conv over ``[q | k | v]``, then the gated delta rule) and
Nemotron-H's Mamba-2 core (conv over ``[x | B | C]``, dt through bias and softplus, then SSD); ``reference``
runs them on the whole packed sequence with the token-by-token kernels of ``tests/naive.py``.
"""

import numpy as np
import torch
import torch.nn.functional as F

from flashcp.planner.planning import plan_sequence
from flashcp.runtime.recurrent import cp_causal_conv1d, cp_gated_delta_rule, cp_ssd
from tests.emulate import random_plan
from tests.naive import naive_causal_conv1d, naive_gated_delta_rule, naive_ssd
from tests.plans import llama3_like_plan, whole_docs_case


def cu_of(doc_lens):
    return np.concatenate([[0], np.cumsum(doc_lens)]).tolist()


def gdn_inputs(context_len, heads=4, key_heads=2, dk=4, dv=3, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(context_len, key_heads, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(context_len, heads, dv, generator=gen, dtype=dtype)
    g = -torch.rand(context_len, heads, generator=gen, dtype=dtype)
    beta = torch.sigmoid(torch.randn(context_len, heads, generator=gen, dtype=dtype))
    return q, k, v, g, beta


def ssd_inputs(context_len, heads=4, groups=2, p=3, s=5, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(context_len, heads, p, generator=gen, dtype=dtype)
    dt = torch.nn.functional.softplus(torch.randn(context_len, heads, generator=gen, dtype=dtype))
    A = -torch.exp(torch.randn(heads, generator=gen, dtype=dtype) * 0.5)
    B, C = (torch.randn(context_len, groups, s, generator=gen, dtype=dtype) for _ in range(2))
    D = torch.randn(heads, generator=gen, dtype=dtype)
    return x, dt, A, B, C, D


WIDTH = 4  # convolution taps, as Qwen3-Next and Nemotron-H
GDN = {"key_heads": 2, "heads": 4, "dk": 4, "dv": 3}
SSD = {"heads": 4, "groups": 2, "p": 3, "s": 5}


def build_cases(world_size: int) -> list[tuple[str, object, np.ndarray]]:
    """(name, plan, doc_lens): identical on every rank."""
    rng = np.random.default_rng(2000 + world_size)
    cases = []
    for i, max_pieces in enumerate((2, 4, 1000)):
        doc_lens = rng.integers(1, 15, size=int(rng.integers(2, 6)))
        plan = random_plan(doc_lens, world_size, rng, max_pieces=max_pieces, cut_prob=0.3)
        cases.append((f"random{i}", plan, doc_lens))
    doc_lens = np.array([6 * world_size + 1])  # one document over every rank, short pieces (below W - 1) likely
    cases.append(("one-doc", random_plan(doc_lens, world_size, rng, max_pieces=1000, cut_prob=0.3), doc_lens))
    doc_lens = rng.integers(1, 15, size=4)
    cases.append(("llama3", llama3_like_plan(doc_lens, world_size), doc_lens))
    doc_lens, plan = whole_docs_case(7 * world_size, world_size, rng)
    cases.append(("whole-docs", plan, doc_lens))
    doc_lens = np.r_[rng.integers(1, 6, size=4), 9 * world_size]
    cases.append(("strategy-flashcp", plan_sequence("flashcp", doc_lens, world_size), doc_lens))
    if world_size > 2:  # fewer tokens than ranks: the last ranks hold nothing, yet take part in every exchange
        doc_lens = np.array([1, world_size - 2])
        cases.append(("empty-ranks", random_plan(doc_lens, world_size, rng), doc_lens))
    return cases


def gdn_layer(mixed, g, beta, conv_weight, conv, recurrence):
    """Qwen3-Next's core: conv over [q | k | v], then the gated delta rule (q, k l2-normalised)."""
    key_heads, heads, dk, dv = GDN.values()
    y = conv(mixed, conv_weight, None)
    q, k, v = y.split([key_heads * dk, key_heads * dk, heads * dv], dim=1)
    return recurrence(q.view(-1, key_heads, dk), k.view(-1, key_heads, dk), v.view(-1, heads, dv), g, beta)


def ssd_layer(xbc, dt_raw, conv_weight, conv_bias, A_log, dt_bias, D, conv, recurrence):
    """Nemotron-H's core: conv over [x | B | C], dt through bias and softplus, A = -exp(A_log), then SSD."""
    heads, groups, p, s = SSD.values()
    y = conv(xbc, conv_weight, conv_bias)
    x, B, C = y.split([heads * p, groups * s, groups * s], dim=1)
    dt = F.softplus(dt_raw + dt_bias)
    return recurrence(x.view(-1, heads, p), dt, -torch.exp(A_log), B.view(-1, groups, s), C.view(-1, groups, s), D)


def make_inputs(context_len: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    key_heads, heads, dk, dv = GDN.values()
    features = 2 * key_heads * dk + heads * dv
    gdn_data = (torch.randn(context_len, features, generator=gen, dtype=torch.float64),
                -torch.rand(context_len, heads, generator=gen, dtype=torch.float64),
                torch.sigmoid(torch.randn(context_len, heads, generator=gen, dtype=torch.float64)))
    gdn_params = (torch.randn(features, WIDTH, generator=gen, dtype=torch.float64) * 0.5,)
    heads, groups, p, s = SSD.values()
    features = heads * p + 2 * groups * s
    ssd_data = (torch.randn(context_len, features, generator=gen, dtype=torch.float64),
                torch.randn(context_len, heads, generator=gen, dtype=torch.float64))
    ssd_params = (torch.randn(features, WIDTH, generator=gen, dtype=torch.float64) * 0.5,
                  torch.randn(features, generator=gen, dtype=torch.float64),
                  torch.randn(heads, generator=gen, dtype=torch.float64) * 0.5,
                  torch.randn(heads, generator=gen, dtype=torch.float64),
                  torch.randn(heads, generator=gen, dtype=torch.float64))
    return {"gdn": (gdn_data, gdn_params), "ssd": (ssd_data, ssd_params)}


def layers(doc_lens, meta=None, group=None, chunk_size=4):
    """kind -> (layer, conv, recurrence): the reference's (``meta`` None) or the CP ones of this rank."""
    if meta is None:
        return {"gdn": (gdn_layer, lambda x, w, b: naive_causal_conv1d(x, w, b, doc_lens),
                        lambda q, k, v, g, beta: naive_gated_delta_rule(q, k, v, g, beta, doc_lens)[0]),
                "ssd": (ssd_layer, lambda x, w, b: naive_causal_conv1d(x, w, b, doc_lens),
                        lambda x, dt, A, B, C, D: naive_ssd(x, dt, A, B, C, D, doc_lens)[0])}
    return {"gdn": (gdn_layer, lambda x, w, b: cp_causal_conv1d(x, w, b, meta, group),
                    lambda q, k, v, g, beta: cp_gated_delta_rule(q, k, v, g, beta, meta, group,
                                                                 chunk_size=chunk_size)),
            "ssd": (ssd_layer, lambda x, w, b: cp_causal_conv1d(x, w, b, meta, group),
                    lambda x, dt, A, B, C, D: cp_ssd(x, dt, A, B, C, meta, group, D_H=D, chunk_size=chunk_size))}


def reference(doc_lens, seed=0):
    """kind -> (output, gradients of data then parameters, grad_out) on the whole sequence, one process."""
    results = {}
    for kind, (data, params) in make_inputs(int(np.sum(doc_lens)), seed).items():
        layer, conv, recurrence = layers(doc_lens)[kind]
        inputs = [t.requires_grad_() for t in (*data, *params)]
        out = layer(*inputs, conv, recurrence)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
        results[kind] = (out.detach(), torch.autograd.grad(out, inputs, grad_out), grad_out)
    return results
