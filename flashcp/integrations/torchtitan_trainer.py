"""torchtitan's own ``Trainer`` with flashcp CP, switched on from torchtitan's command line.

torchtitan 0.3 picks a run with ``--module M --config F``: ``F`` is a function of module ``M`` that returns a
``Trainer.Config`` (torchtitan's ``config_registry``), ``M`` any importable module, and every field can then be
set as ``--section.field value`` (tyro). 0.3 has no TOML job files and no ``--experimental.custom_import``:
this module is a config registry, so flashcp is switched on by naming it::

    torchrun --nproc-per-node 8 -m torchtitan.train --module flashcp.integrations.torchtitan_trainer
        --config flashcp_llama3_8b --dataloader.data_dir DATA --dataloader.plan cp8-flashcp2
        --parallelism.context_parallel_degree 8 --training.seq_len 131072      (one line)

``flashcp_trainer_config(base)`` turns any torchtitan Llama3 or Qwen3 config into a flashcp one (the
``flashcp_*`` functions below apply it to torchtitan's registered configs; ``examples/torchtitan_flashcp.py``
shows a user's own). What it changes, each at a hook torchtitan has for it:

- **the trainer**: ``FlashcpTrainer``, a ``Trainer`` subclass (``Trainer.Config`` is a ``Configurable``: its
  ``build()`` constructs the subclass). It overrides ``post_dataloading_process``, the hook torchtitan
  documents for other data processing: the batch's ``CPAttention`` (its plan's ``CPAttnMeta`` and the
  ``cp`` mesh's group) goes into ``attention_masks`` instead of torchtitan's ``prepare_context_parallel_input``
  sharding; and ``forward_backward_step``: ``global_valid_tokens`` summed over ``cp`` too (below).
- **the model**: ``ModelSpec.parallelize_fn`` is ``parallelize_flashcp``: ``apply_cp_attention`` (every inner
  attention becomes ``CPInnerAttention``), then what torchtitan's ``parallelize_llama`` does (activation
  checkpointing, compile, ``apply_fsdp_to_decoder`` over ``dp_shard x cp``, HSDP across ``dp_replicate``)
  without ``apply_cp_to_forward``. The model config is torchtitan's own (same weights, checkpoints, flops).
- **the data**: ``FlashcpDataLoader`` (a ``BaseDataLoader``) reads a planned flashcp dataset through
  ``CPLoader`` at this rank's ``(dp, cp)`` place: the ``dp_rank`` / ``dp_world_size`` torchtitan passes (its
  ``batch`` mesh), the CP rank from torchtitan's layout (``pp, batch, cp, tp``: CP ranks consecutive). It yields
  torchtitan's ``({"input", "positions", ...}, labels)``; the tokenizer is ``Pretokenized`` (none needed).
- **the loss**: torchtitan's own loss over ``global_valid_tokens``. torchtitan counts the labels of the whole
  sequence on every CP rank (it shards afterwards) and sums the count over ``batch``; flashcp's loader hands
  each CP rank only its shard, so the count is summed over ``cp`` as well: the loss is then the summed
  token losses over the global batch's label tokens, as ``flashcp.train.train_step`` computes it.
- **the logged losses**: torchtitan logs ``global_avg_loss``, the sum of every rank's share (right as it is),
  and ``global_max_loss``, the largest over ranks of ``share x global count / local label count``. Under CP that
  local count is one rank's shard of a sequence while the global count is summed over ``cp``, so it would be
  a shard's loss scaled by about ``1/cp``, equal to nothing one process computes. ``FlashcpTrainer.train_step``
  logs instead each replica's summed token loss over its label tokens (its CP ranks' sums added), the largest
  over replicas: with one replica it equals the average, as one process logs it.

Why not torchtitan's other hooks: an ``@override`` (``--override.imports``) or a model converter replaces
``Configurable`` configs inside the tree, but neither the ``Trainer`` at its root (``apply_overrides`` refuses
the root) nor ``ModelSpec.parallelize_fn`` (a plain callable), so torchtitan would still shard every batch with
its own CP and wrap the inner attention with ``apply_cp_to_forward`` (which refuses any module but Flex and
SDPA). torchtitan's pluggable CP load balancer is not in 0.3.

Limits (each refused in one sentence by ``FlashcpTrainer.Config``): tensor, pipeline and expert parallelism off;
``local_batch_size`` 1 (one packed sequence per replica per micro-batch; ``global_batch_size`` a multiple of
the replicas gives gradient accumulation); ``spmd_backend`` ``partial_dtensor``; CUDA graphs off. torchtitan's
``Trainer.__init__`` needs an accelerator (it calls ``torch.cuda.set_device``), so on CPU the pieces are tested
on gloo ranks (``tests/integrations/test_torchtitan_trainer.py``) and the whole run is in the GPU script.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flashcp.integrations.torchtitan import apply_cp_attention
from flashcp.runtime import COMM_MODES, CPAttention, CPLoader
from flashcp.runtime.loader import IGNORE_INDEX

try:
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig, derive
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.trainer import Trainer
except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise ImportError(f"flashcp.integrations.torchtitan_trainer needs torchtitan ({e}); install it with "
                      "pip install 'flashcp[torchtitan]'") from None

__all__ = ["FlashcpDataLoader", "FlashcpOptions", "FlashcpTrainer", "Pretokenized", "flashcp_llama3_8b",
           "flashcp_llama3_debugmodel", "flashcp_qwen3_debugmodel", "flashcp_trainer_config",
           "parallelize_flashcp"]


class Pretokenized(BaseTokenizer):
    """The tokenizer of a flashcp dataset: none, its token ids are stored (torchtitan's trainer builds one)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        """Nothing to configure."""

    def __init__(self, config: Config, tokenizer_path: str | None = None, **kwargs: Any):
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        """Refused: a flashcp dataset holds token ids already."""
        raise ValueError("a flashcp dataset is tokenized already (flashcp data / pack); nothing to encode")

    def decode(self, *args: Any, **kwargs: Any) -> str:
        """Refused: there is no vocabulary to decode with."""
        raise ValueError("a flashcp dataset carries no tokenizer; decode with the one it was tokenized with")

    def get_vocab_size(self) -> int:
        """Refused: the vocabulary is the model config's."""
        raise ValueError("a flashcp dataset carries no tokenizer; the vocabulary size is the model config's")


class FlashcpDataLoader(BaseDataLoader):
    """torchtitan dataloader over a planned flashcp dataset: ``CPLoader`` at this rank's ``(dp, cp)`` place.

    Yields ``({"input": tokens_BT, "positions": positions_BT, "flashcp_meta": CPAttnMeta}, labels_BT)`` with
    ``B`` 1 and ``T`` this rank's tokens; ``FlashcpTrainer.post_dataloading_process`` turns the meta into the
    batch's ``CPAttention``. The labels already point at each token's next token in its document (-100 at a
    document's end), as torchtitan's losses take them. Resumable: ``state_dict`` is ``CPLoader``'s global
    position (the same on every rank).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """Where the planned dataset is and how to read it."""

        data_dir: str = ""
        """The flashcp dataset folder (``flashcp pack`` / ``synth``, then ``flashcp plan --cp N``)."""
        plan: str = ""
        """The plan's name under ``DATA/plans`` (e.g. ``cp8-flashcp2``); empty: plan each sequence as read."""
        seed: int = 0
        """Base of the per-epoch order."""
        shuffle: bool = True
        """Permute row groups and rows per epoch (else file order)."""
        balance_window: int = 16
        """Steps per DP balance window (``CPLoader``); 0 keeps the stream order."""
        infinite: bool = True
        """Start the next epoch when one ends (False: torchtitan stops at the end of the data)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int,
                 local_batch_size: int, tokenizer: Any = None, snapshot_every_n_steps: int | None = None,
                 **kwargs: Any):
        if not config.data_dir:
            raise ValueError("the flashcp dataloader needs the dataset folder: pass --dataloader.data_dir DATA")
        if local_batch_size != 1:
            raise ValueError(f"flashcp feeds one packed sequence per replica per micro-batch, got "
                             f"training.local_batch_size {local_batch_size}; set it to 1 (global_batch_size a "
                             "multiple of the replicas accumulates gradients)")
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if world % dp_world_size:
            raise ValueError(f"{world} ranks do not split into {dp_world_size} data-parallel replicas")
        cp = world // dp_world_size  # tensor and pipeline parallelism are off (FlashcpTrainer.Config)
        if rank // cp != dp_rank:
            raise ValueError(f"rank {rank} is replica {dp_rank} of {dp_world_size} but torchtitan's layout "
                             f"(cp {cp} consecutive ranks) puts it in replica {rank // cp}")
        self.loader = CPLoader(config.data_dir, config.plan or None, rank % cp, cp, dp_rank=dp_rank,
                               dp_size=dp_world_size, seed=config.seed, shuffle=config.shuffle,
                               balance_window=config.balance_window)
        if seq_len != self.loader.context_len:
            raise ValueError(f"training.seq_len is {seq_len} but the dataset's sequences hold "
                             f"{self.loader.context_len} tokens; pass --training.seq_len {self.loader.context_len}")
        self.infinite = config.infinite

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        """Yield this replica's sequences, this rank's tokens of each, epoch after epoch when ``infinite``."""
        while True:
            for batch in self.loader:
                inputs = {"input": batch.input_ids[None], "positions": batch.position_ids[None],
                          "flashcp_meta": batch.attn}
                yield inputs, batch.labels[None]
            if not self.infinite:
                return

    def state_dict(self) -> dict[str, Any]:
        """``CPLoader``'s position (epoch, sequences taken by all replicas, balance window)."""
        return {"flashcp_loader": self.loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved position (any ``dp`` size: ``CPLoader.load_state_dict``)."""
        if state_dict:
            self.loader.load_state_dict(state_dict["flashcp_loader"])


@dataclass(frozen=True, kw_only=True, slots=True)
class FlashcpOptions:
    """flashcp's settings of a torchtitan run (``--flashcp.comm``, ``--flashcp.backend``)."""

    comm: str = "auto"
    """The K/V exchange: ``allgather``, ``a2a``, ``full``, ``ring`` or ``auto`` (per batch, from its meta)."""
    backend: str = "auto"
    """The attention kernel backend (``flashcp.runtime.kernels``)."""

    def __post_init__(self) -> None:
        if self.comm not in (*COMM_MODES, "auto"):
            raise ValueError(f"flashcp.comm is '{self.comm}'; choose one of {', '.join(COMM_MODES)} or auto")


class FlashcpTrainer(Trainer):
    """torchtitan's ``Trainer`` with flashcp's CP: the plan's shards, document mask and K/V exchange.

    Everything else is torchtitan's: the training loop, optimizer and schedule, FSDP2, gradient clipping,
    checkpoints, metrics. See the module docstring.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """torchtitan's ``Trainer.Config`` and flashcp's options; refuses what flashcp does not run."""

        flashcp: FlashcpOptions = field(default_factory=FlashcpOptions)
        """flashcp's settings."""

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)  # zero-argument super() fails in a slots dataclass
            parallelism = self.parallelism
            others = {"tensor": parallelism.tensor_parallel_degree, "pipeline": parallelism.pipeline_parallel_degree,
                      "expert": parallelism.expert_parallel_degree}
            if any(d != 1 for d in others.values()):
                raise ValueError("flashcp trains with data and context parallelism only, got "
                                 + ", ".join(f"{k} parallel degree {d}" for k, d in others.items() if d != 1))
            if parallelism.spmd_backend != "partial_dtensor":
                raise ValueError(f"flashcp runs torchtitan's 'partial_dtensor' SPMD backend, got "
                                 f"parallelism.spmd_backend '{parallelism.spmd_backend}'")
            if not self.training.disable_cuda_graphs:
                raise ValueError("flashcp's attention plans per batch, which a CUDA graph cannot replay; set "
                                 "--training.disable_cuda_graphs")
            if not isinstance(self.dataloader, FlashcpDataLoader.Config):
                raise ValueError(f"FlashcpTrainer reads a planned flashcp dataset, got the dataloader "
                                 f"{type(self.dataloader).__qualname__}; build the config with "
                                 "flashcp_trainer_config")

    config: Config
    _loss_parts: list[torch.Tensor]
    """Per micro-batch of the current step: ``(this rank's summed token loss, its label tokens)``, float64."""

    def train_step(self, data_iterator: Iterator[tuple[dict[str, Any], torch.Tensor]]) -> None:
        """Run torchtitan's step; the max loss it logs is each replica's mean loss, the largest (module docstring)."""
        self._loss_parts = []
        processor = self.metrics_processor
        log = processor.log

        def log_replica_max(step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
                            extra_metrics: dict[str, Any] | None = None) -> None:
            log(step, global_avg_loss, self._replica_max_loss(), grad_norm, extra_metrics=extra_metrics)

        processor.log = log_replica_max  # type: ignore[method-assign]  # this step only, on every rank alike
        try:
            super().train_step(data_iterator)
        finally:
            processor.log = log  # type: ignore[method-assign]

    def _replica_max_loss(self) -> float:
        """The largest over replicas of a replica's summed token loss over its label tokens (collective)."""
        sums = torch.stack(self._loss_parts).sum(0)  # (2,) float64: this rank's loss sum, its label tokens
        if self.parallel_dims.cp_enabled:
            sums = dist_utils.dist_sum_tensor(sums, self.parallel_dims.get_mesh("cp"))
        mean = sums[0] / sums[1].clamp(min=1)
        return dist_utils.dist_max(mean, self.parallel_dims.get_mesh("batch")) if self.parallel_dims.dp_enabled \
            else float(mean)

    def post_dataloading_process(self, input_dict: dict[str, Any], labels: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``(tokens_BT, labels_BT, {"positions", "attention_masks": CPAttention})``, this rank's tokens.

        Replaces torchtitan's mask building and CP sharding: the loader already holds this rank's shards and
        the plan's attention meta, which goes to the device with what its comm mode reads.
        """
        options = self.config.flashcp
        meta = input_dict["flashcp_meta"].to(self.device, comm=options.comm)
        group = self.parallel_dims.get_mesh("cp").get_group() if self.parallel_dims.cp_enabled else None
        if meta.cp != (self.parallel_dims.cp if group is not None else 1):
            raise ValueError(f"the batch is planned for cp {meta.cp} but parallelism.context_parallel_degree is "
                             f"{self.parallel_dims.cp}")
        attn = CPAttention(meta=meta, group=group, comm=options.comm, backend=options.backend)
        self.ntokens_seen += labels.numel()
        return input_dict["input"], labels, {"positions": input_dict["positions"], "attention_masks": attn}

    def forward_backward_step(self, *, input_dict: Any, labels: Any, global_valid_tokens: torch.Tensor
                              ) -> torch.Tensor:
        """Run torchtitan's step with ``global_valid_tokens`` summed over ``cp`` as well (module docstring)."""
        if self.parallel_dims.cp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(global_valid_tokens, self.parallel_dims.get_mesh("cp"))
        loss = super().forward_backward_step(input_dict=input_dict, labels=labels,
                                             global_valid_tokens=global_valid_tokens)
        # torchtitan returns this rank's loss sum over the global label count: kept with this rank's labels
        local = loss.to_local() if isinstance(loss, DTensor) else loss
        self._loss_parts.append(torch.stack((local.detach().double().reshape(()) * global_valid_tokens.double(),
                                             (labels != IGNORE_INDEX).sum().double())))
        return loss


def parallelize_flashcp(model: torch.nn.Module, *, parallel_dims: ParallelDims, training: TrainingConfig,
                        parallelism: ParallelismConfig, compile_config: CompileConfig,
                        ac_config: ActivationCheckpointingConfig | None, dump_folder: str) -> torch.nn.Module:
    """Apply torchtitan's ``parallelize_llama`` with flashcp attention in place of ``apply_cp_to_forward``.

    A ``ModelSpec.parallelize_fn``: on the meta-device model, ``apply_cp_attention``, then activation
    checkpointing, per-block compile and FSDP2 (``apply_fsdp_to_decoder`` over ``fsdp`` = ``dp_shard x cp``,
    ``dp_replicate x fsdp`` for HSDP) exactly as torchtitan applies them. FSDP's collectives are forced to plain
    sums (gloo has no premultiplied sum; torchtitan's FSDP divides nothing: the loss is already over the
    global label count). Returns the model.
    """
    from torch.distributed.fsdp import FSDPModule

    if parallel_dims.tp_enabled or parallel_dims.pp_enabled or parallel_dims.ep_enabled:
        raise ValueError("flashcp trains with data and context parallelism only (tensor, pipeline and expert "
                         "parallel degrees 1)")
    apply_cp_attention(model)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    apply_fsdp_to_decoder(model, parallel_dims.get_mesh(names),  # type: ignore[arg-type]
                          param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                          reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce], pp_enabled=False,
                          cpu_offload=training.enable_cpu_offload,
                          reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
                          enable_symm_mem=parallelism.enable_fsdp_symm_mem)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def flashcp_trainer_config(base: Trainer.Config, *, data_dir: str = "", plan: str = "",
                           options: FlashcpOptions | None = None) -> FlashcpTrainer.Config:
    """``base`` (a torchtitan Llama3 or Qwen3 ``Trainer.Config``) trained with flashcp CP.

    Keeps the model config, optimizer, schedule, loss, checkpointing and metrics; sets the trainer to
    ``FlashcpTrainer``, the dataloader to ``FlashcpDataLoader`` (``data_dir``, ``plan``; or from the command
    line), the tokenizer to ``Pretokenized``, ``parallelize_fn`` to ``parallelize_flashcp``, one packed sequence
    per micro-batch, the ``partial_dtensor`` backend, CUDA graphs and torchtitan's validator (which reads a
    Hugging Face dataset) off.
    """
    if base.model_spec is None:
        raise ValueError("the base config has no model_spec; take one from a torchtitan config_registry")
    spec = dataclasses.replace(base.model_spec, parallelize_fn=parallelize_flashcp, pipelining_fn=None)
    validator = dataclasses.replace(base.validator, enable=False)
    return derive(base, FlashcpTrainer.Config, model_spec=spec,
                  dataloader=FlashcpDataLoader.Config(data_dir=data_dir, plan=plan),
                  tokenizer=Pretokenized.Config(), validator=validator,
                  parallelism=dataclasses.replace(base.parallelism, spmd_backend="partial_dtensor"),
                  training=dataclasses.replace(base.training, local_batch_size=1, disable_cuda_graphs=True),
                  flashcp=options or FlashcpOptions())


def flashcp_llama3_debugmodel() -> FlashcpTrainer.Config:
    """Return torchtitan's ``llama3_debugmodel`` with flashcp CP (``--config flashcp_llama3_debugmodel``)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return flashcp_trainer_config(llama3_debugmodel())


def flashcp_qwen3_debugmodel() -> FlashcpTrainer.Config:
    """Return torchtitan's ``qwen3_debugmodel`` with flashcp CP."""
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    return flashcp_trainer_config(qwen3_debugmodel())


def flashcp_llama3_8b() -> FlashcpTrainer.Config:
    """Return torchtitan's ``llama3_8b`` with flashcp CP."""
    from torchtitan.models.llama3.config_registry import llama3_8b

    return flashcp_trainer_config(llama3_8b())
