"""CPLoader: one rank's view of a planned dataset, one packed sequence per batch, resumable.

Every rank opens the same dataset and plan with the same seed, so all ranks see the same *global stream*:
the epochs' sequence orders one after the other. Under data parallelism (``dp_size`` replicas, each a CP
group) a step takes the next ``dp_size`` sequences of the stream, the ``d``-th to replica ``d``; every rank
of a CP group gets the same sequence at the same step and keeps only its own tokens (its shards in plan row
order). Every sequence of an epoch goes to exactly one replica, exactly once.

Epoch end: the ``num_sequences % dp_size`` sequences left at the end of an epoch are neither dropped nor
padded: the step that takes them takes the first sequences of the next epoch's order too, so every step has
``dp_size`` sequences and every rank runs the same number of steps (no rank waits for a step others skip).
Iterating the loader yields this replica's sequences of the steps that *start* in the current epoch; the
next pass continues after the ones the straddling step took from the next epoch.

Reading: a replica reads the row groups its sequences live in, so at ``dp_size`` D every rank reads about D
times the rows it trains on (one sequence in D of each row group); a row group is Parquet's smallest read.
With DP balance a window's steps draw from every row group of the window, so the loader keeps those row
groups read (token ids as int32) until the window is done: memory of about ``W * D / rows per row group + 1``
row groups instead of 2.

Data is read a row group at a time, and only the ``tokens`` and ``doc_lens`` columns: Parquet's smallest
read is one column chunk of one row group, so "only what the rank needs" means only the rows and columns it
needs; the rank then slices out its tokens plus the one token after each of its shards (the label of a
shard's last token may live on another rank). The matching plan rows are read from only the plan row groups
that hold them.

Order: with ``shuffle`` the row groups of all data files are permuted per epoch, and the rows inside each
row group too, from ``(seed, epoch)``; without it, file order. That *stream order* does not depend on
``dp_size``. ``state_dict()`` records the global position: the epoch and how many sequences of it all replicas
together have taken; ``load_state_dict`` resumes at the next one without reading the ones before it. The
position is the same on every rank, so a run may resume with another ``dp_size`` (a DeviceMesh of another
shape): it continues at the same global position, no sequence repeated or skipped.

DP step balance (``balance_window`` W > 0 and ``dp_size`` D > 1): a step waits for its most costly sequence,
so the stream is cut into *windows* of W steps (W * D sequences) and each window's sequences are regrouped
into steps by cost (``flashcp.runtime.balance.balanced_order``: sorted by the plan's ``seq_cost``, dealt D at a
time; the steps of a window in a random order from ``(seed, epoch, window start)``). A step then holds
sequences of similar cost, drawn from its window of W steps; each epoch still holds every sequence once, and
the windows move through the epoch in stream order. ``balance_window=0`` (or ``dp_size`` 1) keeps the stream
order. The first window of an epoch starts after the sequences the previous epoch's straddling step took; the
last ends at the epoch's end (its partial step, the cheapest sequences, is completed by the next epoch). The
state records the window the position is in (its bounds and the ``dp_size`` it was grouped for): a run resumed
with another ``dp_size`` finishes that window as it was grouped (its steps then mix that window's groups,
nothing repeated or skipped) and groups the following windows for the new ``dp_size``.

Online planning (``plan=None``): for data that was never planned, each sequence is planned as it is read
(in the prefetch worker when there is one) with the default strategy and its default parameters, validated
as ``flashcp plan`` validates (``planner.planning.plan_rows``): the plan ``flashcp plan --cp N`` would store.
Every rank plans the same sequence alike, so no rank talks to another. The planner is imported only then
(importing the runtime loads no planning kernel); its first use compiles or loads its kernels. Sequence costs
for DP balance come from the data's document lengths under the model's shape (``model=``, else
``DEFAULT_MODEL``'s, as ``flashcp plan``).

Shape legend: ``T`` this rank's tokens of the sequence.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from flashcp.costmodel.models import DEFAULT_MODEL, ModelError, ModelSpec, as_model_spec, resolve_model
from flashcp.costmodel.objective import sequence_flops
from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError, PlanError
from flashcp.planner.plan import SequencePlan
from flashcp.planner.plan_reader import PlanStore
from flashcp.runtime.balance import window_order
from flashcp.runtime.meta import CPAttnMeta, rank_token_positions
from flashcp.runtime.recurrent.meta import RecurrentMeta

__all__ = ["Batch", "CPLoader", "stream_rows"]

IGNORE_INDEX = -100
"""Label of a document's last token (nothing to predict inside the document)."""


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Batch:
    """One packed sequence as this rank sees it."""

    input_ids: torch.Tensor
    """(T,) int64: this rank's tokens, its shards in plan row order."""
    position_ids: torch.Tensor
    """(T,) int64: each token's position inside its document (shards starting mid-document continue)."""
    labels: torch.Tensor
    """(T,) int64: the next token of the same document, even when another rank holds it; -100 at a
    document's last token."""
    attn: CPAttnMeta
    """What ``cp_attention`` needs for this rank and sequence."""
    num_label_tokens: int
    """Labels other than -100 in the whole sequence (all ranks): divide summed losses by it."""
    file_index: int
    """Data file the sequence comes from."""
    row: int
    """Row of the sequence in that file."""
    plan: SequencePlan | None = None
    """The sequence's plan, which ``attn`` was built from (None for a batch built by hand);
    ``flashcp.runtime.batching.concat_batches`` builds the meta of several sequences from it."""
    doc_lens: np.ndarray | None = None
    """(num_docs,) int64: the sequence's document lengths (None for a batch built by hand)."""

    def recurrent(self) -> RecurrentMeta:
        """The RecurrentMeta of this rank and sequence, for a model with recurrent layers (built on each call).

        Raises ValueError for a batch built by hand without its plan and document lengths.
        """
        if self.plan is None or self.doc_lens is None:
            raise ValueError("a batch without its plan and doc_lens has no RecurrentMeta; take the batch from "
                             "CPLoader (or flashcp.runtime.batching.concat_batches)")
        return RecurrentMeta.from_plan(self.plan, self.doc_lens, self.attn.rank)

    def to(self, device: torch.device | str, non_blocking: bool = False, comm: str | None = None,
           kv_bytes: int = 2) -> Batch:
        """Return this batch with its tensors and attention meta on ``device``.

        ``non_blocking`` copies the token tensors asynchronously when they are in pinned memory (see
        ``flashcp.runtime.prefetch``). ``comm``: move only the meta tensors that comm mode reads
        (``CPAttnMeta.to``; ``"auto"`` resolved for K/V of ``kv_bytes`` bytes); None moves all of them.
        """
        return replace(self, input_ids=self.input_ids.to(device, non_blocking=non_blocking),
                       position_ids=self.position_ids.to(device, non_blocking=non_blocking),
                       labels=self.labels.to(device, non_blocking=non_blocking),
                       attn=self.attn.to(device, comm=comm, kv_bytes=kv_bytes))


@dataclass(frozen=True, slots=True)
class _Unit:
    """A row group of a data file: the loader's unit of reading."""

    file_index: int
    row_group: int
    first_row: int
    num_rows: int


class CPLoader:
    """Iterate a planned dataset as CP rank ``rank`` of ``world_size`` in DP replica ``dp_rank`` of ``dp_size``.

    See the module docstring for the order, the epoch end and resuming.

    Args:
        data_dir: the dataset folder.
        plan: the plan's name (a folder under ``DATA/plans``); None plans each sequence as it is read (module
            docstring, online planning).
        rank: this rank inside its CP group, in ``[0, world_size)``.
        world_size: the CP group's size; must equal the plan's ``cp``.
        dp_rank: this rank's data-parallel replica, in ``[0, dp_size)``.
        dp_size: data-parallel replicas (CP groups) reading the dataset together.
        seed: base of the per-epoch order.
        shuffle: permute row groups and rows per epoch (else file order).
        balance_window: steps per DP balance window (module docstring); 0 keeps the stream order. Only used
            with ``dp_size > 1``.
        model: the model being trained (a ``ModelSpec``, a built-in name, or a Hugging Face config as a dict or
            object); a stored plan priced for another model warns once (``check_model``). None: not checked.

    Raises FlashcpError (one sentence) for a missing dataset or plan, a stale plan, a plan for another world
    size, a lengths-only dataset, or a rank or replica outside its group.
    """

    def __init__(self, data_dir: str | Path, plan: str | None, rank: int, world_size: int, *, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True, balance_window: int = 16,
                 model: ModelSpec | str | dict | Any | None = None):
        if balance_window < 0:
            raise FlashcpError(f"balance_window must be 0 (off) or a number of steps, got {balance_window}")
        if dp_size < 1:
            raise FlashcpError(f"dp_size must be at least 1, got {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise FlashcpError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.dataset = Dataset(data_dir)
        if not self.dataset.has_tokens:
            raise FlashcpError(f"dataset {self.dataset.root} is lengths-only (made with 'synth "
                               "--no-tokens'); the loader needs token ids")
        if not 0 <= rank < world_size:
            raise FlashcpError(f"rank {rank} is outside [0, {world_size})")
        spec = None if model is None else _model_spec(model)
        self.store: PlanStore | None = None
        self._online: _OnlinePlanner | None = None
        if plan is None:
            self._online = _OnlinePlanner(self.dataset.context_len, world_size, spec)
        else:
            self.store = PlanStore(self.dataset, plan)
            if self.store.cp != world_size:
                raise FlashcpError(f"plan '{plan}' was made for cp {self.store.cp} but world_size is "
                                   f"{world_size}; launch {self.store.cp} ranks or run "
                                   f"'flashcp plan --cp {world_size}'")
            plan_rows = [int(f["rows"]) for f in self.store.meta["plan_files"]]
            if plan_rows != [f.rows for f in self.dataset.files]:
                raise FlashcpError(f"plan '{plan}' has {sum(plan_rows)} rows in {len(plan_rows)} files but the "
                                   f"data has {self.dataset.num_sequences} in {len(self.dataset.files)}; re-run "
                                   "'flashcp plan --force'")
        self.plan_name, self.rank, self.world_size = plan, rank, world_size
        self.dp_rank, self.dp_size = int(dp_rank), int(dp_size)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.balance_window = int(balance_window)
        self.context_len = self.dataset.context_len
        self._units = _list_units(self.dataset)
        self._epoch = 0
        self._position = 0
        self._window = (0, 0, self.dp_size)  # the balance window of the position: (start, stop, its dp_size)
        self._windows: dict[tuple[int, int, int, int], np.ndarray] = {}
        self._costs: np.ndarray | None = None
        self._stream: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))
        self._file_first = np.r_[0, np.cumsum([f.rows for f in self.dataset.files])].astype(np.int64)
        self._orders: dict[int, tuple[list[tuple[_Unit, np.ndarray]], list[int]]] = {}
        self._reads: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._read_cap = 2
        self._model_warned = False
        if spec is not None:
            self._check_model(spec)

    def check_model(self, model: ModelSpec | str | dict | Any) -> None:
        """Warn once (``UserWarning``) when the stored plan was priced for another model than ``model``.

        ``model``: as ``CPLoader``'s ``model=`` (FlashcpError for one that cannot be read). Models are the same
        when every field but the name is (a built-in and its published ``config.json`` are). A plan made
        before plan.json recorded its model counts as priced for its shape (H = H_kv = 32, D = 128 unless its
        parameters say otherwise). Online planning (no stored plan) checks nothing.
        """
        self._check_model(_model_spec(model))

    def _check_model(self, spec: ModelSpec) -> None:
        # stacklevel 3: the warning names the line that built the loader or called check_model
        if self.store is None or self._model_warned:
            return
        planned = self.store.model
        if planned is not None:
            other = {**planned.as_dict(), "name": spec.name} != spec.as_dict()
            what = f"model {planned.name}"
        else:
            shape = self.store.cost_shape
            other = (shape.num_heads, shape.num_kv_heads, shape.head_dim) != \
                (spec.num_heads, spec.num_kv_heads, spec.head_dim)
            what = f"H={shape.num_heads}, H_kv={shape.num_kv_heads}, D={shape.head_dim} (no model recorded)"
        if other:
            self._model_warned = True
            warnings.warn(f"plan '{self.plan_name}' was priced for {what} but the model trained is {spec.name} "
                          f"({spec.num_heads} heads / {spec.num_kv_heads} K/V x {spec.head_dim}, "
                          f"{spec.num_layers} layer{'s' if spec.num_layers != 1 else ''}), so its balance is "
                          "another model's: re-plan with "
                          "'flashcp plan --model' naming this model", UserWarning, stacklevel=3)

    @classmethod
    def from_mesh(cls, data_dir: str | Path, plan: str | None, mesh, *, dp_dim: str | None = "dp",
                  cp_dim: str = "cp", seed: int = 0, shuffle: bool = True,
                  balance_window: int = 16, model: ModelSpec | str | dict | Any | None = None) -> CPLoader:
        """The loader of this process's place in ``mesh``, a ``torch.distributed.device_mesh.DeviceMesh``.

        ``mesh`` must name a ``cp_dim`` dimension (the CP group, whose size must be the plan's ``cp``) and,
        unless ``dp_dim`` is None, a ``dp_dim`` dimension (the replicas). Other dimensions (e.g. tensor
        parallel) are allowed; their ranks read the same data. Raises FlashcpError (one sentence) for a mesh
        without the named dimensions or whose cp size differs from the plan's. ``model``: as ``CPLoader``'s.
        """
        names = tuple(mesh.mesh_dim_names or ())
        wanted = [d for d in (dp_dim, cp_dim) if d is not None]
        missing = [d for d in wanted if d not in names]
        if missing:
            raise FlashcpError(f"the device mesh has dimensions {list(names)} but the loader needs "
                               f"{' and '.join(repr(d) for d in missing)}; build it with "
                               f"init_device_mesh(..., mesh_dim_names={tuple(wanted)})")
        cp = mesh.size(names.index(cp_dim))
        dp = mesh.size(names.index(dp_dim)) if dp_dim is not None else 1
        store_cp = PlanStore(Dataset(data_dir), plan).cp if plan is not None else cp
        if cp != store_cp:
            raise FlashcpError(f"plan '{plan}' was made for cp {store_cp} but the device mesh's '{cp_dim}' "
                               f"dimension has {cp} ranks; build the mesh with cp {store_cp} or run "
                               f"'flashcp plan --cp {cp}'")
        dp_rank = mesh.get_local_rank(dp_dim) if dp_dim is not None else 0
        return cls(data_dir, plan, mesh.get_local_rank(cp_dim), cp, dp_rank=dp_rank, dp_size=dp, seed=seed,
                   shuffle=shuffle, balance_window=balance_window, model=model)

    def __len__(self) -> int:
        """Sequences per epoch (all replicas together)."""
        return self.dataset.num_sequences

    @property
    def position(self) -> int:
        """Sequences of the current epoch that all replicas together have taken."""
        return self._position

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def state_dict(self) -> dict:
        """Where the loader stands: the global position (epoch, sequences of it taken by all replicas).

        The same on every rank. ``window``: the balance window the position is in, ``[start, stop, dp_size]``
        (empty when balance is off); ``dp_size`` and ``balance_window`` are recorded for information.
        """
        return {"plan": self.plan_name, "num_sequences": len(self), "seed": self.seed,
                "shuffle": self.shuffle, "epoch": self._epoch, "position": self._position,
                "window": list(self._window), "dp_size": self.dp_size, "balance_window": self.balance_window}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` at the same global position, with this loader's ``dp_size``.

        With the same ``dp_size`` the next batch is the one that would have followed; with another, the
        replicas continue together from the same place in the stream (nothing repeated or skipped): the
        current balance window keeps the grouping it was made with, the next ones are grouped for this
        ``dp_size``. A state without ``window`` (saved before DP balance), or whose position lies outside it,
        starts a new window at its position.
        """
        if state.get("plan") != self.plan_name or state.get("num_sequences") != len(self):
            raise FlashcpError(f"the loader state is for plan '{state.get('plan')}' over "
                               f"{state.get('num_sequences')} sequences, not plan '{self.plan_name}' over "
                               f"{len(self)}")
        if not 0 <= int(state["position"]) <= len(self):
            raise FlashcpError(f"the loader state's position {state['position']} is outside [0, {len(self)}]")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        start, stop, dp = (int(v) for v in state.get("window", (self._position, self._position, self.dp_size)))
        if not (0 <= start <= stop <= len(self) and dp >= 1):
            raise FlashcpError(f"the loader state's window {state.get('window')} is not a window of the "
                               f"{len(self)} sequences of an epoch")
        # a position moved by hand outside its window: a new window starts there
        self._window = (start, stop, dp) if start <= self._position <= stop else \
            (self._position, self._position, self.dp_size)

    def _order(self, epoch: int) -> tuple[list[tuple[_Unit, np.ndarray]], list[int]]:
        """The epoch's units in order with their row orders (relative to the unit), and each unit's start."""
        if epoch not in self._orders:
            order = _epoch_order(self._units, self.seed, epoch, self.shuffle)
            starts = np.r_[0, np.cumsum([u.num_rows for u, _ in order])][:-1].tolist()
            if len(self._orders) >= 2:  # a pass needs this epoch's order and at most the next one's
                self._orders.pop(min(self._orders))
            self._orders[epoch] = (order, starts)
        return self._orders[epoch]

    def __iter__(self) -> Iterator[Batch]:
        """Yield this replica's sequence of every step that starts in the current epoch, then move on."""
        num = len(self)
        while self._position < num:
            epochs, index = divmod(self._position + self.dp_rank, num)
            if epochs == 0:
                index = self._balanced(index)
            batch = self._sequence(self._epoch + epochs, index)
            self._position += self.dp_size
            if self._position >= num:  # the step may have taken the next epoch's first sequences
                self._epoch, self._position = self._epoch + self._position // num, self._position % num
                self._window = (self._position, self._position, self.dp_size)
                yield batch
                return
            while self._position >= self._window[1]:
                self._window = self._next_window(self._window[1])
            yield batch
        self._epoch, self._position = self._epoch + 1, 0  # an empty dataset, or resumed at the epoch's end
        self._window = (0, 0, self.dp_size)

    def stream_order(self, epoch: int) -> np.ndarray:
        """(num_sequences,) int64: the sequences of ``epoch``'s stream order, as global row indices.

        A global row index counts the rows of the data files one after the other (file 0's first).
        """
        if self._stream[0] != epoch:
            self._stream = (epoch, _global_rows(self._order(epoch)[0], self._file_first))
        return self._stream[1]

    def _next_window(self, start: int) -> tuple[int, int, int]:
        """The balance window that starts at ``start``: W steps of this loader's ``dp_size``, or the rest."""
        size = self.balance_window * self.dp_size if self.dp_size > 1 else 0
        if size == 0:
            return start, len(self), 1  # one window of single-sequence groups: the stream order
        return start, min(start + size, len(self)), self.dp_size

    def _balanced(self, index: int) -> int:
        """The stream position of the sequence at balanced position ``index`` of the current epoch."""
        window = self._window
        if index >= window[1]:  # the step reaches into the next window (after a change of dp_size)
            window = self._next_window(window[1])
        start, stop, dp = window
        if index < start or dp == 1:
            return index
        key = (self._epoch, start, stop, dp)
        if key not in self._windows:
            if self._costs is None:
                self._costs = np.concatenate([self._seq_costs(i) for i in range(len(self.dataset.files))])
            rows = self.stream_order(self._epoch)[start:stop]
            if len(self._windows) >= 2:  # the window of the position and the next one
                self._windows.pop(next(iter(self._windows)))
            self._windows[key] = start + window_order(self._costs[rows], dp, seed=self.seed, epoch=self._epoch,
                                                      start=start, shuffle=self.shuffle)
            _, starts = self._order(self._epoch)
            units = np.unique(np.searchsorted(starts, np.arange(start, stop), side="right"))
            self._read_cap = max(self._read_cap, units.size + 1)
        return int(self._windows[key][index - start])

    def _sequence(self, epoch: int, index: int) -> Batch:
        """The batch of the ``index``-th sequence of ``epoch``'s order."""
        order, starts = self._order(epoch)
        at = bisect.bisect_right(starts, index) - 1
        unit, rows = order[at]
        key = (unit.file_index, unit.row_group)
        if key not in self._reads:
            # the units being walked: one and, at an epoch's end, the next epoch's first; a balance window's
            # steps draw from every unit of the window, so all of them stay (least recently used leaves first)
            while len(self._reads) >= self._read_cap:
                self._reads.pop(next(iter(self._reads)))
            tokens, doc_offsets, doc_lens = self._read_unit(unit)
            plans = None if self.store is None else self.store.read_plans(unit.file_index, unit.first_row,
                                                                          unit.first_row + unit.num_rows)
            self._reads[key] = (tokens, doc_offsets, doc_lens, plans)
        self._reads[key] = self._reads.pop(key)
        tokens, doc_offsets, doc_lens, plans = self._reads[key]
        i = int(rows[index - starts[at]])
        lens = doc_lens[doc_offsets[i]:doc_offsets[i + 1]]
        seq_tokens = tokens[i * self.context_len:(i + 1) * self.context_len]
        if plans is not None:
            plan = plans[i].plan
        else:
            assert self._online is not None, "a loader without stored plans plans online"
            plan = self._online.plan(lens, unit.file_index, unit.first_row + i)
        return self._batch(seq_tokens, lens, plan, unit.file_index, unit.first_row + i)

    def _seq_costs(self, index: int) -> np.ndarray:
        """(rows,) float64: the price of every sequence of the ``index``-th data file (DP balance)."""
        if self.store is not None:
            return self.store.seq_costs(index)
        assert self._online is not None, "a loader without stored plans plans online"
        return sequence_flops(*self.dataset.read_doc_lens(index), self._online.shape)

    def _read_unit(self, unit: _Unit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        path = self.dataset.path(self.dataset.files[unit.file_index])
        try:
            table = self.dataset.parquet(unit.file_index).read_row_group(unit.row_group,
                                                                         columns=["tokens", "doc_lens"])
        except (OSError, pa.ArrowInvalid) as e:
            raise FlashcpError(f"data file {path} is corrupt ({e}); re-create the dataset") from None
        tokens_col = table.column("tokens").combine_chunks()
        lens_col = table.column("doc_lens").combine_chunks()
        token_offsets = tokens_col.offsets.to_numpy()
        if (np.diff(token_offsets) != self.context_len).any():
            raise FlashcpError(f"data file {path} has a row whose token count is not the context length "
                               f"{self.context_len}; re-create the dataset")
        doc_offsets = lens_col.offsets.to_numpy().astype(np.int64)
        return (tokens_col.flatten().to_numpy(), doc_offsets - doc_offsets[0],  # tokens stay int32 until sliced
                lens_col.flatten().to_numpy().astype(np.int64))

    def _batch(self, tokens_C: np.ndarray, doc_lens: np.ndarray, plan, file_index: int, row: int) -> Batch:
        try:
            attn = CPAttnMeta.from_plan(plan, doc_lens, self.rank)
        except PlanError as e:
            raise PlanError(f"plan '{self.plan_name}' does not fit row {row} of data file {file_index}: {e}; "
                            "re-run 'flashcp plan --force'") from None
        global_pos, position, doc = rank_token_positions(plan, doc_lens, self.rank)
        is_last = position + 1 == doc_lens[doc]
        labels = np.where(is_last, IGNORE_INDEX,
                          tokens_C[np.minimum(global_pos + 1, tokens_C.size - 1)]).astype(np.int64)
        return Batch(input_ids=torch.from_numpy(tokens_C[global_pos].astype(np.int64)),
                     position_ids=torch.from_numpy(position), labels=torch.from_numpy(labels), attn=attn,
                     num_label_tokens=int(doc_lens.sum() - doc_lens.size), file_index=file_index, row=row,
                     plan=plan, doc_lens=doc_lens)


def stream_rows(data_dir: str | Path, *, seed: int = 0, epoch: int = 0, shuffle: bool = True) -> np.ndarray:
    """(num_sequences,) int64: the global row indices of ``epoch``'s stream order, as ``CPLoader`` walks it.

    Needs no plan and no token ids (a lengths-only dataset works): for reports on the order, such as the DP
    step efficiency of ``flashcp bench --scenario dp``. A global row index counts the data files' rows one
    file after the other.
    """
    dataset = Dataset(data_dir)
    file_first = np.r_[0, np.cumsum([f.rows for f in dataset.files])].astype(np.int64)
    return _global_rows(_epoch_order(_list_units(dataset), int(seed), int(epoch), bool(shuffle)), file_first)


def _list_units(dataset: Dataset) -> list[_Unit]:
    """The row groups of every data file, in file order; FlashcpError when a file's rows are not the manifest's."""
    units = []
    for index in range(len(dataset.files)):
        meta = dataset.parquet(index).metadata
        first = 0
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            units.append(_Unit(index, g, first, rows))
            first += rows
        expected = dataset.files[index].rows
        if first != expected:
            raise FlashcpError(f"data file {dataset.path(dataset.files[index])} has {first} rows, the manifest "
                               f"says {expected}; re-create the dataset")
    return units


def _epoch_order(units: list[_Unit], seed: int, epoch: int, shuffle: bool) -> list[tuple[_Unit, np.ndarray]]:
    """The epoch's units in order, each with its rows' order (relative to the unit); module docstring."""
    if not shuffle:
        return [(u, np.arange(u.num_rows)) for u in units]
    unit_order = np.random.default_rng((seed, epoch)).permutation(len(units))
    return [(units[i], np.random.default_rng((seed, epoch, int(i))).permutation(units[i].num_rows))
            for i in unit_order]


def _global_rows(order: list[tuple[_Unit, np.ndarray]], file_first: np.ndarray) -> np.ndarray:
    rows = [file_first[u.file_index] + u.first_row + r for u, r in order]
    return np.concatenate([*rows, np.zeros(0, np.int64)]).astype(np.int64)


def _model_spec(model: ModelSpec | str | dict | Any) -> ModelSpec:
    try:
        return as_model_spec(model)
    except ModelError as e:
        raise FlashcpError(f"the loader's model cannot be read: {e}") from None


class _OnlinePlanner:
    """Plans one sequence at a time as ``flashcp plan --cp N [--model M]`` would: the default strategy, validated.

    ``model``: what the plans are priced for (None: ``DEFAULT_MODEL``, as ``flashcp plan``).
    """

    def __init__(self, context_len: int, cp: int, model: ModelSpec | None = None):
        # imported here: a loader of stored plans never loads a planning kernel
        from flashcp.planner.params import check_shape, model_params, resolve_params
        from flashcp.planner.planning import plan_rows
        from flashcp.planner.registry import DEFAULT_STRATEGY, get_strategy

        try:
            check_shape(context_len, cp)
        except ValueError as e:
            raise FlashcpError(f"cannot plan sequences of {context_len} tokens for {cp} ranks: {e}") from None
        self.cp = cp
        self.strategy = get_strategy(DEFAULT_STRATEGY)
        model = model or resolve_model(DEFAULT_MODEL)  # what 'flashcp plan' prices for by default
        self.params = resolve_params(self.strategy, **model_params(self.strategy, {}, model))
        self.shape = model.attention_shape()
        self._plan_rows = plan_rows

    def plan(self, doc_lens: np.ndarray, file_index: int, row: int) -> SequencePlan:
        """The validated plan of one sequence (row ``row`` of data file ``file_index``, for messages)."""
        planned = self._plan_rows(np.array([0, doc_lens.size], np.int64), doc_lens, self.cp, self.strategy,
                                  self.params, where=f"data file {file_index}", first_row=row,
                                  shape=self.shape)
        return planned.row(0, self.cp)
