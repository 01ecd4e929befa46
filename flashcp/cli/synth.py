"""``flashcp synth``: a synthetic dataset whose document lengths follow a distribution."""

from __future__ import annotations

import time
from pathlib import Path

import click

from flashcp.cli.console import console, info
from flashcp.data.synth import check_synth_args, load_distribution, synth_dataset
from flashcp.errors import FlashcpError


@click.command("synth")
@click.argument("data", type=click.Path(file_okay=False))
@click.option("--dist", required=True, help="wlb, prolong, pile, or a JSON file listing document lengths.")
@click.option("--num-seqs", type=int, required=True, help="Packed sequences to write.")
@click.option("--context-len", type=int, required=True, help="Tokens per packed sequence.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed (lengths and token ids).")
@click.option("--no-tokens", is_flag=True, help="Write document lengths only (for planning at scale).")
@click.option("--vocab-size", type=int, default=32000, show_default=True,
              help="Token ids are uniform below this.")
@click.option("--rows-per-file", type=int, default=None,
              help="Sequences per data file [default: ~256 MiB of tokens, 8192 without tokens].")
def command(data: str, dist: str, num_seqs: int, context_len: int, seed: int, no_tokens: bool,
            vocab_size: int, rows_per_file: int | None) -> None:
    """Write DATA: NUM_SEQS sequences of CONTEXT_LEN tokens packed from documents drawn from DIST."""
    started = time.perf_counter()
    if context_len < 2:
        raise FlashcpError(f"context length must be at least 2 tokens (as for 'flashcp pack'), got {context_len}")
    check_synth_args(Path(data), num_seqs=num_seqs, context_len=context_len, vocab_size=vocab_size,
                     rows_per_file=rows_per_file)  # bad arguments fail before anything is said or written
    load_distribution(dist)
    info(f"drawing {num_seqs:,} sequences of {context_len:,} tokens from '{dist}'")
    manifest = synth_dataset(data, dist=dist, num_seqs=num_seqs, context_len=context_len, seed=seed,
                             with_tokens=not no_tokens, vocab_size=vocab_size, rows_per_file=rows_per_file)
    counts = manifest["counts"]
    kind = "lengths only" if no_tokens else f"random token ids below {vocab_size:,}"
    console.print(f"wrote {data}: {manifest['num_sequences']:,} sequences x {context_len:,} tokens "
                  f"({kind}) in {len(manifest['files'])} data file(s); {counts['documents_read']:,} "
                  f"documents drawn, {counts['documents_truncated']:,} truncated at a window's end "
                  f"[{time.perf_counter() - started:.1f}s]")
