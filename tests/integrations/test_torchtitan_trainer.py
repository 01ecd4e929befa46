"""torchtitan's own trainer with flashcp switched on (``--module flashcp.integrations.torchtitan_trainer``).

torchtitan's ``Trainer.__init__`` needs an accelerator (``torch.cuda.set_device`` first; ``ParallelDims`` builds
its meshes on ``torchtitan.tools.utils.device_type``, ``cuda`` without one), so on CPU the test builds each part
the way ``__init__`` builds it and then runs torchtitan's own step code:

- config only: the command line a user types parses (torchtitan's ``ConfigManager``) into a
  ``FlashcpTrainer.Config`` that builds a ``FlashcpTrainer``; what flashcp cannot run is refused in one sentence.
- 2 gloo ranks, CP 2: ``ParallelDims`` from the config (its meshes on ``cpu``: the one patch, of torchtitan's
  device name), the model from the config on the meta device through ``parallelize_flashcp`` (torchtitan's
  SelectiveAC and FSDP2 over ``dp_shard x cp``), the dataloader from ``config.dataloader.build(...)`` with the
  arguments the trainer passes (each rank's batches equal ``CPLoader.from_mesh``'s), torchtitan's optimizer,
  schedule and loss from the config; then 3 calls of torchtitan's ``Trainer.train_step`` (its batch generator,
  label count, ``forward_backward_step`` -> flashcp's overrides -> torchtitan's forward/backward body, gradient
  clipping, optimizer and schedule, metrics) on a ``FlashcpTrainer`` holding those parts. Its logged losses
  (average and, with one replica, max) and final parameters must equal 3 steps of flashcp's own ``train_step``
  on the same weights and data (replicated model, the same torchtitan optimizer and schedule, clipping at
  ``training.max_norm``). Then torchtitan's ``CheckpointManager`` saves those parts with a dataloader in its
  second epoch, and a new dataloader loaded from the checkpoint reads the batches the first would have read.
- 4 gloo ranks, DP 2 x CP 2: the max loss ``FlashcpTrainer`` logs is the larger of the two replicas' summed token
  losses over their label tokens, from given per-rank sums.

The model is torchtitan's Llama3 ``debugmodel`` rebuilt small (2 layers, width 32, vocabulary 64, context 512) in
float64: torchtitan's dtype names stop at float32, so the test adds ``float64`` to ``TORCH_DTYPE_MAP`` for FSDP's
mixed-precision policy. Tolerances as in ``test_torchtitan.py`` (RoPE and the cross-entropy run in float32 in
torchtitan whatever the model dtype): losses to 4 float32 epsilons relative, parameters to 1e-8.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager  # noqa: E402
from torchtitan.tools.utils import set_default_dtype  # noqa: E402

from flashcp.integrations.torchtitan import (  # noqa: E402
    CPInnerAttention,
    TitanMeshes,
    build_titan_model,
    titan_loss_sum,
    titan_model_config,
)
from flashcp.integrations.torchtitan_trainer import (  # noqa: E402
    FlashcpDataLoader,
    FlashcpOptions,
    FlashcpTrainer,
    flashcp_llama3_debugmodel,
    flashcp_trainer_config,
    parallelize_flashcp,
)
from flashcp.planner.planning import plan_sequence  # noqa: E402
from flashcp.runtime import CPLoader  # noqa: E402
from flashcp.train.parallel import full_parameters  # noqa: E402
from flashcp.train.step import train_step  # noqa: E402
from tests.dist import spawn  # noqa: E402
from tests.equivalence import planned_dataset  # noqa: E402

CONTEXT, NUM_SEQS, STEPS, SEED = 512, 4, 3, 5
VOCAB, DIM, LAYERS, HEADS, KV_HEADS = 64, 32, 2, 4, 2
SHAPE = dict(vocab_size=VOCAB, dim=DIM, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
             ffn_dim=2 * DIM, max_seq_len=CONTEXT)
LOSS_RTOL, PARAM_TOL = 4 * torch.finfo(torch.float32).eps, 1e-8
MODULE = "flashcp.integrations.torchtitan_trainer"
AC_PREFIX = "_checkpoint_wrapped_module."


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan_trainer") / "data"
    planned_dataset(root, CONTEXT, {"cp2-flashcp2": (partial(plan_sequence, "flashcp2"), 2)}, seed=3,
                    num_seqs=NUM_SEQS, cuts=(2, 7), row_group_rows=2, vocab_size=VOCAB)
    return str(root)


def tiny_config(data_dir: str, comm: str = "a2a") -> FlashcpTrainer.Config:
    """``flashcp_llama3_debugmodel`` at the test's size: CP 2, float64, torchtitan's plain cross-entropy."""
    config = flashcp_llama3_debugmodel()
    spec = dataclasses.replace(config.model_spec, model=titan_model_config("llama3", **SHAPE))
    return dataclasses.replace(
        config, model_spec=spec, loss=CrossEntropyLoss.Config(),
        dataloader=FlashcpDataLoader.Config(data_dir=data_dir, plan="cp2-flashcp2", shuffle=False,
                                            balance_window=0),
        parallelism=dataclasses.replace(config.parallelism, context_parallel_degree=2),
        training=dataclasses.replace(config.training, seq_len=CONTEXT, steps=STEPS, mixed_precision_param="float64",
                                     mixed_precision_reduce="float64"),
        flashcp=FlashcpOptions(comm=comm))


def test_the_command_line_builds_a_flashcp_trainer_config():
    config = ConfigManager().parse_args([
        "--module", MODULE, "--config", "flashcp_llama3_debugmodel", "--dataloader.data_dir", "DATA",
        "--dataloader.plan", "cp8-flashcp2", "--parallelism.context_parallel_degree", "8", "--flashcp.comm", "a2a",
        "--training.seq_len", "4096"])
    assert type(config) is FlashcpTrainer.Config and config._owner is FlashcpTrainer
    assert (config.dataloader.data_dir, config.dataloader.plan) == ("DATA", "cp8-flashcp2")
    assert config.parallelism.context_parallel_degree == 8 and config.flashcp.comm == "a2a"
    assert config.model_spec.parallelize_fn is parallelize_flashcp and config.model_spec.pipelining_fn is None
    assert config.training.local_batch_size == 1 and config.parallelism.spmd_backend == "partial_dtensor"
    assert not config.validator.enable and config.training.seq_len == 4096


def test_the_example_registry_parses():
    config = ConfigManager().parse_args(["--module", "examples.torchtitan_flashcp", "--config", "tiny",
                                         "--dataloader.data_dir", "DATA", "--dataloader.plan", "cp2-flashcp2"])
    assert type(config) is FlashcpTrainer.Config and config.training.seq_len == 2048
    assert config.dataloader.plan == "cp2-flashcp2" and not config.checkpoint.enable
    big = ConfigManager().parse_args(["--module", "examples.torchtitan_flashcp", "--config", "llama3_8b_128k",
                                      "--dataloader.data_dir", "DATA"])
    assert type(big) is FlashcpTrainer.Config and big.dataloader.plan == "cp8-flashcp2"
    assert big.parallelism.context_parallel_degree == 8 and big.training.seq_len == 131072
    assert {layer.attention.rope.max_seq_len for layer in big.model_spec.model.layers} == {131072}


def test_the_dataloader_refuses_what_it_cannot_feed(data_dir):
    loader = FlashcpDataLoader.Config(data_dir=data_dir, plan="cp2-flashcp2")
    with pytest.raises(ValueError, match="got training.local_batch_size 8; set it to 1"):
        loader.build(dp_world_size=1, dp_rank=0, seq_len=CONTEXT, local_batch_size=8)
    with pytest.raises(ValueError, match="pass --dataloader.data_dir DATA"):
        FlashcpDataLoader.Config().build(dp_world_size=1, dp_rank=0, seq_len=CONTEXT, local_batch_size=1)


@pytest.mark.parametrize("change, message", [
    (dict(parallelism=dict(tensor_parallel_degree=2)), "data and context parallelism only, got tensor parallel"),
    (dict(parallelism=dict(spmd_backend="spmd_types")), "runs torchtitan's 'partial_dtensor' SPMD backend"),
    (dict(training=dict(disable_cuda_graphs=False)), "set --training.disable_cuda_graphs"),
])
def test_the_config_refuses_what_flashcp_does_not_run(change, message):
    config = flashcp_llama3_debugmodel()
    section, values = next(iter(change.items()))
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)})
    with pytest.raises(ValueError, match="flashcp.comm is 'ring2'"):
        FlashcpOptions(comm="ring2")
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    with pytest.raises(ValueError, match="got the dataloader HuggingFaceTextDataLoader.Config"):
        dataclasses.replace(flashcp_trainer_config(llama3_debugmodel()), dataloader=llama3_debugmodel().dataloader)


class _Metrics:
    """What ``Trainer.train_step`` asks of torchtitan's ``MetricsProcessor`` (which needs a device monitor)."""

    def __init__(self):
        self.ntokens_since_last_log, self.data_loading_times, self.losses, self.max_losses = 0, [], [], []

    def should_log(self, step):
        return True

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.losses.append(global_avg_loss)
        self.max_losses.append(global_max_loss)


class _Checkpointer:
    def maybe_wait_for_staging(self):
        pass


def titan_trainer(config: FlashcpTrainer.Config, parallel_dims, model) -> FlashcpTrainer:
    """A ``FlashcpTrainer`` holding the parts ``Trainer.__init__`` builds, built here as it builds them."""
    from torchtitan.distributed import utils as dist_utils

    trainer = FlashcpTrainer.__new__(FlashcpTrainer)
    trainer.config, trainer.parallel_dims, trainer.device = config, parallel_dims, torch.device("cpu")
    trainer.model_config, trainer.model_parts = config.model_spec.model, [model]
    trainer.loss_fn = config.loss.build(compile_config=config.compile)
    trainer.optimizers = config.optimizer.build(model_parts=trainer.model_parts)
    trainer.lr_schedulers = config.lr_scheduler.build(optimizers=trainer.optimizers, training_steps=STEPS)
    trainer.metrics_processor, trainer.checkpointer = _Metrics(), _Checkpointer()
    trainer.gradient_accumulation_steps = trainer.num_pipeline_parallel_microbatches = 1
    trainer.step = trainer.ntokens_seen = 0
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims, spmd_typechecking=False)
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    return trainer


def _resume_failures(rank, config, trainer, build_dataloader, folder: str) -> list[str]:
    """torchtitan's checkpointer saves the dataloader (shuffled, one sequence into its second epoch) with the
    trainer's other states; a new dataloader loaded from it goes on with the batches the first would have read
    (and a new one not loaded reads others, so equal batches are not by accident)."""
    loader_config = dataclasses.replace(config.dataloader, shuffle=True)
    checkpoint = dataclasses.replace(config.checkpoint, enable=True, folder="checkpoint", interval=1,
                                     keep_latest_k=0)

    def checkpointer(dataloader):  # as Trainer.__init__ builds it
        return checkpoint.build(dataloader=dataloader, model_parts=trainer.model_parts, optimizers=trainer.optimizers,
                                lr_schedulers=trainer.lr_schedulers, states={"train_state": trainer},
                                sd_adapter=None, base_folder=folder)

    first = build_dataloader(loader_config)
    batches = iter(first)
    for _ in range(NUM_SEQS + 1):  # into the second epoch
        next(batches)
    saver = checkpointer(first)
    saver.save(curr_step=NUM_SEQS + 1)
    saver.close()
    expected = [next(batches) for _ in range(NUM_SEQS)]
    second = build_dataloader(loader_config)
    loader = checkpointer(second)
    if not loader.load(step=NUM_SEQS + 1):
        return [f"rank {rank}: torchtitan's checkpointer found no checkpoint to load in {folder}"]
    loader.close()

    def equal(batches):
        return [torch.equal(a[0]["input"], b[0]["input"]) and torch.equal(a[1], b[1])
                for (a, _), b in zip(zip(batches, range(NUM_SEQS)), expected)]

    same = equal(second)
    if all(equal(build_dataloader(loader_config))):
        return [f"rank {rank}: a dataloader not loaded from the checkpoint reads the same batches"]
    if not all(same):
        return [f"rank {rank}: after torchtitan's checkpoint load the dataloader's next batches differ from the "
                f"uninterrupted loader's (equal: {same}; state saved {first.state_dict()}, loaded "
                f"{second.state_dict()})"]
    return []


def _worker(rank, world, data_dir, folder):
    import torchtitan.distributed.parallel_dims as titan_dims
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torchtitan.distributed import ParallelDims

    titan_dims.device_type = "cpu"  # torchtitan names the device "cuda" on a machine without an accelerator
    TORCH_DTYPE_MAP.setdefault("float64", torch.float64)
    failures = []
    config = tiny_config(data_dir)
    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    parallel_dims.build_mesh()
    batch_mesh = parallel_dims.get_mesh("batch") if parallel_dims.dp_enabled else None

    def build_dataloader(loader_config=config.dataloader):  # with the arguments Trainer.__init__ passes
        return loader_config.build(dp_world_size=batch_mesh.size() if batch_mesh else 1,
                                       dp_rank=batch_mesh.get_local_rank() if batch_mesh else 0,
                                       tokenizer=config.tokenizer.build(tokenizer_path=config.hf_assets_path),
                                       seq_len=CONTEXT, local_batch_size=1)

    meshes = TitanMeshes.from_parallelism(config.parallelism)
    expected = list(CPLoader.from_mesh(data_dir, "cp2-flashcp2", meshes.mesh, shuffle=False, balance_window=0))
    seen = 0
    for (inputs, labels), batch in zip(build_dataloader(), expected * 2):  # an epoch, then the next
        seen += 1
        if not (torch.equal(inputs["input"][0], batch.input_ids) and torch.equal(labels[0], batch.labels)
                and torch.equal(inputs["positions"][0], batch.position_ids)):
            failures.append(f"rank {rank}: the dataloader's batch of row {batch.row} differs from CPLoader's")
        if seen == 2 * len(expected):
            break

    # the model, as Trainer.__init__ builds it: meta device, parallelize_fn, to_empty, init_weights
    with torch.device("meta"), set_default_dtype(torch.float64):
        model = config.model_spec.model.build()
    model = config.model_spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                             parallelism=config.parallelism, compile_config=config.compile,
                                             ac_config=config.activation_checkpoint, dump_folder="")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    torch.manual_seed(SEED)
    reference = build_titan_model(titan_model_config("llama3", **SHAPE), dtype=torch.float64)
    weights = {name: p.detach().clone() for name, p in reference.named_parameters()}
    set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True))  # it shards in place
    inner = [m for m in model.modules() if isinstance(m, CPInnerAttention)]
    if len(inner) != LAYERS:
        failures.append(f"parallelize_flashcp left {len(inner)} CPInnerAttention modules, not {LAYERS}")

    trainer = titan_trainer(config, parallel_dims, model)
    batches = trainer.batch_generator(build_dataloader())
    for _ in range(STEPS):
        trainer.step += 1
        trainer.train_step(batches)
    got_losses, got_max_losses = trainer.metrics_processor.losses, trainer.metrics_processor.max_losses
    got_params = {name.replace(AC_PREFIX, ""): p for name, p in full_parameters(model).items()}

    # flashcp's own loop on the same weights and data, torchtitan's optimizer and schedule
    optimizers = config.optimizer.build(model_parts=[reference])
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=STEPS)
    ref_losses = []
    batches_ref = iter(expected)  # STEPS <= the sequences of one epoch
    for _ in range(STEPS):
        result = train_step(reference, optimizers, next(batches_ref), titan_loss_sum, groups=meshes.groups,
                            comm="a2a", max_grad_norm=config.training.max_norm)
        schedulers.step()
        ref_losses.append(result.loss)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got_losses, ref_losses, strict=True))
    param_err = max((got_params[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters())
    if not (loss_err <= LOSS_RTOL and param_err <= PARAM_TOL):
        failures.append(f"rank {rank}: torchtitan's train_step with flashcp: losses {got_losses}, flashcp's loop "
                        f"{ref_losses} (max rel err {loss_err:.2e}); max |param err| {param_err:.2e}")
    # one replica: the logged max loss is its mean loss, as one process logs it (torchtitan's own formula gives
    # a shard's loss sum over about half the labels' count here)
    max_err = max(abs(a - b) / abs(b) for a, b in zip(got_max_losses, ref_losses, strict=True))
    if not max_err <= LOSS_RTOL:
        failures.append(f"rank {rank}: torchtitan's logged max loss {got_max_losses}, flashcp's loop's loss "
                        f"{ref_losses} (max rel err {max_err:.2e})")
    moved = max((got_params[n] - w).abs().max().item() for n, w in weights.items())
    if not moved > 1e-4:
        failures.append(f"rank {rank}: the parameters moved by {moved:.2e} only in {STEPS} steps")
    return failures + _resume_failures(rank, config, trainer, build_dataloader, folder)


def test_torchtitans_train_step_with_flashcp_equals_flashcps_loop_on_2_gloo_ranks(data_dir, tmp_path):
    spawn(_worker, 2, data_dir, str(tmp_path), start_method="fork")


def _max_loss_worker(rank, world):
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    titan_dims.device_type = "cpu"
    parallel_dims = ParallelDims.from_config(ParallelismConfig(context_parallel_degree=2), world)
    parallel_dims.build_mesh()
    trainer = FlashcpTrainer.__new__(FlashcpTrainer)
    trainer.parallel_dims = parallel_dims
    # each rank's (loss sum, label tokens) over two micro-batches; replica 0 is ranks 0-1, replica 1 ranks 2-3
    shares = {0: [(3.0, 2), (1.0, 2)], 1: [(2.0, 4), (0.0, 0)], 2: [(9.0, 1), (1.0, 1)], 3: [(2.0, 7), (3.0, 1)]}
    trainer._loss_parts = [torch.tensor(part, dtype=torch.float64) for part in shares[rank]]
    replica_means = [(3 + 1 + 2 + 0) / (2 + 2 + 4 + 0), (9 + 1 + 2 + 3) / (1 + 1 + 7 + 1)]
    got = trainer._replica_max_loss()
    if abs(got - max(replica_means)) > 1e-12:
        return [f"rank {rank}: the logged max loss is {got}, the larger replica mean {max(replica_means)}"]
    return []


def test_the_logged_max_loss_is_the_largest_replica_mean_on_dp_2_x_cp_2():
    spawn(_max_loss_worker, 4, start_method="fork")
