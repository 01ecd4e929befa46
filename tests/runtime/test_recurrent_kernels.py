"""The chunked recurrent kernels against token-by-token references (float64) and transformers' own torch paths.

``tests/naive.py`` holds the references written from the definitions; transformers' Qwen3-Next
(``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``), Mamba2 and NemotronH
(``mamba2_chunk_scan``) and their ``causal_conv1d_fn`` run in float32 and are compared at float32 tolerance.
"""

import pytest
import torch

from flashcp.runtime.recurrent import causal_conv1d, chunk_gated_delta_rule, chunk_ssd
from tests.naive import naive_causal_conv1d, naive_gated_delta_rule, naive_ssd
from tests.runtime.recurrent_cases import cu_of, gdn_inputs, ssd_inputs

DOC_LENS = [(1,), (13,), (5, 1, 17, 8), (2, 9, 64, 3)]
CHUNKS = (1, 4, 8, 64)
TOL = 1e-11


def close(got, want, tol, what):
    err = (got - want).abs()
    assert err.max().item() < tol, f"{what}: max |err| {err.max().item():.3g}, mean {err.mean().item():.3g}"


@pytest.mark.parametrize("doc_lens", DOC_LENS)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_gated_delta_rule_equals_token_by_token(doc_lens, chunk, with_state):
    inputs = gdn_inputs(sum(doc_lens))
    states = torch.randn(len(doc_lens), 4, 4, 3, dtype=torch.float64) if with_state else None
    want, want_final = naive_gated_delta_rule(*inputs, doc_lens, initial_states=states)
    got, final = chunk_gated_delta_rule(*inputs, cu_of(doc_lens), states, chunk_size=chunk)
    close(got, want, TOL, "out")
    close(final, want_final, TOL, "final state")


@pytest.mark.parametrize("doc_lens", DOC_LENS)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_ssd_equals_token_by_token(doc_lens, chunk, with_state):
    x, dt, A, B, C, D = ssd_inputs(sum(doc_lens))
    states = torch.randn(len(doc_lens), 4, 3, 5, dtype=torch.float64) if with_state else None
    want, want_final = naive_ssd(x, dt, A, B, C, D, doc_lens, initial_states=states)
    got, final = chunk_ssd(x, dt, A, B, C, cu_of(doc_lens), states, D_H=D, chunk_size=chunk)
    close(got, want, TOL, "y")
    close(final, want_final, TOL, "final state")


@pytest.mark.parametrize("doc_lens", DOC_LENS)
@pytest.mark.parametrize("width", [1, 2, 4])
def test_causal_conv1d_equals_token_by_token(doc_lens, width):
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(sum(doc_lens), 6, generator=gen, dtype=torch.float64)
    weight, bias = torch.randn(6, width, generator=gen, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    close(causal_conv1d(x, weight, bias, cu_of(doc_lens)), naive_causal_conv1d(x, weight, bias, doc_lens),
          TOL, "conv")
    # a segment continuing a document: its tail is the W-1 inputs before it
    first, rest = doc_lens[0] // 2, doc_lens[0] - doc_lens[0] // 2
    if first and rest and width > 1:
        padded = torch.cat((x.new_zeros(width - 1, 6), x[:first]))
        tail = padded[-(width - 1):][None]
        got = causal_conv1d(x[first:doc_lens[0]], weight, bias, [0, rest], tail)
        close(got, naive_causal_conv1d(x[:doc_lens[0]], weight, bias, [doc_lens[0]])[first:], TOL, "conv tail")


def test_gradients_equal_token_by_token():
    doc_lens = (5, 11, 2)
    gdn = [t.requires_grad_() for t in gdn_inputs(sum(doc_lens))]
    ssd = [t.requires_grad_() for t in ssd_inputs(sum(doc_lens))]
    for name, run, ref, inputs in (
            ("gdn", lambda *a: chunk_gated_delta_rule(*a, cu_of(doc_lens), chunk_size=4)[0],
             lambda *a: naive_gated_delta_rule(*a, doc_lens)[0], gdn),
            ("ssd", lambda x, dt, A, B, C, D: chunk_ssd(x, dt, A, B, C, cu_of(doc_lens), D_H=D, chunk_size=4)[0],
             lambda *a: naive_ssd(*a, doc_lens)[0], ssd)):
        grad_out = torch.randn_like(run(*inputs))
        got = torch.autograd.grad(run(*inputs), inputs, grad_out)
        want = torch.autograd.grad(ref(*inputs), inputs, grad_out)
        for i, (a, b) in enumerate(zip(got, want)):
            close(a, b, 1e-10, f"{name} gradient of input {i}")


def _transformers(module: str):
    return pytest.importorskip(f"transformers.models.{module}.modeling_{module}")


@pytest.mark.parametrize("length, chunk", [(1, 64), (13, 4), (70, 64)])
def test_gated_delta_rule_equals_transformers(length, chunk):
    qwen = _transformers("qwen3_next")
    q, k, v, g, beta = gdn_inputs(length, dtype=torch.float32)
    state = torch.randn(1, 4, 4, 3)
    got, final = chunk_gated_delta_rule(q, k, v, g, beta, [0, length], state, chunk_size=chunk)
    for fn in (qwen.torch_chunk_gated_delta_rule, qwen.torch_recurrent_gated_delta_rule):
        kwargs = {"chunk_size": chunk} if fn is qwen.torch_chunk_gated_delta_rule else {}
        want, want_final = fn(q[None], k[None], v[None], g[None], beta[None], initial_state=state,
                              output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs)
        close(got, want[0], 1e-4, f"{fn.__name__} out")
        close(final, want_final, 1e-4, f"{fn.__name__} final state")


@pytest.mark.parametrize("module", ["mamba2", "nemotron_h"])
@pytest.mark.parametrize("length, chunk", [(1, 64), (13, 4), (70, 64)])
def test_ssd_equals_transformers(module, length, chunk):
    scan = _transformers(module).mamba2_chunk_scan
    x, dt, A, B, C, D = ssd_inputs(length, dtype=torch.float32)
    state = torch.randn(1, 4, 3, 5)
    got, final = chunk_ssd(x, dt, A, B, C, [0, length], state, D_H=D, chunk_size=chunk)
    want, want_final = scan(x[None], dt[None], A, B[None], C[None], chunk_size=chunk, D=D, initial_states=state,
                            return_final_states=True)
    close(got, want[0], 1e-4, f"{module} y")
    close(final, want_final, 1e-4, f"{module} final state")


def test_causal_conv1d_equals_transformers():
    conv = _transformers("qwen3_next").causal_conv1d_fn
    x, weight, bias = torch.randn(9, 6), torch.randn(6, 4), torch.randn(6)
    close(causal_conv1d(x, weight, bias, [0, 9]), conv(x.T[None], weight, bias, activation="silu")[0].T, 1e-5,
          "conv")
