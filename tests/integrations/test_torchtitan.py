"""torchtitan's Llama3 and Qwen3 trained with flashcp CP on gloo ranks equal one process on the same global batches.

The models are torchtitan's ``debugmodel`` flavors rebuilt small by torchtitan's own layer builders (2 layers,
width 32, 4 heads, 2 KV heads, vocabulary 64, context 512), in float64, with their inner attention replaced
by ``CPInnerAttention``. One spawn of 2 ranks (CP 2: replicated weights, and FSDP2 over cp) and one of 4 ranks
(``dp_shard`` 2 x CP 2 with torchtitan's FSDP2 over ``dp_shard x cp``, and ``dp_replicate`` 2 x CP 2: HSDP)
train, for the ``flashcp2`` and ``llama3`` plans and comm ``a2a`` and ``allgather`` (the architecture rotating
over the cases), 3 AdamW steps with ``flashcp.train.train_step`` and torchtitan's CrossEntropyLoss; the losses
and parameters must equal 3 single-process steps of the same model on the same global batches (the next
``dp`` sequences of the stream each step; torchtitan's model on whole sequences with a dense document-masked
attention; loss = summed token losses / the global batch's label tokens). Everything is float64 except what
torchtitan computes in float32 whatever the model dtype: the RoPE rotation (``q.float()``) and the
cross-entropy (``pred.float()``, a float32 sum). So the losses are float32 numbers, and CP sums each rank's
float32 partial sum where one process sums all tokens at once: they agree to float32 rounding,
``LOSS_RTOL`` = 4 float32 epsilons relative (1 to 2 ulps seen). Parameters: ``PARAM_TOL`` = 1e-8 absolute
(about 1e-14 seen; the margin covers a float32 RoPE rounding that float64 noise could flip on another
platform). The errors are in the failure messages. The 4-rank spawn also runs flashcp's loop
(``--model titan-llama3``, FSDP2) with a checkpoint and resume, and checks the mesh refusals; the 2-rank one
builds a model sharded on the meta device (only the shards materialised) and checks its initial weights.

Without a process group: the swapped model, given a whole sequence on one rank (a cp-1 plan), equals
torchtitan's own FlexAttention model with its causal document BlockMask built from the positions
(``Decoder.get_attention_masks``). On CPU FlexAttention runs forward only (torch raises "FlexAttention does
not support backward on CPU") and its compiled kernel takes tens of seconds to build, so it runs eagerly here
(``torch.compiler.set_stance("force_eager")``: torch's unfused FlexAttention, the same mask); torchtitan's
VarlenAttention needs CUDA.
"""

from __future__ import annotations

import warnings
from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan")

from torch import nn  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.config import ParallelismConfig  # noqa: E402
from torchtitan.tools.utils import set_default_dtype  # noqa: E402

from flashcp.errors import FlashcpError  # noqa: E402
from flashcp.integrations.models import build_model  # noqa: E402
from flashcp.integrations.torchtitan import (  # noqa: E402
    CPInnerAttention,
    TitanMeshes,
    apply_cp_attention,
    build_titan_model,
    shard_titan_model,
    titan_loss_sum,
    titan_model_config,
)
from flashcp.planner.planning import plan_sequence  # noqa: E402
from flashcp.runtime import CPAttention, CPAttnMeta, CPLoader  # noqa: E402
from flashcp.train.loop import TrainOptions, run_training  # noqa: E402
from flashcp.train.parallel import full_parameters  # noqa: E402
from tests.dist import spawn  # noqa: E402
from tests.equivalence import (  # noqa: E402
    Reference,
    equivalence_failure,
    global_batch_training,
    loss_error,
    max_difference,
    planned_dataset,
    refusal_failures,
    stream_batches,
    train_steps,
)
from tests.naive import naive_document_attention  # noqa: E402

CONTEXT, NUM_SEQS, STEPS = 512, 4, 3
VOCAB, DIM, LAYERS, HEADS, KV_HEADS = 64, 32, 2, 4, 2
SHAPE = dict(vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
             ffn_dim=2 * DIM, max_seq_len=CONTEXT)  # ffn 2 x dim: what flashcp's loop builds
LR, SEED = 1e-2, 5
LOSS_RTOL, PARAM_TOL = 4 * torch.finfo(torch.float32).eps, 1e-8
ARCHS = ("llama3", "qwen3")
STRATEGIES = ("flashcp2", "llama3")
COMMS = ("a2a", "allgather")
TITAN_LOSS = CrossEntropyLoss.Config().build()
MESHES = {  # world size -> (label, torchtitan parallelism degrees, sharding)
    2: (("cp2", dict(context_parallel_degree=2, data_parallel_shard_degree=1), "replicate"),
        ("cp2 fsdp", dict(context_parallel_degree=2, data_parallel_shard_degree=1), "fsdp")),
    4: (("dp_shard2 x cp2 fsdp", dict(context_parallel_degree=2, data_parallel_shard_degree=2), "fsdp"),
        ("dp_replicate2 x cp2 hsdp", dict(context_parallel_degree=2, data_parallel_shard_degree=1,
                                          data_parallel_replicate_degree=2), "fsdp")),
}


def make_model(arch: str, attn_backend: str = "flex") -> nn.Module:
    """The float64 model every rank and the reference start from (same seed, same weights)."""
    torch.manual_seed(SEED)
    return build_titan_model(titan_model_config(arch, attn_backend=attn_backend, **SHAPE), dtype=torch.float64)


class DenseDocumentAttention(nn.Module):
    """Reference inner attention: dense attention with a document-causal mask over the whole sequence."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, **kwargs):
        return naive_document_attention(q_BLNH[0], k_BLNH[0], v_BLNH[0], attention_masks, scale)[None]


def titan_forward_loss(model, ids, positions, labels, doc_lens):
    """torchtitan's model on one whole sequence (dense document-masked attention) and torchtitan's loss, summed."""
    pred = model(ids[None], positions=positions[None], attention_masks=doc_lens)
    return TITAN_LOSS(pred, labels[None])[0]


def reference_training(arch: str, sequences, dp: int) -> Reference:
    """One process: step s on the stream's sequences [s*dp, (s+1)*dp); torchtitan's model and loss."""
    model = make_model(arch)
    for layer in model.layers.values():
        layer.attention.inner_attention = DenseDocumentAttention()
    return global_batch_training(model, titan_forward_loss, stream_batches(sequences, dp, STEPS), vocab_size=VOCAB,
                                 lr=LR, weight_decay=0.0)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan") / "data"
    plans = {f"cp2-{strategy}": (partial(plan_sequence, strategy), 2) for strategy in STRATEGIES}
    # row 1: one-token documents and one document over every rank
    sequences = planned_dataset(root, CONTEXT, plans, seed=8, num_seqs=NUM_SEQS, cuts=(2, 7),
                                fixed_rows={1: np.r_[1, 1, CONTEXT - 3, 1]}, row_group_rows=2)
    references = {(dp, arch): reference_training(arch, sequences, dp) for dp in (1, 2) for arch in ARCHS}
    return str(root), references


def _train(model, optimizer, loader, meshes, comm, steps):
    return train_steps(model, optimizer, loader, titan_loss_sum, steps=steps, vocab_size=VOCAB, groups=meshes.groups,
                       comm=comm)


def _worker(rank, world, root, references, ckpt_dir):
    failures = []
    for m, (label, degrees, sharding) in enumerate(MESHES[world]):
        meshes = TitanMeshes.from_parallelism(ParallelismConfig(**degrees))
        for i, (strategy, comm) in enumerate((s, c) for s in STRATEGIES for c in COMMS):
            arch = ARCHS[(i + m) % len(ARCHS)]
            model = make_model(arch)
            if sharding == "fsdp":
                model = shard_titan_model(model, meshes)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
            loader = CPLoader.from_mesh(root, f"cp2-{strategy}", meshes.mesh, shuffle=False, balance_window=0)
            losses = _train(model, optimizer, loader, meshes, comm, STEPS)
            failures += equivalence_failure(f"{label} {arch} plan={strategy} comm={comm}", losses,
                                            full_parameters(model), references[meshes.groups.dp_size, arch],
                                            loss_tol=LOSS_RTOL, param_tol=PARAM_TOL, relative=True)
    if world == 2:
        failures += _sharded_build_checks(root, references)
    if world == 4:
        failures += _loop_checks(root, references, ckpt_dir)
        failures += _refusals(root)
    return failures


def _sharded_build_checks(root, references):
    """``build_titan_model(..., meshes=)`` wraps on meta and initialises only the shards: torchtitan's
    initialisers then draw on each shard, so the weights follow the unsharded build's distribution (per-tensor
    mean and spread), the ranks' shards differ, and the losses stay within 5% of the unsharded draw's."""
    failures = []
    meshes = TitanMeshes.from_parallelism(ParallelismConfig(context_parallel_degree=2))
    torch.manual_seed(SEED)
    model = build_titan_model(titan_model_config("qwen3", **SHAPE), dtype=torch.float64, meshes=meshes)
    got, unsharded = full_parameters(model), dict(make_model("qwen3").named_parameters())
    for name, full in got.items():
        ref = unsharded[name]
        spread = float(ref.std())  # two draws of n values: means differ by ~spread*sqrt(2/n), spreads by ~3%
        if abs(full.mean() - ref.mean()) > 5 * spread * (2 / ref.numel()) ** 0.5 + 1e-12 or \
                abs(full.std() - ref.std()) > 0.15 * spread:
            failures.append(f"meta-sharded {name}: mean {full.mean():.3g}, std {full.std():.3g}; unsharded "
                            f"mean {ref.mean():.3g}, std {ref.std():.3g}")
    qkv = got["layers.0.attention.qkv_linear.wqkv.weight"]
    if torch.equal(qkv[: qkv.shape[0] // 2], qkv[qkv.shape[0] // 2:]):
        failures.append("meta-sharded: both ranks drew the same shard of wqkv")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    loader = CPLoader.from_mesh(root, "cp2-flashcp2", meshes.mesh, shuffle=False, balance_window=0)
    losses = _train(model, optimizer, loader, meshes, "a2a", STEPS)
    ref_losses = references[1, "qwen3"].losses  # same data, the unsharded draw's weights
    if not all(abs(a - b) < 0.05 * b for a, b in zip(losses, ref_losses, strict=True)):
        failures.append(f"meta-sharded model: losses {losses}, unsharded draw {ref_losses}")
    return failures


def _loop_checks(root, references, ckpt_dir):
    """flashcp's loop with ``--model titan-llama3`` on dp 2 x cp 2, FSDP2 (torchtitan's wrapping): 2 steps and a
    checkpoint, then a resume to step 3, give the reference's losses."""
    failures = []
    options = dict(data=root, plan="cp2-flashcp2", model="titan-llama3", dtype="float64", vocab_size=VOCAB,
                   dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, lr=LR, seed=SEED, dp=2,
                   sharding="fsdp", comm="a2a", shuffle=False, prefetch=0, ckpt=f"{ckpt_dir}/titan",
                   balance_window=0)
    first = run_training(TrainOptions(**options, steps=2), build_model=build_model)
    second = run_training(TrainOptions(**options, steps=3, resume=True), build_model=build_model)
    losses = [s.loss for s in first + second]
    err = loss_error(losses, references[2, "llama3"].losses, relative=True)
    if [s.step for s in first + second] != [1, 2, 3] or not err <= LOSS_RTOL:
        failures.append(f"loop titan-llama3 steps {[s.step for s in first + second]}, max rel loss err {err:.2e}")
    return failures


def _refusals(root):
    return refusal_failures([
        (lambda: TitanMeshes.from_parallelism(ParallelismConfig(tensor_parallel_degree=2)),
         ValueError, "flashcp trains with data and context parallelism only, got tensor parallel degree 2"),
        (lambda: TitanMeshes.from_parallelism(ParallelismConfig(context_parallel_degree=3)),
         ValueError, "torchtitan's parallel degrees do not fit 4 ranks"),
        (lambda: CPLoader.from_mesh(root, "cp2-llama3", TitanMeshes.from_parallelism(
            ParallelismConfig(context_parallel_degree=4)).mesh),
         FlashcpError, "plan 'cp2-llama3' was made for cp 2 but the device mesh's 'cp' dimension has 4 ranks")])


@pytest.mark.parametrize("world", sorted(MESHES))
def test_torchtitan_models_with_cp_equal_one_process_on_the_global_batch(planned, tmp_path, world):
    root, references = planned
    spawn(_worker, world, root, references, str(tmp_path), start_method="fork")


def test_the_global_batches_differ_between_dp_sizes(planned):
    # dp 1 and dp 2 train on other global batches: equal numbers above are not equal by accident
    _, references = planned
    for arch in ARCHS:
        assert max_difference(references[1, arch].params, references[2, arch].params) > 1e-4, arch


def _whole_sequence(seed: int = 0):
    rng = np.random.default_rng(seed)
    doc_lens = np.r_[1, 130, 7, 200, 3, CONTEXT - 341]
    tokens = torch.as_tensor(rng.integers(0, VOCAB, size=(1, CONTEXT)))
    positions = torch.cat([torch.arange(n) for n in doc_lens])[None]
    return doc_lens, tokens, positions


@pytest.mark.parametrize("arch", ARCHS)
def test_swapped_model_on_one_rank_equals_torchtitans_flex_document_attention(arch):
    torch.manual_seed(SEED)
    config = titan_model_config(arch, attn_backend="flex", **SHAPE)
    with torch.device("meta"), set_default_dtype(torch.float64):
        model = config.build()  # torchtitan's own model, FlexAttention inside
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    doc_lens, tokens, positions = _whole_sequence()
    with torch.no_grad(), torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": on purpose
        expected = model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions))
    assert apply_cp_attention(model) == LAYERS
    meta = CPAttnMeta.from_plan(plan_sequence("llama3", doc_lens, 1), doc_lens, 0)
    with torch.no_grad():
        got = model(tokens, positions=positions, attention_masks=CPAttention(meta=meta))
    err = (got - expected).abs().max().item()
    assert err < 1e-12, f"{arch}: max |logit err| {err:.2e} (mean {(got - expected).abs().mean().item():.2e})"


def test_the_transform_refuses_what_it_cannot_serve():
    model = make_model("llama3", attn_backend="varlen")
    assert all(isinstance(layer.attention.inner_attention, CPInnerAttention) for layer in model.layers.values())
    assert model.layers["0"].attention.inner_attention.replaced == "VarlenAttention"
    assert apply_cp_attention(model) == LAYERS  # idempotent
    _, tokens, positions = _whole_sequence()
    with pytest.raises(ValueError, match="takes the batch's CPAttention as attention_masks, got NoneType"):
        model(tokens, positions=positions)
    with pytest.raises(ValueError, match=r"got a Linear \(torch.nn.modules.linear\)"):
        apply_cp_attention(nn.Linear(2, 2))
    torch.manual_seed(SEED)
    config = titan_model_config("llama3", attn_backend="varlen", **SHAPE)
    with torch.device("meta"):
        windowed = config.build()
    windowed.layers["1"].attention.inner_attention.window_size = (128, 1)  # sees a token ahead: not causal
    with pytest.raises(ValueError, match=r"layers.1.attention.inner_attention has window_size \(128, 1\); flashcp "
                                         r"computes causal attention"):
        apply_cp_attention(windowed)
    from torchtitan.models.deepseek_v3 import deepseekv3_configs
    from torchtitan.models.gpt_oss import gptoss_configs

    for configs, name, window in [(gptoss_configs, "GptOssModel", ", whose layer layers.0.attention has a sliding "
                                                                  "window of 128 tokens"),
                                  (deepseekv3_configs, "DeepSeekV3Model", "")]:
        with torch.device("meta"):  # sinks and sliding windows; latent attention
            other = configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard").build()
        with pytest.raises(ValueError, match=f"got a {name} \\([a-z0-9_.]+\\){window}; its layers are not "
                                             "verified to be plain causal attention"):
            apply_cp_attention(other)
    inner = model.layers["0"].attention.inner_attention
    q = torch.zeros(1, 4, 2, 8)
    meta = CPAttnMeta.from_plan(plan_sequence("llama3", np.array([4]), 1), np.array([4]), 0)
    with pytest.raises(ValueError, match=r"cannot honour the inner-attention arguments \['sinks'\]"):
        inner(q, q, q, attention_masks=CPAttention(meta=meta), sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="unknown torchtitan architecture 'gpt2'"):
        titan_model_config("gpt2")
    with pytest.raises(ValueError, match="torchtitan qwen3 has no flavor '7B'"):
        titan_model_config("qwen3", "7B")
    with pytest.raises(ValueError, match="'debugmodel_moe' is a mixture-of-experts flavor"):
        titan_model_config("qwen3", "debugmodel_moe", num_layers=2)


class _DenseDocumentAttention(nn.Module):
    """A torchtitan inner attention computing ``tests.naive`` dense document attention with a window."""

    def __init__(self, doc_lens, window):
        super().__init__()
        self.doc_lens, self.window = doc_lens, window

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, scale=None, **_):
        return naive_document_attention(q_BLNH[0], k_BLNH[0], v_BLNH[0], self.doc_lens, scale=scale,
                                        window=self.window)[None]


def test_a_varlen_layer_with_a_sliding_window_runs_cp_attention_with_it():
    torch.manual_seed(SEED)
    config = titan_model_config("llama3", attn_backend="varlen", **SHAPE)
    with torch.device("meta"), set_default_dtype(torch.float64):
        model = config.build()
    model.layers["1"].attention.inner_attention.window_size = (2, 0)  # torchtitan's window of 3 tokens
    assert apply_cp_attention(model) == LAYERS
    assert [layer.attention.inner_attention.window for layer in model.layers.values()] == [None, 3]
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    doc_lens, tokens, positions = _whole_sequence()
    meta = CPAttnMeta.from_plan(plan_sequence("llama3", doc_lens, 1), doc_lens, 0)
    logits = {}
    with torch.no_grad():
        logits["cp"] = model(tokens, positions=positions, attention_masks=CPAttention(meta=meta))
        for name, windows in (("dense", (None, 3)), ("no window", (None, None))):
            for layer, window in zip(model.layers.values(), windows):
                layer.attention.inner_attention = _DenseDocumentAttention(doc_lens, window)
            logits[name] = model(tokens, positions=positions)
    err = (logits["cp"] - logits["dense"]).abs().max().item()
    assert err < 1e-12, f"max |logit err| {err:.2e} against dense attention with layer 1's window"
    assert (logits["dense"] - logits["no window"]).abs().max() > 1e-3  # the window mattered
