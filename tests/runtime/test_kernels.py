"""Every GPU kernel backend through its CPU emulation (tests/fake_kernels.py), one process.

The fakes enforce what the real kernels enforce and compute in float64; flashcp's calls through them are
compared with a float64 dense reference on the same bf16 inputs, the error bounded by twice that of a plain
bf16 implementation (as flash-attention's own tests do). Also: how ``auto`` chooses (compute capability,
dtype, head dim, a broken or old install) and what it says. The gloo runs of ``cp_attention`` through each
fake are in test_kernels_dist.py.
"""

import warnings

import numpy as np
import pytest
import torch

from flashcp.runtime import cp_attention
from flashcp.runtime.kernels import (
    BackendFallbackWarning,
    BackendUnavailableError,
    library,
    resolve_backend,
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
)
from flashcp.runtime.meta import rank_token_positions
from tests import fake_kernels
from tests.emulate import emulate_cp_attention, random_plan
from tests.fake_kernels import BACKEND_OF, FAKES
from tests.naive import naive_document_attention
from tests.runtime import TOL, dense, qkv

BLOCKWISE_FAKES = tuple(f for f in FAKES if f != "flash_attn-2.5")


@pytest.fixture
def installed(request):
    """Install the fakes named by the test's ``fakes`` parameter (a name or a tuple) on a 9.0 device."""
    undo = []

    def install(*names, capability=(9, 0), broken=None):
        undo.append(fake_kernels.install(*names, capability=capability, broken=broken))

    yield install
    for fn in reversed(undo):
        fn()


def cu(lengths):
    return torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32)


def bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def packed_dense(q, k, v, q_lens, k_lens, causal):
    cq, ck = np.r_[0, np.cumsum(q_lens)], np.r_[0, np.cumsum(k_lens)]
    pieces = [dense(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], causal) for i in range(len(q_lens))]
    return tuple(torch.cat(x) for x in zip(*pieces))


def errors(got, want):
    return [(a.double() - b.double()).abs().max().item() for a, b in zip(got, want)]


def assert_close(got, want, plain, what):
    errs = errors(got, want)
    bound = [2 * p + 1e-5 for p in errors(plain, want)]
    assert all(e <= b for e, b in zip(errs, bound)), f"{what}: max |err| {errs} above 2x plain bf16 {bound}"


CASE = dict(q_lens=[1, 3, 5, 1, 2], k_lens=[1, 7, 5, 4, 9])  # length-1 sequences, squares, longer prefixes


def inputs(heads, head_dim, seed=0):
    q_lens, k_lens = CASE["q_lens"], CASE["k_lens"]
    q = bf16(sum(q_lens), heads[0], head_dim, seed=seed)
    k = bf16(sum(k_lens), heads[1], head_dim, seed=seed + 1)
    v = bf16(sum(k_lens), heads[1], head_dim, seed=seed + 2)
    grad = bf16(sum(q_lens), heads[0], head_dim, seed=seed + 3)
    return q, k, v, grad, cu(q_lens), cu(k_lens), max(q_lens), max(k_lens)


def reference(q, k, v, grad, causal):
    """(out, lse, dq, dk, dv) in float64, and the same from a plain bf16 implementation."""
    results = []
    for dtype in (torch.float64, torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = packed_dense(*leaves, CASE["q_lens"], CASE["k_lens"], causal)
        results.append((out, lse, *torch.autograd.grad(out, leaves, grad.to(dtype))))
    return results


# ---------------------------------------------------------------- each fake, forward and backward

@pytest.mark.parametrize("heads, head_dim", [((4, 2), 16), ((4, 1), 12)])  # 12: padded to 16 (finding 3)
@pytest.mark.parametrize("fake", FAKES)
def test_varlen_attention_through_each_fake(fake, heads, head_dim, installed):
    installed(fake)
    q, k, v, grad, cq, ck, mq, mk = inputs(heads, head_dim)
    assert resolve_backend("auto", q) == BACKEND_OF[fake]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cq, ck, mq, mk, BACKEND_OF[fake])
    got = (out, *torch.autograd.grad(out, leaves, grad))
    (ref_out, _, *ref_grads), (plain_out, _, *plain_grads) = reference(q, k, v, grad, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert_close(got, (ref_out, *ref_grads), (plain_out, *plain_grads), f"{fake} H/K={heads} D={head_dim}")


@pytest.mark.parametrize("heads, head_dim, causal", [((4, 2), 16, True), ((4, 1), 12, False), ((4, 4), 12, True)])
@pytest.mark.parametrize("fake", BLOCKWISE_FAKES)
def test_blockwise_kernels_through_each_fake(fake, heads, head_dim, causal, installed):
    # flash_attn-2.8 (a torch.library.custom_op backward) is finding 1, head dim 12 finding 3
    installed(fake)
    q, k, v, grad, cq, ck, mq, mk = inputs(heads, head_dim)
    backend = BACKEND_OF[fake]
    assert resolve_backend("auto", q, blockwise=True) == backend
    (ref_out, ref_lse, *ref_grads), (plain_out, plain_lse, *plain_grads) = reference(q, k, v, grad, causal)
    out, lse = varlen_attention_forward(q, k, v, cq, ck, mq, mk, causal, backend)
    assert lse.shape == (q.shape[0], heads[0]) and lse.dtype == torch.float32
    assert_close((out, lse), (ref_out, ref_lse), (plain_out, plain_lse), f"{fake} forward")
    grads = varlen_attention_backward(grad, q, k, v, out, lse, cq, ck, mq, mk, causal, backend)
    assert all(g.shape == t.shape and g.dtype == torch.bfloat16 for g, t in zip(grads, (q, k, v)))
    assert_close(grads, ref_grads, plain_grads, f"{fake} backward causal={causal}")


@pytest.mark.parametrize("fake", BLOCKWISE_FAKES)
def test_blocks_merged_through_each_fake(fake, installed):
    # one query shard [6, 10) of a document, its keys in three blocks (its own causal, two earlier ones)
    from flashcp.runtime.ring import merge_partial

    installed(fake)
    backend = BACKEND_OF[fake]
    q, k, v = bf16(4, 4, 16, seed=5), bf16(10, 2, 16, seed=6), bf16(10, 2, 16, seed=7)
    grad = bf16(4, 4, 16, seed=8)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = dense(*leaves, causal=True)
    ref_grads = torch.autograd.grad(ref, leaves, grad.double())
    blocks = [(slice(6, 10), True), (slice(0, 2), False), (slice(2, 6), False)]
    out, lse = torch.zeros(4, 4, 16), torch.full((4, 4), float("-inf"))
    for keys, causal in blocks:
        n = keys.stop - keys.start
        block_out, block_lse = varlen_attention_forward(q, k[keys], v[keys], cu([4]), cu([n]), 4, n, causal, backend)
        merge_partial(out, lse, torch.arange(4), block_out, block_lse)
    dq, dk, dv = torch.zeros(4, 4, 16), torch.zeros(10, 2, 16), torch.zeros(10, 2, 16)
    for keys, causal in blocks:
        n = keys.stop - keys.start
        bq, bk, bv = varlen_attention_backward(grad, q, k[keys], v[keys], out.bfloat16(), lse, cu([4]), cu([n]), 4,
                                               n, causal, backend)
        dq += bq.float()
        dk[keys] += bk.float()
        dv[keys] += bv.float()
    errs = errors((out, dq, dk, dv), (ref, *ref_grads))
    assert max(errs) < 3e-2, f"{fake}: out, dq, dk, dv max |err| {errs}"


@pytest.mark.parametrize("comm", ["a2a", "ring"])
@pytest.mark.parametrize("fake", FAKES)
def test_emulated_cp_attention_through_each_fake(fake, comm, installed):
    installed(fake, "torch_varlen") if fake == "flash_attn-2.5" else installed(fake)
    rng = np.random.default_rng(7)
    doc_lens = np.array([9, 1, 14, 4])
    plan = random_plan(doc_lens, 3, rng, max_pieces=4, cut_prob=0.3)
    q, k, v = bf16(28, 4, 16, seed=1), bf16(28, 2, 16, seed=2), bf16(28, 2, 16, seed=3)
    grad = bf16(28, 4, 16, seed=4)
    results = []
    for dtype in (torch.float64, torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = naive_document_attention(*leaves, doc_lens)
        results.append((out, *torch.autograd.grad(out, leaves, grad.to(dtype))))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BackendFallbackWarning)  # 2.5 + ring: auto takes torch_varlen
        out = emulate_cp_attention(*leaves, plan, doc_lens, comm, "auto")
    got = (out, *torch.autograd.grad(out, leaves, grad))
    assert_close(got, results[0], results[1], f"{fake} {comm}")


# ---------------------------------------------------------------- what the fakes enforce

def test_fakes_refuse_what_the_kernels_refuse(installed):
    installed("flash_attn-2.8")
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward, flash_attn_varlen_func

    q, k, v, grad, cq, ck, mq, mk = inputs((4, 2), 16)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        flash_attn_varlen_func(q.float(), k.float(), v.float(), cq, ck, mq, mk)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        flash_attn_varlen_func(q, k, v, cq.long(), ck, mq, mk)
    with pytest.raises(RuntimeError, match="longer than max_seqlen"):
        flash_attn_varlen_func(q, k, v, cq, ck, mq - 1, mk)
    q12, k12, v12 = (t[..., :12] for t in (q, k, v))
    lse = torch.zeros(4, q.shape[0])
    dq, dk, dv = torch.empty_like(q12), torch.empty_like(k12), torch.empty_like(v12)
    with pytest.raises(RuntimeError, match="head_size should be a multiple of 8"):
        _flash_attn_varlen_backward(grad[..., :12].contiguous(), q12.contiguous(), k12.contiguous(),
                                    v12.contiguous(), q12.contiguous(), lse, dq, dk, dv, cq, ck, mq, mk, 0.0, 0.25,
                                    True, -1, 0, 0.0, None, False)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    grads[0] = torch.empty(q.shape[0], q.shape[1], 32, dtype=q.dtype)[..., ::2]  # strided last dim
    with pytest.raises(RuntimeError, match="dq must have contiguous last dimension"):
        _flash_attn_varlen_backward(grad, q, k, v, q, lse, *grads, cq, ck, mq, mk, 0.0, 0.25, True, -1, 0, 0.0,
                                    None, False)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be on CUDA .the device of q."):
        fake_kernels.check_varlen(q, k, v, cq.to("meta"), ck, mq, mk)


def test_custom_op_parameters_come_from_the_schema(installed):
    import inspect

    installed("flash_attn-2.8")
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    assert str(inspect.signature(_flash_attn_varlen_backward)) == "(*args, **kwargs)"  # what finding 1 read
    params = library.parameters(_flash_attn_varlen_backward)
    assert list(params)[:6] == ["dout", "q", "k", "v", "out", "softmax_lse"]
    assert params["dq"] and params["window_size_left"] and not params["zero_tensors"]

    def opaque(*args, **kwargs):
        return None

    with pytest.raises(BackendUnavailableError, match="declares no parameter names"):
        library.parameters(opaque)


# ---------------------------------------------------------------- how auto chooses, and what it says

def auto_choice(q, blockwise=False):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = resolve_backend("auto", q, blockwise=True) if blockwise else resolve_backend("auto", q)
    return choice, [str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)]


ALL = ("fa3", "fa4", "flash_attn-2.8", "torch_varlen")


@pytest.mark.parametrize("capability, names, want", [
    ((9, 0), ALL, "fa3"),  # Hopper: FA3 first
    ((9, 0), ("fa4", "flash_attn-2.8", "torch_varlen"), "fa4"),
    ((10, 0), ALL, "fa4"),  # Blackwell: FA4 (FA3 is not tried)
    ((8, 0), ALL, "flash_attn"),  # Ampere: FA2
    ((8, 0), ("fa4", "torch_varlen"), "torch_varlen"),  # below Hopper auto does not try FA3/FA4
    ((9, 0), ("torch_varlen",), "torch_varlen"),
])
def test_auto_order(capability, names, want, installed):
    installed(*names, capability=capability)
    q = torch.zeros(3, 4, 128, dtype=torch.bfloat16)
    assert auto_choice(q) == (want, [])  # nothing installed was passed over: nothing to say
    assert auto_choice(q, blockwise=True) == (want, [])


def test_auto_on_cpu_is_the_reference_kernel_silently():
    q = torch.zeros(3, 4, 128, dtype=torch.bfloat16)
    assert auto_choice(q) == ("reference", [])
    assert auto_choice(q.float(), blockwise=True) == ("reference", [])


def test_broken_install_is_skipped_with_one_warning(installed):
    # finding 2: a wheel built for another torch raises ImportError on import
    error = ImportError("flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c104cuda9SetDevice")
    installed("torch_varlen", broken={"flash_attn": error})
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    choice, said = auto_choice(q)
    assert choice == "torch_varlen"
    assert len(said) == 1 and "flash_attn is installed but does not import (ImportError: " in said[0]
    assert auto_choice(q) == ("torch_varlen", [])  # said once
    with pytest.raises(BackendUnavailableError, match="'flash_attn' cannot run here: flash_attn is installed but "
                                                      "does not import .*undefined symbol"):
        resolve_backend("flash_attn", q)


def test_fa4_alone_leaves_flash_attn_not_installed(installed):
    installed("fa4", "torch_varlen", capability=(8, 0))  # flash_attn is then a namespace package
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="flash-attn .FlashAttention-2. is not installed"):
        resolve_backend("flash_attn", q)
    with pytest.raises(BackendUnavailableError, match="fa4 needs compute capability 9.0 or newer"):
        resolve_backend("fa4", q)


def test_head_dims_past_the_kernels_are_refused_or_passed_over(installed):
    # finding 3: D > 256 fits no GPU kernel; FA4 on Blackwell takes up to 128 (or exactly 256)
    installed("flash_attn-2.8", "fa4", "torch_varlen", capability=(10, 0))
    with pytest.raises(BackendUnavailableError, match="does not support head dim 320"):
        resolve_backend("flash_attn", torch.zeros(2, 2, 320, dtype=torch.bfloat16))
    choice, said = auto_choice(torch.zeros(2, 2, 192, dtype=torch.bfloat16))
    assert choice == "flash_attn" and len(said) == 1 and "skipped fa4 does not support head dim 192" in said[0]
    choice, said = auto_choice(torch.zeros(2, 2, 320, dtype=torch.bfloat16))
    assert choice == "reference" and len(said) == 1 and "running the reference kernel" in said[0]


def test_old_padded_lse_falls_back_for_blockwise(installed):
    # finding 4: flash-attn 2.5 returns the padded (B, H, max_seqlen) LSE
    installed("flash_attn-2.5", "torch_varlen")
    q = torch.zeros(3, 4, 64, dtype=torch.bfloat16)
    assert auto_choice(q) == ("flash_attn", [])  # the differentiable call does not need the LSE
    choice, said = auto_choice(q, blockwise=True)
    assert choice == "torch_varlen" and len(said) == 1
    assert "flash-attn 2.5.9.post1 returns the padded (B, H, max_seqlen) log-sum-exp" in said[0]
    with pytest.raises(BackendUnavailableError, match="needs 2.6 or newer"):
        varlen_attention_forward(q, q, q, cu([3]), cu([3]), 3, 3, True, "flash_attn")


def test_float32_on_a_gpu_warns_once_and_runs_the_reference(installed):
    # finding 5: float32 CUDA tensors fit no GPU kernel
    from flashcp.runtime.meta import CPAttnMeta

    installed("flash_attn-2.8", "torch_varlen")
    doc_lens = np.array([5, 3])
    plan = random_plan(doc_lens, 1, np.random.default_rng(0))
    meta = CPAttnMeta.from_plan(plan, doc_lens, 0)
    q, k, v = (torch.randn(8, h, 16) for h in (4, 2, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cp_attention(q, k, v, meta)
        cp_attention(q, k, v, meta)
    said = [str(w.message) for w in caught if issubclass(w.category, BackendFallbackWarning)]
    assert len(said) == 1 and "no GPU kernel for torch.float32 tensors" in said[0], said
    assert "(flash_attn needs float16 or bfloat16, got torch.float32; torch_varlen needs" in said[0]
    pos = torch.from_numpy(rank_token_positions(plan, doc_lens, 0)[0])  # the rank's local order
    ref = naive_document_attention(*(t[torch.argsort(pos)] for t in (q, k, v)), doc_lens)
    assert (out - ref[pos]).abs().max().item() < 1e-5
    assert resolve_backend("reference", q) == "reference"  # asked for by name: no warning needed


def test_training_defaults_to_bfloat16_on_cuda():
    import importlib.util
    from pathlib import Path

    from flashcp.train import loop

    assert loop.TrainOptions(data="d", plan="p", steps=1).dtype is None  # resolved per device by run_training
    assert loop.default_dtype("cuda:0") == "bfloat16" and loop.default_dtype("cpu") == "float32"
    path = Path(__file__).resolve().parents[2] / "examples" / "train_tiny.py"
    spec = importlib.util.spec_from_file_location("train_tiny", path)
    train_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tiny)
    assert train_tiny.parse_args(["DATA", "--plan", "cp2-x"]).dtype is None


def test_reference_kernel_is_bottom_right_causal():
    # one query shard [3, 5) of a 5-token document: its rows of full causal attention over keys [0, 5)
    q, k, v = qkv(5, 4, 2)
    full = naive_document_attention(q, k, v, [5])
    out = varlen_attention(q[3:], k, v, torch.tensor([0, 2], dtype=torch.int32),
                           torch.tensor([0, 5], dtype=torch.int32), 2, 5, "reference")
    assert (out - full[3:]).abs().max().item() < TOL


def test_backend_resolution_on_cpu():
    q = torch.zeros(2, 2, 4)
    assert resolve_backend("auto", q) == "reference"
    for backend in ("flash_attn", "torch_varlen"):
        with pytest.raises(BackendUnavailableError, match=f"'{backend}' cannot run here: .*CUDA"):
            resolve_backend(backend, q)
    with pytest.raises(BackendUnavailableError, match="unknown backend 'flash'"):
        resolve_backend("flash", q)
