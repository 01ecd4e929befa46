"""CPLoader: one rank's view of a planned dataset, one packed sequence per batch, resumable.

Every rank of the CP group opens the same dataset and plan with the same seed, so all ranks walk the
sequences in the same order; each keeps only its own tokens (its shards in plan row order). Data is read a
row group at a time, and only the ``tokens`` and ``doc_lens`` columns: Parquet's smallest read is one column
chunk of one row group, so "only what the rank needs" means only the rows and columns it needs; the rank
then slices out its tokens plus the one token after each of its shards (the label of a shard's last token
may live on another rank). The matching plan rows are read from only the plan row groups that hold them.

Order: with ``shuffle`` the row groups of all data files are permuted per epoch, and the rows inside each
row group too, from ``(seed, epoch)``; without it, file order. ``state_dict()`` records the epoch and how
many sequences of it were yielded; ``load_state_dict`` resumes at the next one without reading the ones
before it.

Shape legend: ``T`` this rank's tokens of the sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError, PlanError
from flashcp.planner.store import PlanStore
from flashcp.runtime.meta import CPAttnMeta, rank_token_positions

__all__ = ["Batch", "CPLoader"]

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

    def to(self, device: torch.device | str) -> Batch:
        """Return this batch with its tensors and attention meta on ``device``."""
        return replace(self, input_ids=self.input_ids.to(device), position_ids=self.position_ids.to(device),
                       labels=self.labels.to(device), attn=self.attn.to(device))


@dataclass(frozen=True, slots=True)
class _Unit:
    """A row group of a data file: the loader's unit of reading."""

    file_index: int
    row_group: int
    first_row: int
    num_rows: int


class CPLoader:
    """Iterate a planned dataset as rank ``rank`` of ``world_size`` CP ranks; see the module docstring.

    Args:
        data_dir: the dataset folder.
        plan: the plan's name (a folder under ``DATA/plans``).
        rank: this rank, in ``[0, world_size)``.
        world_size: the CP group's size; must equal the plan's ``cp``.
        seed: base of the per-epoch order.
        shuffle: permute row groups and rows per epoch (else file order).

    Raises FlashcpError (one sentence) for a missing dataset or plan, a stale plan, a plan for another world
    size, a lengths-only dataset, or a rank outside the group.
    """

    def __init__(self, data_dir: str | Path, plan: str, rank: int, world_size: int, *, seed: int = 0,
                 shuffle: bool = True):
        self.dataset = Dataset(data_dir)
        if not self.dataset.has_tokens:
            raise FlashcpError(f"dataset {self.dataset.root} is lengths-only (made with 'synth "
                               "--no-tokens'); the loader needs token ids")
        self.store = PlanStore(self.dataset, plan)
        if self.store.cp != world_size:
            raise FlashcpError(f"plan '{plan}' was made for cp {self.store.cp} but world_size is "
                               f"{world_size}; launch {self.store.cp} ranks or run "
                               f"'flashcp plan --cp {world_size}'")
        if not 0 <= rank < world_size:
            raise FlashcpError(f"rank {rank} is outside [0, {world_size})")
        plan_rows = [int(f["rows"]) for f in self.store.meta["plan_files"]]
        if plan_rows != [f.rows for f in self.dataset.files]:
            raise FlashcpError(f"plan '{plan}' has {sum(plan_rows)} rows in {len(plan_rows)} files but the "
                               f"data has {self.dataset.num_sequences} in {len(self.dataset.files)}; re-run "
                               "'flashcp plan --force'")
        self.plan_name, self.rank, self.world_size = plan, rank, world_size
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.context_len = self.dataset.context_len
        self._units = self._list_units()
        self._epoch = 0
        self._position = 0

    def _list_units(self) -> list[_Unit]:
        units = []
        for index in range(len(self.dataset.files)):
            meta = self.dataset.parquet(index).metadata
            first = 0
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                units.append(_Unit(index, g, first, rows))
                first += rows
            expected = self.dataset.files[index].rows
            if first != expected:
                raise FlashcpError(f"data file {self.dataset.path(self.dataset.files[index])} has {first} "
                                   f"rows, the manifest says {expected}; re-create the dataset")
        return units

    def __len__(self) -> int:
        """Sequences per epoch."""
        return self.dataset.num_sequences

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def state_dict(self) -> dict:
        """Where the loader stands: epoch and sequences already yielded from it (plus identity checks)."""
        return {"plan": self.plan_name, "num_sequences": len(self), "seed": self.seed,
                "shuffle": self.shuffle, "epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()``: the next batch is the one that would have followed."""
        if state.get("plan") != self.plan_name or state.get("num_sequences") != len(self):
            raise FlashcpError(f"the loader state is for plan '{state.get('plan')}' over "
                               f"{state.get('num_sequences')} sequences, not plan '{self.plan_name}' over "
                               f"{len(self)}")
        if not 0 <= int(state["position"]) <= len(self):
            raise FlashcpError(f"the loader state's position {state['position']} is outside [0, {len(self)}]")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self._epoch, self._position = int(state["epoch"]), int(state["position"])

    def _order(self, epoch: int) -> list[tuple[_Unit, np.ndarray]]:
        """The epoch's units in order, each with its row order (rows relative to the unit)."""
        if not self.shuffle:
            return [(u, np.arange(u.num_rows)) for u in self._units]
        unit_order = np.random.default_rng((self.seed, epoch)).permutation(len(self._units))
        return [(self._units[i], np.random.default_rng((self.seed, epoch, int(i))).permutation(
            self._units[i].num_rows)) for i in unit_order]

    def __iter__(self) -> Iterator[Batch]:
        """Yield the rest of the current epoch, then move to the next epoch."""
        skip = self._position
        for unit, rows in self._order(self._epoch):
            if skip >= unit.num_rows:
                skip -= unit.num_rows
                continue
            tokens, doc_offsets, doc_lens = self._read_unit(unit)
            plans = self.store.read_plans(unit.file_index, unit.first_row, unit.first_row + unit.num_rows)
            for i in rows[skip:]:
                i = int(i)
                lens = doc_lens[doc_offsets[i]:doc_offsets[i + 1]]
                seq_tokens = tokens[i * self.context_len:(i + 1) * self.context_len]
                batch = self._batch(seq_tokens, lens, plans[i].plan, unit.file_index, unit.first_row + i)
                self._position += 1
                yield batch
            skip = 0
        self._epoch += 1
        self._position = 0

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
        return (tokens_col.flatten().to_numpy().astype(np.int64), doc_offsets - doc_offsets[0],
                lens_col.flatten().to_numpy().astype(np.int64))

    def _batch(self, tokens_C: np.ndarray, doc_lens: np.ndarray, plan, file_index: int, row: int) -> Batch:
        try:
            attn = CPAttnMeta.from_plan(plan, doc_lens, self.rank)
        except PlanError as e:
            raise PlanError(f"plan '{self.plan_name}' does not fit row {row} of data file {file_index}: {e}; "
                            "re-run 'flashcp plan --force'") from None
        global_pos, position, doc = rank_token_positions(plan, doc_lens, self.rank)
        is_last = position + 1 == doc_lens[doc]
        labels = np.where(is_last, IGNORE_INDEX, tokens_C[np.minimum(global_pos + 1, tokens_C.size - 1)])
        return Batch(input_ids=torch.from_numpy(tokens_C[global_pos]),
                     position_ids=torch.from_numpy(position), labels=torch.from_numpy(labels), attn=attn,
                     num_label_tokens=int(doc_lens.sum() - doc_lens.size), file_index=file_index, row=row)
