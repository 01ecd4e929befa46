"""The recurrent GPU libraries on this device against the float64 reference: what ``scripts/gpu_check.sh`` runs.

Each test runs twice: on a CUDA device at full size (``gpu`` marker, skipped without CUDA, and each library
skipped where it is not installed) and on the CPU at toy size through ``tests/fake_recurrent.py``'s
emulations. The calls are the ones the CP layers make: segments of uneven lengths, a start state per segment,
grouped key heads, and the ``[I | 0]`` start with ``[0 | v]`` values (``K + V`` value columns) that reads off a
piece's transition. Inputs are bfloat16; the error is judged as fla's own tests judge theirs
(``fla/utils/_testing.py``: the RMS of the difference over the RMS of the reference, below 0.01) against the
reference kernels in float64 on the same bfloat16-rounded inputs (so that the kernel's own error is judged, as
fla's tests judge it), for the output, the final states and every input's gradient.
"""

import numpy as np
import pytest
import torch

from flashcp.runtime.recurrent import backends, causal_conv1d
from flashcp.runtime.recurrent.chunked import normalize_qk
from tests import fake_recurrent

RATIO = 0.01


@pytest.fixture(params=[pytest.param("fakes", id="cpu-emulated"), pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    if request.param == "cuda":
        yield torch.device("cuda")
        return
    undo = fake_recurrent.install("fla-0.6", "mamba_ssm-main")
    try:
        yield torch.device("cpu")
    finally:
        undo()


def _lengths(device) -> list[int]:
    return [5, 1, 17, 8] if device.type == "cpu" else [1000, 37, 2500, 64, 1]


def _require(backend, operation, device):
    why = backends._why_not(backend, operation, torch.zeros(1, dtype=torch.bfloat16, device=device))
    if why is not None:
        pytest.skip(f"{backend} cannot run {operation} here: {why}")


def err_ratio(got, want) -> float:
    """fla's ``get_err_ratio``: RMS of the difference over the RMS of the reference."""
    diff = (got.double() - want.double()).square().mean().sqrt().item()
    return diff / (want.double().square().mean().sqrt().item() + 1e-8)


def _run(fn, inputs, seed):
    """``fn(*inputs) -> tensors``, and the gradients of each input under a fixed random projection of them."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    outs = fn(*inputs)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
               for o in outs)
    return outs, torch.autograd.grad(loss, inputs, allow_unused=True)


def _compare(names, got, want):
    ratios = {name: err_ratio(a, b) for name, a, b in zip(names, got, want) if a is not None and b is not None}
    assert len(ratios) == len(names), f"missing gradients: {set(names) - set(ratios)}"
    bad = {name: f"{r:.4f}" for name, r in ratios.items() if not r < RATIO}
    assert not bad, f"error ratio above {RATIO}: {bad} (all: { {n: f'{r:.4f}' for n, r in ratios.items()} })"


@pytest.mark.parametrize("augmented", [False, True], ids=["values", "transition"])
def test_fla_gated_delta_rule_against_float64(device, augmented):
    _require("fla", "gated_delta", device)
    lengths = _lengths(device)
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    key_heads, heads, dk, dv = (2, 4, 4, 3) if device.type == "cpu" else (4, 8, 128, 128)
    gen = torch.Generator().manual_seed(0)
    total = cu[-1]

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)

    q, k, v = rand(total, key_heads, dk), rand(total, key_heads, dk), rand(total, heads, dv)
    g = torch.nn.functional.logsigmoid(rand(total, heads) + 3)  # decays near 1, as trained models have
    beta = torch.sigmoid(rand(total, heads))
    initial = rand(len(lengths), heads, dk, dv) * 0.1
    if augmented:  # what step 1 of cp_gated_delta_rule runs: [I | 0] states, [0 | v] values
        v = torch.cat((torch.zeros(total, heads, dk, dtype=v.dtype, device=device), v), dim=2)
        eye = torch.eye(dk, dtype=v.dtype, device=device).expand(len(lengths), heads, dk, dk)
        initial = torch.cat((eye, torch.zeros(len(lengths), heads, dk, dv, dtype=v.dtype, device=device)), dim=3)

    def run(backend, dtype):
        def fn(q, k, v, g, beta, initial):
            qn, kn = normalize_qk(q, k, heads, None, True)
            return backends.gated_delta(qn, kn, v, g, beta, cu, initial, 64, dtype=dtype, backend=backend)
        inputs = [t.to(torch.bfloat16).to(dtype) if i < 3 or i == 4 else t
                  for i, t in enumerate((q, k, v, g, beta, initial))]
        return _run(fn, inputs, seed=1)

    (out, final), grads = run("fla", torch.bfloat16)
    (want_out, want_final), want_grads = run("reference", torch.float64)
    names = ["out", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial"]
    _compare(names, [out, final, *grads], [want_out, want_final, *want_grads])


@pytest.mark.parametrize("carried", ["none", "some", "all"])
def test_mamba_ssm_ssd_against_float64(device, carried):
    _require("mamba_ssm", "ssd", device)
    lengths = _lengths(device)
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    heads, groups, p, s = (4, 2, 3, 5) if device.type == "cpu" else (16, 2, 64, 128)
    gen = torch.Generator().manual_seed(2)
    total = cu[-1]

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)

    mask = {"none": np.zeros(len(lengths), bool), "all": np.ones(len(lengths), bool),
            "some": np.arange(len(lengths)) % 2 == 0}[carried]
    x, B, C = rand(total, heads, p), rand(total, groups, s), rand(total, groups, s)
    dt = torch.nn.functional.softplus(rand(total, heads) - 2)
    A = -torch.exp(rand(heads) * 0.5)
    keep = torch.from_numpy(mask).to(device)[:, None, None, None]
    initial = rand(len(lengths), heads, p, s) * 0.1 * keep

    def run(backend, dtype):
        def fn(x, dt, A, B, C, initial):
            y, final = backends.ssd(x, dt, A, B, C, cu, initial, 64, carried=mask, backend=backend)
            return y, final * keep  # the final states of carried segments only are defined
        return _run(fn, [t.to(torch.bfloat16).to(dtype) if i in (0, 3, 4) else t
                         for i, t in enumerate((x, dt, A, B, C, initial))], seed=3)

    (y, final), grads = run("mamba_ssm", torch.bfloat16)
    (want_y, want_final), want_grads = run("reference", torch.float64)
    got, want = [y, *grads[:5]], [want_y, *want_grads[:5]]
    names = ["y", "dx", "ddt", "dA", "dB", "dC"]
    if mask.any():
        got += [final, grads[5] * keep]
        want += [want_final, want_grads[5] * keep]
        names += ["final", "dinitial"]
    _compare(names, got, want)


@pytest.mark.parametrize("backend", ["fla", "mamba_ssm"])
def test_library_convolution_against_float64(device, backend):
    _require(backend, "conv", device)
    lengths = _lengths(device)
    cu = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    features = 6 if device.type == "cpu" else 2048
    gen = torch.Generator().manual_seed(4)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)

    x, weight, bias, tails = rand(cu[-1], features), rand(features, 4) * 0.5, rand(features), rand(len(lengths), 3,
                                                                                                    features)

    def run(name, dtype):
        kernel = None if name == "reference" else backends.conv_kernel(name, x.to(dtype), 4)
        return _run(lambda *a: (causal_conv1d(a[0], a[1], a[2], cu, a[3], kernel=kernel),),
                    [t.to(torch.bfloat16).to(dtype) for t in (x, weight, bias, tails)], seed=5)

    got, want = run(backend, torch.bfloat16), run("reference", torch.float64)
    _compare(["y", "dx", "dweight", "dbias", "dtails"], [*got[0], *got[1]], [*want[0], *want[1]])
