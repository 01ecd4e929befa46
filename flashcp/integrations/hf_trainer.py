"""CPTrainer: packed-document context parallelism inside the Hugging Face ``Trainer`` (and TRL's ``SFTTrainer``).

transformers' own CP (accelerate's ``ParallelismConfig(cp_size=...)``) shards a sequence with SDPA and a plain
causal mask only, so packed documents attend across their boundaries. ``CPTrainer`` keeps the Trainer (its
``TrainingArguments``, optimizer and scheduler, DDP or FSDP through accelerate, logging, checkpoints, callbacks)
and replaces the five things CP changes:

- **Data.** The train dataloader is ``CPLoader`` over a flashcp dataset and plan. The launched world is a
  ``(dp, cp)`` mesh (``flashcp.train.parallel.build_mesh``): global rank ``g`` is CP rank ``g % cp`` of replica
  ``g // cp``. A micro-batch is ``per_device_train_batch_size`` (``B``) packed sequences per replica, the
  replica's next ``B`` of the loader's stream, run as one longer varlen sequence (``runtime.batching``: their
  documents one after the other, each sequence's plan kept, so attention never crosses from one sequence to
  another; one forward, one backward and one K/V exchange per layer for all ``B``, the memory of ``B``
  sequences as in any Trainer). Each rank holds its shards of them (``input_ids``, per-document
  ``position_ids``, next-token ``labels``) and their ``CPAttnMeta``. Data order: ``train_sampling_strategy``
  ``"random"`` shuffles with ``data_seed`` (else ``seed``), ``"sequential"`` keeps file order. A Trainer epoch is
  ``ceil(num_sequences / (dp * B))`` micro-batches of the loader's global stream, which runs on from one Trainer
  epoch to the next (``CPLoader``: nothing is dropped or repeated at a data epoch's end).
- **Attention.** The model attends through the registered ``cp_attention`` (its attention implementation is
  switched to it), called with the batch's meta and the CP group; no attention mask is used or accepted. A
  hybrid's recurrent mixers (Qwen3-Next, Qwen3.5, Nemotron-H) run through ``flashcp.runtime.recurrent``
  (``hf_recurrent.apply_cp_recurrent``, applied at construction) with the batch's ``RecurrentMeta``.
- **Loss.** An optimizer step's global batch is ``gradient_accumulation_steps`` micro-batches of ``B``
  sequences on each of the ``dp`` replicas (``B x gradient_accumulation_steps x dp`` sequences: the Trainer's
  total train batch size, by which it counts steps, epochs and ``max_steps``). Each rank's loss is its local
  token-loss sum divided by the label tokens of that whole global batch (counted from the plan, summed over the
  replicas), times the world size because DDP and FSDP average gradients over the ranks; summed over ranks and
  micro-batches that is exactly the single-process mean loss of the global batch, and the gradients are its
  gradients. The logged ``loss`` is that global-batch mean.
- **Evaluation.** ``eval_dataset`` is a flashcp dataset folder too, with its plan (``eval_plan``, for the same
  ``cp``). ``evaluate()`` (and ``eval_strategy="steps"`` / ``"epoch"`` during training) runs every sequence of it
  once, in file order, each under CP with the document mask, ``per_device_eval_batch_size`` sequences run as one
  per replica and round as in training: replica ``d`` takes sequences ``d, d + dp, ...``, and in the last round a
  sequence past the end is run anyway (an FSDP forward is collective) and counts nothing. Each rank sums its
  token losses; the sums and the label counts are added over all ranks, so ``eval_loss`` is the summed
  next-token loss over every label token of the set divided by their number: what one process computes on the
  whole set at once, whatever the batch size. It is logged like the Trainer's own (``eval_loss``,
  ``eval_runtime``, ``eval_samples_per_second``, ``eval_steps_per_second``) and passed to the callbacks.
- **Checkpoints.** Each checkpoint folder also holds ``flashcp_loader.json`` (the loader's global position,
  written before the Trainer's own files); ``resume_from_checkpoint`` restores it, and the micro-batches the
  Trainer skips on resume are placeholders that read nothing, so the run continues at the same sequence.

What the Trainer cannot honour under CP is refused with one sentence: a model flashcp cannot train exactly under CP
(``flashcp.integrations.hf_support``: a layer kind cp_attention does not run, an unverified architecture),
``dataloader_num_workers`` above 0, ``auto_find_batch_size``, a ``train_dataset`` that is not a flashcp dataset
folder, a plan whose ``cp`` differs from the ``cp`` argument or does not divide the launched world, a
``data_collator``, an ``eval_dataset`` that is not a planned flashcp dataset folder, ``compute_metrics`` and
``preprocess_logits_for_metrics`` (a sequence's logits are split over the CP ranks), ``predict``, label smoothing, a
``compute_loss_func``, DataParallel (several GPUs in one process), DeepSpeed, accelerate's own context / sequence /
tensor parallelism, and, in a batch, an ``attention_mask`` with padding.

TRL: ``CPSFTTrainer`` (this module's attribute, built on first access; needs ``pip install 'flashcp[trl]'``) is
the same overrides on ``trl.SFTTrainer``: the SFT configuration, model loading by name, PEFT adapters and
activation offloading stay SFTTrainer's; data, attention, loss and checkpoints are flashcp's (SFTTrainer's
dataset preparation is skipped: the data is packed and tokenized already).

Shape legend: ``B`` the model's batch dimension (1: a micro-batch's sequences run as one), ``T`` this rank's
tokens of them, ``V`` vocabulary.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

try:
    from transformers import Trainer
except ImportError as e:  # an optional dependency
    raise ImportError("flashcp.integrations.hf_trainer needs transformers and accelerate: pip install "
                      "'flashcp[hf]'") from e

from flashcp.costmodel.models import ModelError, ModelSpec, as_model_spec
from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError
from flashcp.fileio import write_json_atomic
from flashcp.integrations.hf import ATTN_IMPLEMENTATION, hf_attention_kwargs, register_flashcp_attention
from flashcp.integrations.hf_recurrent import apply_cp_recurrent, uses_cp_recurrent
from flashcp.integrations.hf_support import check_hf_model
from flashcp.outputs import enclosing_dataset
from flashcp.planner.plan_reader import PlanStore
from flashcp.runtime.batching import concat_batches
from flashcp.runtime.loader import IGNORE_INDEX, Batch, CPLoader
from flashcp.train.loss import causal_lm_loss_sum
from flashcp.train.parallel import ParallelGroups, build_mesh

__all__ = ["LOADER_STATE_NAME", "CPTrainer", "CPTrainerMixin"]  # and CPSFTTrainer, built on first access

LOADER_STATE_NAME = "flashcp_loader.json"
"""The file in each Trainer checkpoint folder that holds the loader's position."""

_LOADER_STATE_FORMAT = 1
_SAMPLING = {"random": True, "sequential": False}  # train_sampling_strategy -> CPLoader shuffle
_SKIPPED: dict[str, Any] = {"flashcp_skipped": True}  # what the Trainer discards on resume: nothing is read


def _priced_model(model: nn.Module) -> ModelSpec | None:
    """The ``ModelSpec`` of ``model``'s config, which the loader checks the plan against.

    The loader warns once when the plan was priced for another model. None for a config flashcp cannot price
    (a latent-attention layer, say): such a model trains, there is just no plan price to compare.
    """
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    try:
        return as_model_spec(config)
    except (ModelError, TypeError):  # advisory only: a config the reader trips on (Ernie 4.5 VL's per-layer
        return None                  # expert widths raise TypeError there) must not stop training


class _CPStream(IterableDataset):
    """The Trainer's view of a CPLoader: ``len`` micro-batches per Trainer epoch, ``batch_size`` sequences each.

    A micro-batch is the loader's next ``batch_size`` sequences of this replica run as one
    (``runtime.batching.concat_batches``). The loader's global stream continues from one iteration (Trainer
    epoch) to the next. ``skip_next`` makes the next iteration start with that many placeholders, for the
    Trainer to discard on resume. With ``count_first``, only the first that many sequences of the stream count
    (evaluation): a later one is run (an FSDP forward is collective) with its labels ignored.
    """

    def __init__(self, loader: CPLoader, length: int, vocab_size: int | None = None, batch_size: int = 1,
                 count_first: int | None = None, recurrent: bool = False):
        self.loader, self.length, self.skip_next, self.vocab_size = loader, length, 0, vocab_size
        self.batch_size, self.count_first, self.recurrent = batch_size, count_first, recurrent
        self._source: Iterator[Batch] | None = None
        self._taken = 0  # loader steps taken: this replica's sequence of step k is stream sequence k * dp + d

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[dict[str, Any]]:
        skip, self.skip_next = self.skip_next, 0
        for index in range(self.length):
            if index < skip:
                yield _SKIPPED
            else:
                yield self._micro_batch(concat_batches([self._next() for _ in range(self.batch_size)]))

    def _next(self) -> Batch:
        if self._source is None:
            self._source = self._endless()
        batch = self._checked(next(self._source))
        stream_index = self._taken * self.loader.dp_size + self.loader.dp_rank
        self._taken += 1
        if self.count_first is not None and stream_index >= self.count_first:
            batch = replace(batch, labels=torch.full_like(batch.labels, IGNORE_INDEX), num_label_tokens=0)
        return batch

    def _endless(self) -> Iterator[Batch]:
        while True:  # the loader counts its data epochs itself
            yield from self.loader

    def _checked(self, batch: Batch) -> Batch:
        # an id past the embeddings is an IndexError on CPU and a device-side assert on CUDA: say it first
        if self.vocab_size is not None and batch.input_ids.numel() and int(batch.input_ids.max()) >= self.vocab_size:
            raise ValueError(f"sequence {batch.row} of data file {batch.file_index} holds token id "
                             f"{int(batch.input_ids.max()):,} but the model embeds only {self.vocab_size:,} ids; "
                             "train a model with the data's tokenizer vocabulary")
        return batch

    def _micro_batch(self, batch: Batch) -> dict[str, Any]:
        # the recurrent layers' meta only for a model that has them (hf_recurrent)
        return {"input_ids": batch.input_ids[None], "position_ids": batch.position_ids[None],
                "labels": batch.labels[None], "flashcp_meta": batch.attn,
                "flashcp_recurrent": batch.recurrent() if self.recurrent else None,
                "num_label_tokens": batch.num_label_tokens}


def _keep(item):
    return item


class CPTrainerMixin:
    """The overrides that make a ``transformers.Trainer`` (sub)class train with flashcp CP (module docstring).

    Put it first among the bases: ``class CPTrainer(CPTrainerMixin, Trainer)``.
    """

    loss_is_scaled_for_ga = True  # compute_loss already divides by the whole accumulated global batch
    # set by the Trainer
    args: Any
    model: Any
    accelerator: Any
    state: Any

    def __init__(self, *args, train_dataset: str | os.PathLike, plan: str, cp: int | None = None,
                 comm: str = "auto", backend: str = "auto", balance_window: int = 16,
                 eval_dataset: str | os.PathLike | None = None, eval_plan: str | None = None, **kwargs):
        """Set up the Trainer, then the ``(dp, cp)`` mesh over the launched ranks.

        Args:
            *args: the Trainer's positional arguments (``model``, ``args``).
            train_dataset: a flashcp dataset folder (``flashcp pack`` or ``flashcp synth``).
            plan: the name of its plan (``flashcp plan``), a folder under ``DATA/plans``.
            cp: ranks per sequence; None takes the plan's ``cp``. The launched ranks are ``dp x cp``.
            comm: ``cp_attention``'s K/V exchange (``allgather``, ``a2a``, ``full``, ``ring``, ``auto``).
            backend: its kernels (``flash_attn``, ``torch_varlen``, ``reference``, ``auto``).
            balance_window: ``CPLoader``'s DP balance window in micro-batches (0: the stream order).
            eval_dataset: a flashcp dataset folder to evaluate on (``evaluate()``, ``eval_strategy``), or None.
            eval_plan: the name of its plan, made for the same ``cp`` (required with ``eval_dataset``).
            **kwargs: the Trainer's other keyword arguments.

        Raises ValueError (one sentence) for what CPTrainer cannot honour (module docstring) and FlashcpError
        for a missing dataset or plan.
        """
        if not isinstance(train_dataset, (str, os.PathLike)):
            raise ValueError(f"CPTrainer trains on a flashcp dataset folder (made by 'flashcp pack' or 'flashcp "
                             f"synth' and planned by 'flashcp plan'), got a {type(train_dataset).__name__}; pass "
                             "the folder's path and the plan's name")
        for name in ("data_collator", "compute_loss_func", "compute_metrics", "preprocess_logits_for_metrics"):
            if kwargs.get(name) is not None:
                raise ValueError(f"CPTrainer cannot honour {name}: " + {
                    "data_collator": "its batches are built from the plan (packed sequences run as one per rank)",
                    "compute_loss_func": "its loss is the next-token loss over the global batch's labels",
                    "compute_metrics": "each rank holds only its shard of a sequence's logits, so its evaluation "
                                       "reports eval_loss alone",
                    "preprocess_logits_for_metrics": "each rank holds only its shard of a sequence's logits, so "
                                                     "its evaluation reports eval_loss alone",
                }[name])
        if eval_dataset is not None and not isinstance(eval_dataset, (str, os.PathLike)):
            raise ValueError(f"CPTrainer evaluates on a flashcp dataset folder (made by 'flashcp pack' and planned "
                             f"by 'flashcp plan'), got a {type(eval_dataset).__name__} as eval_dataset; pass the "
                             "folder's path and eval_plan")
        if eval_dataset is not None and (not isinstance(eval_plan, str) or not eval_plan):
            raise ValueError(f"CPTrainer needs eval_plan, the name of a plan of {eval_dataset} (made by 'flashcp "
                             f"plan {eval_dataset} --cp N'), got {eval_plan!r}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is None:
            raise ValueError("CPTrainer needs TrainingArguments (args=...)")
        _check_arguments(training_args)
        if not isinstance(plan, str) or not plan:
            raise ValueError(f"CPTrainer needs the name of a plan of {train_dataset} (a folder under its plans/, "
                             f"made by 'flashcp plan {train_dataset} --cp N'), got {plan!r}")
        dataset = Dataset(Path(train_dataset))
        inside = enclosing_dataset(training_args.output_dir) if training_args.output_dir else None
        if inside is not None:
            raise ValueError(f"output_dir {training_args.output_dir} lies inside the dataset {inside}; flashcp "
                             "writes nothing into a dataset but its plans: choose a folder outside it")
        plan_cp = PlanStore(dataset, plan).cp
        if cp is not None and cp != plan_cp:
            raise ValueError(f"plan '{plan}' was made for cp {plan_cp} but cp is {cp}; run 'flashcp plan --cp {cp}' "
                             f"or pass cp={plan_cp}")
        eval_data = None
        if eval_dataset is not None:
            assert eval_plan is not None
            eval_data = Dataset(Path(eval_dataset))
            eval_cp = PlanStore(eval_data, eval_plan).cp
            if eval_cp != plan_cp:
                raise ValueError(f"eval plan '{eval_plan}' was made for cp {eval_cp} but plan '{plan}' trains with "
                                 f"cp {plan_cp}; run 'flashcp plan {eval_dataset} --cp {plan_cp}'")
        elif (strategy := str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy))) != "no":
            raise ValueError(f"eval_strategy='{strategy}' needs data to evaluate on: pass CPTrainer("
                             "eval_dataset=DATA, eval_plan=PLAN) or set eval_strategy='no'")
        self.cp_data, self.cp_plan, self.cp_size = Path(train_dataset), plan, plan_cp
        self.cp_eval_data = None if eval_dataset is None else Path(eval_dataset)
        self.cp_eval_plan = eval_plan
        self.cp_comm, self.cp_backend, self.cp_balance_window = comm, backend, balance_window
        super().__init__(*args, train_dataset=self._base_train_dataset(dataset),  # type: ignore[call-arg]
                         eval_dataset=None if eval_data is None else self._base_eval_dataset(eval_data), **kwargs)
        self.cp_vocab_size = self._check_vocabulary(dataset)
        if eval_data is not None:
            self._check_vocabulary(eval_data)
        world = self.args.world_size
        if world % self.cp_size:
            raise ValueError(f"plan '{plan}' was made for cp {self.cp_size} but {world} ranks were launched; "
                             f"launch a multiple of {self.cp_size} ranks (dp x cp)")
        self.dp_size = world // self.cp_size
        self.cp_groups: ParallelGroups | None = None
        if world > 1:
            self.cp_groups = ParallelGroups.from_mesh(build_mesh(self.dp_size, self.cp_size,
                                                                 self.args.device.type))
        self._check_environment()
        self._use_cp_attention(self.model)
        self._cp_stream: _CPStream | None = None

    # ---- what a subclass for another Trainer may change ------------------------------------------------------

    def _base_train_dataset(self, dataset: Dataset) -> Any:
        """What the base class's ``__init__`` receives as ``train_dataset`` (the data itself comes from CPLoader)."""
        return None

    def _base_eval_dataset(self, dataset: Dataset) -> Any:
        """What the base class's ``__init__`` receives as ``eval_dataset`` (``evaluate`` reads through CPLoader).

        Anything but None, so that the base class accepts an ``eval_strategy``.
        """
        return str(dataset.root)

    # ---- set-up --------------------------------------------------------------------------------------------

    def _check_environment(self) -> None:
        """Refuse Trainer configurations that would reduce gradients or split sequences another way."""
        args = self.args
        if args.n_gpu > 1:
            raise ValueError(f"CPTrainer runs one process per device, but this process drives {args.n_gpu} GPUs "
                             "(DataParallel); launch with torchrun --nproc-per-node N")
        if getattr(self, "is_deepspeed_enabled", False):
            raise ValueError("CPTrainer supports DDP and FSDP, not DeepSpeed; remove the deepspeed configuration")
        config = getattr(self.accelerator, "parallelism_config", None)
        if config is not None and max(getattr(config, f"{dim}_size", 1) or 1 for dim in ("cp", "sp", "tp")) > 1:
            raise ValueError("CPTrainer does its own context parallelism; remove accelerate's parallelism_config "
                             "cp_size, sp_size and tp_size")

    def _check_vocabulary(self, dataset: Dataset) -> int | None:
        """The model's vocabulary (its input embeddings' rows), refused if the data's tokenizer has more ids."""
        embeddings = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        vocab = getattr(embeddings, "num_embeddings", None)
        tokenizer = dataset.manifest.get("tokenizer") or {}
        ids = tokenizer.get("vocab_size")
        if isinstance(vocab, int) and isinstance(ids, int) and ids > vocab:
            raise ValueError(f"dataset {dataset.root} was tokenized with {tokenizer.get('name')} ({ids:,} token ids) "
                             f"but the model embeds only {vocab:,}; train a model with that tokenizer's vocabulary "
                             "or pack the data with the model's tokenizer")
        return vocab

    def _use_cp_attention(self, model: Any) -> None:
        """Check ``model`` (or a PEFT model's base) and switch it to the ``cp_attention`` implementation.

        A model flashcp cannot train exactly under CP (``hf_support.check_hf_model``: recurrent, state-space,
        convolution, sliding-window, chunked or sink layers, an unverified architecture) is refused here, before
        the first step.
        """
        register_flashcp_attention()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's base
        config = getattr(base, "config", None)
        if config is None or not hasattr(base, "set_attn_implementation"):
            raise ValueError(f"CPTrainer trains transformers models (PreTrainedModel), got a {type(base).__name__}")
        apply_cp_recurrent(base)  # a hybrid's recurrent mixers run through flashcp.runtime.recurrent
        check_hf_model(base)
        if config._attn_implementation != ATTN_IMPLEMENTATION:
            base.set_attn_implementation(ATTN_IMPLEMENTATION)
        if config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(f"{type(base).__name__} cannot attend through {ATTN_IMPLEMENTATION} (it does not use "
                             "transformers' AttentionInterface)")

    # ---- data ------------------------------------------------------------------------------------------------

    def get_train_dataloader(self) -> DataLoader:
        """A DataLoader over this rank's CPLoader: per micro-batch ``per_device_train_batch_size`` sequences as one."""
        args = self.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        shuffle = _SAMPLING[args.train_sampling_strategy]
        if self.cp_groups is not None:
            loader = CPLoader.from_mesh(self.cp_data, self.cp_plan, self.cp_groups.mesh, seed=seed, shuffle=shuffle,
                                        balance_window=self.cp_balance_window, model=_priced_model(self.model))
        else:
            loader = CPLoader(self.cp_data, self.cp_plan, 0, 1, seed=seed, shuffle=shuffle,
                              model=_priced_model(self.model))
        if len(loader) == 0:
            raise FlashcpError(f"dataset {self.cp_data} holds no sequences")
        batch_size = args.per_device_train_batch_size
        self._cp_stream = _CPStream(loader, math.ceil(len(loader) / (self.dp_size * batch_size)), self.cp_vocab_size,
                                    batch_size, recurrent=uses_cp_recurrent(self.model))
        return DataLoader(self._cp_stream, batch_size=None, collate_fn=_keep, num_workers=0)

    def num_examples(self, dataloader: DataLoader) -> int:
        """Sequences per Trainer epoch over all replicas (the Trainer logs it and prices samples per second by it).

        The train dataloader's length counts micro-batches of ``per_device_train_batch_size`` sequences per replica.
        """
        stream = getattr(dataloader, "dataset", None)
        if isinstance(stream, _CPStream):
            return stream.length * stream.batch_size * self.dp_size
        return super().num_examples(dataloader)  # type: ignore[misc]

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple[list, int | None]:
        """The next ``num_batches`` micro-batches and the label tokens of the global batch they belong to.

        The count is the sequences' label tokens (from the plan, all CP ranks) summed over the replicas: one
        scalar all-reduce over the ``dp`` group.
        """
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        assert all(b is not _SKIPPED for b in batch_samples), "a micro-batch skipped on resume reached training"
        count = sum(int(b["num_label_tokens"]) for b in batch_samples)
        if self.dp_size > 1:
            assert self.cp_groups is not None
            total = torch.tensor([count], dtype=torch.int64, device=device)
            dist.all_reduce(total, group=self.cp_groups.dp_group)
            count = int(total.item())
        return batch_samples, count

    # ---- loss ------------------------------------------------------------------------------------------------

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None):
        """The loss this rank back-propagates: its share of the global batch's mean next-token loss.

        See the module docstring.

        ``num_items_in_batch`` is the global batch's label tokens (``get_batch_samples``); required.
        """
        if num_items_in_batch is None:
            raise ValueError("CPTrainer.compute_loss needs num_items_in_batch, the global batch's label tokens "
                             "(CPTrainer.get_batch_samples counts them)")
        loss_sum, outputs = self._loss_sum(model, inputs)
        # DDP and FSDP average gradients over the ranks; the loss shares must add up instead
        world = self.accelerator.num_processes
        loss = loss_sum * (world / max(int(num_items_in_batch), 1))
        return (loss, outputs) if return_outputs else loss

    def _loss_sum(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, Any]:
        """The summed next-token loss over this rank's labels of one packed sequence, and the model's outputs."""
        mask = inputs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("CPTrainer takes the document mask from the plan and its sequences have no padding; "
                             "remove the attention_mask from the batch")
        labels_BT = inputs["labels"]
        meta = inputs["flashcp_meta"].to(labels_BT.device)
        group = self.cp_groups.cp_group if self.cp_groups is not None else None
        outputs = model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False,
                        **hf_attention_kwargs(meta, group=group, comm=self.cp_comm, backend=self.cp_backend,
                                              recurrent=inputs.get("flashcp_recurrent")))
        return causal_lm_loss_sum(outputs.logits[0], labels_BT[0]), outputs

    def get_cp_size(self) -> int:
        """Ranks per sequence (the Trainer divides the world by it to report the global batch size)."""
        return self.cp_size

    # ---- evaluation ------------------------------------------------------------------------------------------

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """The mean next-token loss over every label token of the eval dataset, under CP; logged and returned.

        Collective: call on every rank. Returns ``{"{metric_key_prefix}_loss": ..., "..._runtime": ...,
        "..._samples_per_second": ..., "..._steps_per_second": ...}`` (module docstring). Raises ValueError for
        an ``eval_dataset`` argument (the data is the one given to ``CPTrainer``) or when there is none.
        """
        from transformers.trainer_utils import speed_metrics

        if eval_dataset is not None:
            raise ValueError("CPTrainer evaluates the flashcp dataset given as CPTrainer(eval_dataset=DATA, "
                             "eval_plan=PLAN); call evaluate() without eval_dataset")
        if self.cp_eval_data is None:
            raise ValueError("CPTrainer has no data to evaluate on; pass CPTrainer(eval_dataset=DATA, "
                             "eval_plan=PLAN)")
        self._memory_tracker.start()  # type: ignore[attr-defined]
        start = time.time()
        loss, num_sequences, num_steps = self._evaluation_loss()
        metrics = {f"{metric_key_prefix}_loss": loss}
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=num_sequences, num_steps=num_steps))
        self.log(metrics)  # type: ignore[attr-defined]
        self.control = self.callback_handler.on_evaluate(  # type: ignore[attr-defined]
            self.args, self.state, self.control, metrics)  # type: ignore[has-type]
        self._memory_tracker.stop_and_update_metrics(metrics)  # type: ignore[attr-defined]
        return metrics

    def _evaluation_loss(self) -> tuple[float, int, int]:
        """(summed loss over every label token / their number, sequences, rounds): the module docstring."""
        assert self.cp_eval_data is not None and self.cp_eval_plan is not None
        if self.cp_groups is not None:
            loader = CPLoader.from_mesh(self.cp_eval_data, self.cp_eval_plan, self.cp_groups.mesh, shuffle=False,
                                        balance_window=0)
        else:
            loader = CPLoader(self.cp_eval_data, self.cp_eval_plan, 0, 1, shuffle=False, balance_window=0)
        num_sequences, batch_size = len(loader), self.args.per_device_eval_batch_size
        stream = _CPStream(loader, math.ceil(num_sequences / (self.dp_size * batch_size)), self.cp_vocab_size,
                           batch_size, count_first=num_sequences,  # later ones: the next pass, not counted
                           recurrent=uses_cp_recurrent(self.model))
        model = self.model
        was_training = model.training
        model.eval()
        device = self.args.device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        labels = 0
        try:
            with torch.no_grad():
                for micro_batch in stream:
                    inputs = self._prepare_inputs(micro_batch)  # type: ignore[attr-defined]
                    with self.compute_loss_context_manager():  # type: ignore[attr-defined]
                        local, _ = self._loss_sum(model, inputs)
                    loss_sum += local.double()
                    labels += int(micro_batch["num_label_tokens"]) if loader.rank == 0 else 0
        finally:
            model.train(was_training)
        totals = torch.stack((loss_sum, torch.tensor(float(labels), dtype=torch.float64, device=device)))
        if self.cp_groups is not None:  # every rank's loss sum; the label counts of each replica's CP rank 0
            dist.all_reduce(totals, group=self.cp_groups.grad_group)
        total_loss, total_labels = totals.tolist()
        return total_loss / max(total_labels, 1.0), num_sequences, len(stream)

    def predict(self, *args, **kwargs):
        """Refused: each rank holds only its shard of a sequence's logits (``evaluate`` gives the loss)."""
        raise ValueError("CPTrainer cannot predict: each rank holds only its shard of a sequence's logits; use "
                         "evaluate() for the loss")

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        args, state = self.args, self.state
        run_dir = self._get_output_dir(trial=trial)  # type: ignore[attr-defined]
        folder = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if args.should_save and self._cp_stream is not None:
            folder.mkdir(parents=True, exist_ok=True)
            write_json_atomic(folder / LOADER_STATE_NAME, {
                "format": _LOADER_STATE_FORMAT, "global_step": int(state.global_step), "cp": self.cp_size,
                "dp": self.dp_size, "loader": self._cp_stream.loader.state_dict()})
        super()._save_checkpoint(model, trial)  # type: ignore[misc]

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, num_train_epochs,
                             resume_from_checkpoint, trial) -> tuple[int, int]:
        epochs_trained, skipped = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial)
        if resume_from_checkpoint is not None:
            assert self._cp_stream is not None
            path = Path(resume_from_checkpoint) / LOADER_STATE_NAME
            try:
                saved = json.loads(path.read_text())
            except FileNotFoundError:
                raise ValueError(f"checkpoint {resume_from_checkpoint} has no {LOADER_STATE_NAME}: it was not "
                                 "saved by CPTrainer, so the data position is unknown; resume from a CPTrainer "
                                 "checkpoint") from None
            except (OSError, ValueError) as e:
                raise ValueError(f"{path} cannot be read ({e}); resume from another checkpoint") from None
            if saved.get("format") != _LOADER_STATE_FORMAT:
                raise ValueError(f"{path} has format {saved.get('format')}, this flashcp reads format "
                                 f"{_LOADER_STATE_FORMAT}")
            if saved.get("global_step") != self.state.global_step:
                raise ValueError(f"{path} is for step {saved.get('global_step')} but the checkpoint's trainer "
                                 f"state is at step {self.state.global_step}; resume from another checkpoint")
            self._cp_stream.loader.load_state_dict(saved["loader"])
            self._cp_stream.skip_next = skipped  # the Trainer discards these; the loader is already past them
        return epochs_trained, skipped


def _check_arguments(args) -> None:
    """Refuse TrainingArguments CPTrainer cannot honour (one sentence each)."""
    if args.dataloader_num_workers:
        raise ValueError(f"CPTrainer builds each rank's batch in its training process (reading, tokens and the "
                         f"attention meta, a few ms per batch), so worker processes cannot help, got "
                         f"dataloader_num_workers={args.dataloader_num_workers}; set it to 0")
    if args.auto_find_batch_size:
        raise ValueError("CPTrainer's micro-batch is per_device_train_batch_size packed sequences of the data's "
                         "fixed context length, so there is no batch size to search for; set "
                         "auto_find_batch_size=False")
    if args.label_smoothing_factor:
        raise ValueError(f"CPTrainer's loss has no label smoothing, got label_smoothing_factor="
                         f"{args.label_smoothing_factor}; set it to 0")
    if args.train_sampling_strategy not in _SAMPLING:
        raise ValueError(f"CPTrainer orders packed sequences 'random' (shuffled with data_seed) or 'sequential', "
                         f"got train_sampling_strategy='{args.train_sampling_strategy}'")


class CPTrainer(CPTrainerMixin, Trainer):  # type: ignore[misc]
    """``transformers.Trainer`` with flashcp context parallelism on packed documents (module docstring).

    Launch ``dp x cp`` ranks with torchrun; every rank runs the same script::

        trainer = CPTrainer(model=model, args=TrainingArguments(..., per_device_train_batch_size=2),
                            train_dataset="DATA", plan="cp4-flashcp2",
                            eval_dataset="EVAL", eval_plan="cp4-flashcp2")
        trainer.train()
        trainer.evaluate()  # {"eval_loss": ...}
    """


@cache
def _cp_sft_trainer() -> type:
    from trl import SFTConfig, SFTTrainer

    class CPSFTTrainer(CPTrainerMixin, SFTTrainer):  # type: ignore[misc,valid-type]
        """``trl.SFTTrainer`` with flashcp context parallelism on packed documents (see ``CPTrainer``).

        Pass the tokenizer the data was packed with as ``processing_class``. SFTTrainer's dataset preparation
        (tokenizing, packing, truncating) is skipped; its collator is unused.
        """

        def __init__(self, *args, **kwargs):
            training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
            if training_args is not None and not isinstance(training_args, SFTConfig):
                values = training_args.to_dict()
                values["hub_token"] = training_args.hub_token  # to_dict hides it
                training_args = SFTConfig(**values)
            if training_args is not None:
                if training_args.packing or training_args.padding_free:
                    raise ValueError("CPSFTTrainer's data is packed by flashcp already; set packing=False and "
                                     "padding_free=False")
                training_args.dataset_kwargs = {**(training_args.dataset_kwargs or {}), "skip_prepare_dataset": True}
                if len(args) > 1:
                    args = (args[0], training_args, *args[2:])
                else:
                    kwargs["args"] = training_args
            super().__init__(*args, **kwargs)

        def _base_eval_dataset(self, dataset: Dataset) -> Any:
            """The same as for training: SFTTrainer looks at an eval dataset's columns too."""
            return self._base_train_dataset(dataset)

        def _base_train_dataset(self, dataset: Dataset) -> Any:
            """SFTTrainer wants a ``datasets`` dataset to look at: the packed sequences' tokens, row by row."""
            import datasets

            def rows(root: str):
                data = Dataset(root)
                for index in range(len(data.files)):
                    parquet = data.parquet(index)
                    for group in range(parquet.metadata.num_row_groups):
                        for tokens in parquet.read_row_group(group, columns=["tokens"]).column("tokens").to_pylist():
                            yield {"input_ids": tokens}

            return datasets.IterableDataset.from_generator(rows, gen_kwargs={"root": str(dataset.root)})

    CPSFTTrainer.__qualname__ = "CPSFTTrainer"
    return CPSFTTrainer


def __getattr__(name: str) -> Any:
    if name == "CPSFTTrainer":  # built on first access: importing trl is slow and trl is optional
        return _cp_sft_trainer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
