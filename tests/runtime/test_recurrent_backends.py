"""The recurrent kernel backends: their rules, and ``fla`` / ``mamba_ssm`` through CPU emulations.

``tests/fake_recurrent.py`` emulates each library's entry point from its source with a plain token-by-token
recurrence; here flashcp's ``fla`` and ``mamba_ssm`` backends, run through those fakes, must equal the
reference backend (``chunked``'s kernels) forward and backward, with segments, initial states and grouped
heads; and the CP layers with those backends on 2 gloo ranks must equal the float64 token-by-token reference
of ``tests/naive.py``. The fakes compute in float32, so tolerances are float32 ones.
"""

import warnings

import numpy as np
import pytest
import torch

from flashcp.runtime.kernels import BackendFallbackWarning, BackendUnavailableError
from flashcp.runtime.meta import rank_token_positions
from flashcp.runtime.recurrent import (
    RecurrentMeta,
    backends,
    causal_conv1d,
    cp_causal_conv1d,
    cp_gated_delta_rule,
    cp_ssd,
)
from flashcp.runtime.recurrent.chunked import normalize_qk
from tests import fake_recurrent
from tests.dist import spawn
from tests.runtime.recurrent_cases import (
    build_cases,
    cu_of,
    gdn_inputs,
    gdn_layer,
    layers,
    make_inputs,
    reference,
    ssd_inputs,
    ssd_layer,
)

TOL = 2e-5
DOC_LENS = (5, 1, 17, 8)


@pytest.fixture
def installed(request):
    undo = fake_recurrent.install(*request.param)
    yield request.param
    undo()


def close(got, want, tol, what):
    err = (got - want).abs()
    scale = max(want.abs().max().item(), 1.0)
    assert err.max().item() < tol * scale, f"{what}: max |err| {err.max().item():.3g}, mean {err.mean().item():.3g}"


def fallback_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)]


# ---------------------------------------------------------------- the rules

def test_auto_on_cpu_is_the_reference_silently():
    x = torch.zeros(3, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [backends.resolve_recurrent_backend("auto", op, x) for op in backends.OPERATIONS] == \
            ["reference"] * 3
    assert not fallback_warnings(caught)


@pytest.mark.parametrize("installed", [()], indirect=True)
def test_auto_on_cuda_without_libraries_warns_once(installed):
    x = torch.zeros(3, 2, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert backends.resolve_recurrent_backend("auto", "gated_delta", x) == "reference"
    said = fallback_warnings(caught)
    assert len(said) == 1, said
    assert "flash-linear-attention is not installed" in said[0] and "reference" in said[0], said[0]
    assert said[0].endswith("(pip install --no-build-isolation 'flashcp[linear]')"), said[0]


@pytest.mark.parametrize("installed", [()], indirect=True)
@pytest.mark.parametrize("backend, operation, dtype, reason", [
    ("fla", "gated_delta", torch.bfloat16, "flash-linear-attention is not installed"),
    ("mamba_ssm", "ssd", torch.bfloat16, "mamba-ssm is not installed"),
    ("fla", "ssd", torch.bfloat16, "flashcp runs only gated_delta, conv on fla, not ssd"),
    ("mamba_ssm", "gated_delta", torch.bfloat16, "flashcp runs only ssd, conv on mamba_ssm, not gated_delta"),
    ("fla", "gated_delta", torch.float64, "fla needs float16 or bfloat16 or float32, got torch.float64"),
    ("nope", "ssd", torch.float32, "unknown backend 'nope'")])
def test_a_named_backend_that_cannot_run_is_refused_in_one_sentence(installed, backend, operation, dtype, reason):
    with pytest.raises(BackendUnavailableError) as error:
        backends.resolve_recurrent_backend(backend, operation, torch.zeros(2, dtype=dtype))
    message = str(error.value)
    assert message.startswith(f"recurrent backend '{backend}' cannot run {operation} here: ") and reason in message
    assert "\n" not in message


def test_a_named_gpu_backend_refuses_cpu_tensors():
    with pytest.raises(BackendUnavailableError, match="fla needs CUDA tensors, got cpu"):
        backends.resolve_recurrent_backend("fla", "gated_delta", torch.zeros(2))


@pytest.mark.parametrize("installed", [("fla-0.5", "mamba_ssm-main")], indirect=True)
def test_auto_takes_each_operation_to_its_library(installed):
    x = torch.zeros(2, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = [backends.resolve_recurrent_backend("auto", op, x) for op in backends.OPERATIONS]
    assert chosen == ["fla", "mamba_ssm", "fla"]
    assert not fallback_warnings(caught)


@pytest.mark.parametrize("installed", [("mamba_ssm-2.3",)], indirect=True)
def test_auto_says_why_it_passes_over_a_library(installed):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backends.resolve_recurrent_backend("auto", "gated_delta", torch.zeros(2)) == "reference"
        assert backends.resolve_recurrent_backend("auto", "ssd", torch.zeros(2)) == "mamba_ssm"
        assert backends.resolve_recurrent_backend("auto", "conv", torch.zeros(2)) == "mamba_ssm"
    assert len(fallback_warnings(caught)) == 1


def test_an_installed_library_that_does_not_import_is_named():
    undo = fake_recurrent.install("mamba_ssm-main", broken={"fla": OSError("undefined symbol: _ZN3c10")})
    try:
        x = torch.zeros(2, dtype=torch.bfloat16)
        with pytest.raises(BackendUnavailableError, match=r"fla is installed but does not import \(OSError: "
                                                          r"undefined symbol: _ZN3c10\)"):
            backends.resolve_recurrent_backend("fla", "gated_delta", x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert backends.resolve_recurrent_backend("auto", "gated_delta", x) == "reference"
            assert backends.resolve_recurrent_backend("auto", "conv", x) == "mamba_ssm"  # past the broken fla
        said = fallback_warnings(caught)
        assert len(said) == 1 and "(fla is installed but does not import (OSError" in said[0], said
        assert "pip install" not in said[0], said[0]  # it is installed: no advice to install it
    finally:
        undo()


@pytest.mark.parametrize("installed", [("mamba_ssm-no-conv",)], indirect=True)
def test_mamba_ssm_without_causal_conv1d_runs_the_ssd_only(installed):
    x = torch.zeros(2, dtype=torch.bfloat16)
    assert backends.resolve_recurrent_backend("mamba_ssm", "ssd", x) == "mamba_ssm"
    with pytest.raises(BackendUnavailableError, match="cannot run conv here: causal-conv1d is not installed"):
        backends.resolve_recurrent_backend("mamba_ssm", "conv", x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backends.resolve_recurrent_backend("auto", "conv", x) == "reference"
    assert len(fallback_warnings(caught)) == 1


@pytest.mark.parametrize("installed", [("fla-0.6", "mamba_ssm-main")], indirect=True)
def test_convolution_widths_outside_causal_conv1d_go_to_the_next_library(installed):
    x = torch.zeros(2, dtype=torch.bfloat16)
    for width in (1, 5):
        with pytest.raises(BackendUnavailableError, match=f"mamba_ssm takes convolution widths 2 to 4, got {width}"):
            backends.resolve_recurrent_backend("mamba_ssm", "conv", x, width)
        assert backends.resolve_recurrent_backend("auto", "conv", x, width) == "fla"
    assert backends.resolve_recurrent_backend("mamba_ssm", "conv", x, 4) == "mamba_ssm"


# ---------------------------------------------------------------- the libraries against the reference

def _gated_delta_both(backend, doc_lens, with_state, seed=0):
    """(out, final, gradients of q, k, v, g, beta, initial) of ``backend`` in float32."""
    q, k, v, g, beta = gdn_inputs(sum(doc_lens), heads=4, key_heads=2, dk=4, dv=3, dtype=torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    initial = torch.randn(len(doc_lens), 4, 4, 3, generator=gen) if with_state else torch.zeros(len(doc_lens), 4, 4, 3)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, g, beta, initial)]
    qn, kn = normalize_qk(inputs[0], inputs[1], 4, None, True)
    out, final = backends.gated_delta(qn, kn, *inputs[2:5], cu_of(doc_lens), inputs[5], 4, dtype=torch.float32,
                                      backend=backend)
    grad_out, grad_final = torch.randn(out.shape, generator=gen), torch.randn(final.shape, generator=gen)
    grads = torch.autograd.grad((out * grad_out).sum() + (final * grad_final).sum(), inputs)
    return out, final, grads


@pytest.mark.parametrize("installed", [("fla-0.6",), ("fla-0.5",), ("fla-0.4",)], indirect=True)
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_gated_delta_equals_the_reference(installed, with_state):
    got = _gated_delta_both("fla", DOC_LENS, with_state)
    want = _gated_delta_both("reference", DOC_LENS, with_state)
    assert got[1].dtype == torch.float32
    close(got[0], want[0], TOL, "out")
    close(got[1], want[1], TOL, "final state")
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial"), got[2], want[2]):
        close(a, b, TOL, f"d {name}")


def _ssd_both(backend, doc_lens, carried, seed=0):
    x, dt, A, B, C, _ = ssd_inputs(sum(doc_lens), dtype=torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    initial = torch.randn(len(doc_lens), 4, 3, 5, generator=gen) * torch.from_numpy(carried)[:, None, None, None]
    inputs = [t.clone().requires_grad_() for t in (x, dt, A, B, C, initial)]
    y, final = backends.ssd(*inputs[:5], cu_of(doc_lens), inputs[5], 4, carried=carried, backend=backend)
    mask = torch.from_numpy(carried).float()[:, None, None, None]  # finals of carried segments only are defined
    grad_out, grad_final = torch.randn(y.shape, generator=gen), torch.randn(final.shape, generator=gen) * mask
    # an initial state of a segment not carried is zero and unread (mamba_ssm): no gradient, or zeros
    grads = torch.autograd.grad((y * grad_out).sum() + (final * grad_final).sum(), inputs, allow_unused=True)
    grads = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads))
    grads = (*grads[:5], grads[5] * mask)
    return y, final * mask, grads


@pytest.mark.parametrize("installed", [("mamba_ssm-2.3",), ("mamba_ssm-main",)], indirect=True)
@pytest.mark.parametrize("carried", [(False, False, False, False), (True, False, True, True), (True,) * 4])
def test_mamba_ssm_ssd_equals_the_reference(installed, carried):
    carried = np.array(carried)
    got, want = _ssd_both("mamba_ssm", DOC_LENS, carried), _ssd_both("reference", DOC_LENS, carried)
    close(got[0], want[0], TOL, "y")
    close(got[1], want[1], TOL, "final states of the carried segments")
    for name, a, b in zip(("x", "dt", "A", "B", "C", "initial"), got[2], want[2]):
        close(a, b, TOL, f"d {name}")


@pytest.mark.parametrize("installed, backend", [(("fla-0.6",), "fla"), (("fla-0.5",), "fla"), (("fla-0.4",), "fla"),
                                                 (("mamba_ssm-2.3",), "mamba_ssm")], indirect=["installed"])
@pytest.mark.parametrize("features", [6, 16])  # causal-conv1d: channel-last only for multiples of 8
def test_library_convolutions_equal_the_reference(installed, backend, features):
    gen = torch.Generator().manual_seed(5)
    x, weight, bias = (torch.randn(sum(DOC_LENS), features, generator=gen), torch.randn(features, 4, generator=gen),
                       torch.randn(features, generator=gen))
    tails = torch.randn(len(DOC_LENS), 3, features, generator=gen)
    inputs = [t.requires_grad_() for t in (x, weight, bias, tails)]
    results = []
    for kernel in (backends.conv_kernel(backend, x, 4), None):
        y = causal_conv1d(inputs[0], inputs[1], inputs[2], cu_of(DOC_LENS), inputs[3], kernel=kernel)
        results.append((y, torch.autograd.grad(y.square().sum(), inputs)))
    close(results[0][0], results[1][0], TOL, "y")
    for name, a, b in zip(("x", "weight", "bias", "tails"), results[0][1], results[1][1]):
        close(a, b, TOL, f"d {name}")


def test_the_reference_records_convolution_equals_chunked():
    gen = torch.Generator().manual_seed(6)
    x, weight, bias = (torch.randn(sum(DOC_LENS), 5, generator=gen, dtype=torch.float64),
                       torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen,
                                                                                         dtype=torch.float64))
    tails = torch.randn(len(DOC_LENS), 2, 5, generator=gen, dtype=torch.float64)
    record = backends.LIBRARIES["reference"].conv
    got = causal_conv1d(x, weight, bias, cu_of(DOC_LENS), tails, kernel=lambda *a: record(None, *a))
    close(got, causal_conv1d(x, weight, bias, cu_of(DOC_LENS), tails), 1e-12, "y")


# ---------------------------------------------------------------- CP with the libraries on gloo

def _library_layers(meta):
    """kind -> (layer, conv, recurrence) of this rank, with ``fla`` for GDN and ``mamba_ssm`` for SSD."""
    return {"gdn": (gdn_layer, lambda x, w, b: cp_causal_conv1d(x, w, b, meta, backend="fla"),
                    lambda q, k, v, g, beta: cp_gated_delta_rule(q, k, v, g, beta, meta, backend="fla")),
            "ssd": (ssd_layer, lambda x, w, b: cp_causal_conv1d(x, w, b, meta, backend="mamba_ssm"),
                    lambda x, dt, A, B, C, D: cp_ssd(x, dt, A, B, C, meta, D_H=D, backend="mamba_ssm"))}


def _check_float32(name, plan, doc_lens, ref, rank, failures):
    """Forward and backward in float32 through the libraries against the float64 reference."""
    pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
    meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
    for kind, (data, params) in make_inputs(int(np.sum(doc_lens)), 0).items():
        layer, conv, recurrence = _library_layers(meta)[kind]
        want_out, want_grads, grad_out = ref[kind]
        local = [t.float()[pos].requires_grad_() for t in data]
        local_params = [t.float().requires_grad_() for t in params]
        out = layer(*local, *local_params, conv, recurrence)
        out.backward(grad_out.float()[pos])
        for p in local_params:
            torch.distributed.all_reduce(p.grad)
        checks = [("out", out, want_out[pos])]
        checks += [(f"d data{i}", t.grad, g[pos]) for i, (t, g) in enumerate(zip(local, want_grads))]
        checks += [(f"d param{i}", t.grad, g) for i, (t, g) in enumerate(zip(local_params, want_grads[len(data):]))]
        for what, got, want in checks:
            if want.numel() == 0:
                continue
            if got is None:
                failures.append(f"{name} {kind} rank {rank}: no gradient for {what}")
                continue
            err = (got.double() - want).abs()
            if err.max().item() >= 1e-4 * max(1.0, want.abs().max().item()):
                failures.append(f"{name} {kind} rank {rank} {what}: max |err| {err.max().item():.3g}, mean "
                                f"{err.mean().item():.3g}")


def _check_bf16(name, plan, doc_lens, ref, rank, failures):
    """bf16 through the libraries: error against float64 at most twice that of the same CP layers on the
    reference kernels (plus a rounding floor)."""
    pos = torch.from_numpy(rank_token_positions(plan, doc_lens, rank)[0])
    meta = RecurrentMeta.from_plan(plan, doc_lens, rank)
    for kind, (data, params) in make_inputs(int(np.sum(doc_lens)), 0).items():
        want = ref[kind][0]
        data, params = [t.bfloat16() for t in data], [t.bfloat16() for t in params]
        layer, conv, recurrence = _library_layers(meta)[kind]
        got = layer(*(t[pos] for t in data), *params, conv, recurrence).double()
        _, ref_conv, ref_recurrence = layers(doc_lens, meta)[kind]
        plain = layer(*(t[pos] for t in data), *params, ref_conv, ref_recurrence).double()
        if want.numel() == 0 or pos.numel() == 0:
            continue
        lib_err, ref_err = (got - want[pos]).abs().max().item(), (plain - want[pos]).abs().max().item()
        if lib_err > 2 * ref_err + 1e-2:
            failures.append(f"{name} {kind} bf16 rank {rank}: libraries' max |err| {lib_err:.3g} against float64, "
                            f"the reference kernels' {ref_err:.3g}")


def _cp_worker(rank, world_size, refs):
    undo = fake_recurrent.install("fla-0.5", "mamba_ssm-main")
    failures = []
    try:
        cases = build_cases(world_size)
        for case, ref in zip(cases, refs):
            _check_float32(*case, ref, rank, failures)
        _check_bf16(*cases[3], refs[3], rank, failures)  # one document over both ranks
    finally:
        undo()
    return failures


def test_cp_layers_with_the_emulated_libraries_match_the_reference_on_gloo():
    cases = build_cases(2)
    spawn(_cp_worker, 2, [reference(doc_lens) for _, _, doc_lens in cases])
