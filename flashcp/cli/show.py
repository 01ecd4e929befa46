"""``flashcp show``: a terminal picture of one sequence's plan."""

from __future__ import annotations

import click
import numpy as np
from rich.text import Text

from flashcp.cli.console import console, emit_json, set_json_output
from flashcp.costmodel.comm import comm_saving, exact_need_saving, exchange_volumes
from flashcp.costmodel.workload import rank_workloads
from flashcp.data.dataset import Dataset
from flashcp.errors import FlashcpError
from flashcp.planner.params import gpus_per_node, plan_gpus_per_node
from flashcp.planner.plan import SequencePlan
from flashcp.planner.plan_reader import PLAN_JSON, PLANS_DIR, PlanStore, recorded_profile

PALETTE = ("red", "green", "yellow", "blue", "magenta", "cyan", "bright_red", "bright_green", "bright_yellow",
           "bright_blue", "bright_magenta", "bright_cyan", "orange3", "purple", "turquoise2", "gold3")
BAR_WIDTH = 64
SMALL_BAR = 24
MAX_RANGES = 4
MAX_SPLIT_DOCS = 12


def _locate(dataset: Dataset, seq: int) -> tuple[int, int]:
    if seq < 0 or seq >= dataset.num_sequences:
        raise FlashcpError(f"sequence {seq} is out of range: {dataset.root} has {dataset.num_sequences:,} "
                           f"sequences (0..{dataset.num_sequences - 1})")
    first = 0
    for index, data_file in enumerate(dataset.files):
        if seq < first + data_file.rows:
            return index, seq - first
        first += data_file.rows
    raise AssertionError("unreachable")


def _pick_plan(dataset: Dataset, name: str | None) -> str:
    if name is not None:
        return name
    plans = sorted(p.parent.name for p in (dataset.root / PLANS_DIR).glob(f"[!.]*/{PLAN_JSON}"))
    if len(plans) == 1:
        return plans[0]
    if not plans:
        raise FlashcpError(f"{dataset.root} has no plans; run 'flashcp plan' first")
    raise FlashcpError(f"{dataset.root} has several plans ({', '.join(plans)}); choose one with --plan")


def _gpus_per_node(store: PlanStore) -> int:
    """The plan's ranks per node: its topology, else the profile recorded in its plan.json (never re-read)."""
    params = store.meta.get("params") or {}
    if gpus_per_node(params) is None:
        profile = recorded_profile(store.meta, f"plan '{store.name}'s {PLAN_JSON}")
        if profile is not None:
            return profile.gpus_per_node
    return plan_gpus_per_node(params)  # a plan.json from before profiles were recorded: the file at its path


def received_ranges(plan: SequencePlan, rank: int) -> list[tuple[int, int, int]]:
    """Exact-need receive list of ``rank``: (doc, start, end) ranges of K/V it needs and does not hold."""
    out = []
    mine = plan.shard_rank == rank
    for doc in np.unique(plan.shard_doc[mine]):
        sel = mine & (plan.shard_doc == doc)
        starts, ends = plan.shard_start[sel], plan.shard_start[sel] + plan.shard_len[sel]
        need_end = int(ends.max())
        cursor = 0
        for s, e in sorted(zip(starts.tolist(), ends.tolist())):
            if s > cursor:
                out.append((int(doc), cursor, s))
            cursor = max(cursor, e)
        if cursor < need_end:
            out.append((int(doc), cursor, need_end))
    return out


def _bar(fraction: float, width: int, style: str) -> Text:
    filled = int(round(max(0.0, min(1.0, fraction)) * width))
    return Text("█" * filled, style=style) + Text("░" * (width - filled), style="grey37")


def _shard_bar(plan: SequencePlan, rank: int, split_docs: set[int]) -> Text:
    idx = plan.rank_slice(rank)
    lengths = plan.shard_len[idx]
    total = int(lengths.sum())
    text = Text()
    done = 0
    for i, length in zip(idx, lengths):
        begin = round(done * BAR_WIDTH / total)
        done += int(length)
        end = round(done * BAR_WIDTH / total)
        doc = int(plan.shard_doc[i])
        text.append(("▓" if doc in split_docs else "█") * (end - begin), style=PALETTE[doc % len(PALETTE)])
    return text


def render(plan: SequencePlan, doc_lens: np.ndarray, title: str, gpus_per_node: int = 0) -> list[Text | str]:
    """Lines of the picture: per rank its shards in local order, workload and token bars, what it receives.

    Under a topology (``gpus_per_node`` > 0) the receive is split into inside the rank's node and from others.
    """
    cp = plan.cp
    split = 0 < gpus_per_node < cp
    volumes = exchange_volumes(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp, gpus_per_node)
    far, contrib, received = volumes.received_far, volumes.contributed, volumes.received
    work = rank_workloads(plan.shard_start, plan.shard_len, plan.shard_rank, cp)
    tokens = np.bincount(plan.shard_rank, weights=plan.shard_len, minlength=cp).astype(np.int64)
    context_len = int(doc_lens.sum())
    mean = work.mean()
    ranks_of = {int(d): set(plan.shard_rank[plan.shard_doc == d].tolist()) for d in np.unique(plan.shard_doc)}
    split_docs = {d for d, ranks in ranks_of.items() if len(ranks) > 1}
    lines: list[Text | str] = [
        Text(title, style="bold"),
        f"imbalance {work.max() / mean:.4f} · all-gather {int(contrib.max()):,} tokens "
        f"(saving {100 * comm_saving(int(contrib.max()), context_len, cp):.1f}%) · exact-need "
        f"{int(received.max()):,} tokens received (saving "
        f"{100 * exact_need_saving(int(received.max()), context_len, cp):.1f}%)",
        Text("█ whole on one rank   ▓ document spread over ranks (colour = document)", style="dim"),
        "",
    ]
    if split:
        lines.insert(2, f"{gpus_per_node} ranks per node: busiest rank receives {int((received - far).max()):,} "
                        f"tokens inside its node, {int(far.max()):,} from other nodes")
    for rank in range(cp):
        lines.append(Text(f"rank {rank:<3d} ", style="bold") + _shard_bar(plan, rank, split_docs))
        lines.append(Text("         work ") + _bar(work[rank] / work.max(), SMALL_BAR, "green")
                     + Text(f" {work[rank] / mean:.3f}x mean   tokens ")
                     + _bar(tokens[rank] / tokens.max(), SMALL_BAR // 2, "blue") + Text(f" {tokens[rank]:,}"))
        ranges = received_ranges(plan, rank)
        shown = ", ".join(f"doc {d} [{s:,}, {e:,})" for d, s, e in ranges[:MAX_RANGES])
        more = f" and {len(ranges) - MAX_RANGES} more" if len(ranges) > MAX_RANGES else ""
        nodes = f" ({int(received[rank] - far[rank]):,} in node {rank // gpus_per_node}, {int(far[rank]):,} " \
            "from other nodes)" if split else ""
        lines.append(Text(f"         receives {int(received[rank]):,} tokens of K/V{nodes}"
                          f"{': ' + shown + more if ranges else ''}; all-gather contribution "
                          f"{int(contrib[rank]):,}", style="dim"))
    if split_docs:
        lines.append("")
        lines.append(Text(f"documents on several ranks ({len(split_docs)}):", style="bold"))
        for doc in sorted(split_docs, key=lambda d: -int(doc_lens[d]))[:MAX_SPLIT_DOCS]:
            sel = plan.shard_doc == doc
            pieces = sorted(zip(plan.shard_start[sel].tolist(), plan.shard_len[sel].tolist(),
                                plan.shard_rank[sel].tolist()))
            cuts = " ".join(f"r{r}[{s:,}+{n:,}]" for s, n, r in pieces[:8])
            more = " ..." if len(pieces) > 8 else ""
            label = Text(f"  doc {doc} ({int(doc_lens[doc]):,} tokens): ", style=PALETTE[doc % len(PALETTE)])
            lines.append(label + Text(cuts + more))
    return lines


@click.command("show")
@click.argument("data", type=click.Path())
@click.option("--plan", "plan_name", default=None, help="Plan folder name, e.g. cp8-flashcp (the only plan "
              "when omitted).")
@click.option("--seq", type=int, default=0, show_default=True, help="Sequence index in the dataset.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the sequence's shards and per-rank numbers as JSON on stdout (picture on stderr).")
def command(data: str, plan_name: str | None, seq: int, as_json: bool) -> None:
    """Draw sequence SEQ's plan: each rank's shards, workload, tokens, and the K/V it receives."""
    set_json_output(as_json)
    dataset = Dataset(data)
    store = PlanStore(dataset, _pick_plan(dataset, plan_name))
    index, row = _locate(dataset, seq)
    offsets, lens = dataset.read_doc_lens(index)
    doc_lens = lens[offsets[row]:offsets[row + 1]]
    stored = store.read_plans(index, row, row + 1)[0]
    store.check_row(stored, doc_lens, index, row)  # a plan that does not fit its row is refused, not drawn
    title = (f"sequence {seq} ({dataset.files[index].path} row {row}): {doc_lens.size} documents, "
             f"{int(doc_lens.sum()):,} tokens; plan {store.name} ({store.strategy}, cp {store.cp})")
    per_node = _gpus_per_node(store)
    if as_json:
        emit_json(_to_json(stored.plan, doc_lens, per_node, sequence=seq, data_file=dataset.files[index].path,
                           row=row, plan_name=store.name, strategy=store.strategy,
                           model=None if store.model is None else store.model.as_dict()))
    lines = render(stored.plan, doc_lens, title, per_node)
    lines.insert(1, f"model: {store.describe_model()}")
    for line in lines:
        console.print(line)


def _to_json(plan: SequencePlan, doc_lens: np.ndarray, gpus_per_node: int = 0, **where) -> dict:
    cp = plan.cp
    volumes = exchange_volumes(plan.shard_doc, plan.shard_start, plan.shard_len, plan.shard_rank, cp, gpus_per_node)
    far, contrib, received = volumes.received_far, volumes.contributed, volumes.received
    work = rank_workloads(plan.shard_start, plan.shard_len, plan.shard_rank, cp)
    tokens = np.bincount(plan.shard_rank, weights=plan.shard_len, minlength=cp).astype(np.int64)
    return {
        **where, "cp": cp, "doc_lens": doc_lens.tolist(), "imbalance": float(work.max() / work.mean()),
        "ag_comm_tokens": int(contrib.max()), "a2a_comm_tokens": int(received.max()),
        "gpus_per_node": gpus_per_node, "a2a_intra_node_tokens": int((received - far).max()),
        "a2a_inter_node_tokens": int(far.max()),
        "shards": {"doc": plan.shard_doc.tolist(), "start": plan.shard_start.tolist(),
                   "len": plan.shard_len.tolist(), "rank": plan.shard_rank.tolist()},
        "ranks": [{"rank": r, "workload": float(work[r]), "tokens": int(tokens[r]),
                   "ag_contribution": int(contrib[r]), "received": int(received[r]),
                   "received_inter_node": int(far[r]), "node": r // gpus_per_node if gpus_per_node else 0,
                   "received_ranges": [list(x) for x in received_ranges(plan, r)]} for r in range(cp)],
    }
