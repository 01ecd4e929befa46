"""``flashcp pack``: tokenize text inputs and pack them into sequences of exactly ``--context-len`` tokens."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from flashcp.cli.console import console, emit_json, emit_json_error, error, info, progress, set_json_output, warn
from flashcp.cli.options import engine_options
from flashcp.data.pack import PackConfig, PackResult, run_pack
from flashcp.data.packing import OVERFLOWS
from flashcp.data.tokenizer import BUILTINS, DEFAULT_TOKENIZER
from flashcp.errors import FlashcpError

__all__ = ["command"]


def _default_workers() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


@click.command("pack")
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Dataset folder to write (created if missing).")
@click.option("--context-len", required=True, type=int, help="Tokens per packed sequence, e.g. 131072.")
@click.option("--tokenizer", default=DEFAULT_TOKENIZER, show_default=True,
              help=f"A tokenizer.json file (or a folder holding one), or a built-in: {', '.join(BUILTINS)}.")
@click.option("--text-field", default="text", show_default=True,
              help="JSONL key or Parquet column with the text.")
@click.option("--overflow", type=click.Choice(OVERFLOWS), default="split", show_default=True,
              help="A document that does not fit: continue it in the next sequence, or drop its rest.")
@click.option("--workers", type=int, default=None,
              help="Tokenizer processes; the output is the same for any number [default: the CPU cores, "
                   "at most 8].")
@click.option("--include", multiple=True, metavar="GLOB",
              help="In folders, also read files matching GLOB as plain text (repeatable), e.g. '*.py'.")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="In folders, skip files and folders matching GLOB (repeatable), e.g. site-packages.")
@click.option("--eos/--no-eos", default=True, show_default=True, help="Append EOS after every document.")
@click.option("--strict", is_flag=True,
              help="Stop at the first bad record instead of skipping and counting it.")
@click.option("--force", is_flag=True, help="Overwrite a dataset or unfinished pack already in the folder.")
@click.option("--rows-per-file", type=int, default=0, help="Sequences per data file [default: ~64M tokens].")
@click.option("--row-group-rows", type=int, default=0,
              help="Sequences per Parquet row group [default: ~4M tokens].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout (text on stderr).")
@engine_options("Run here, or on a Ray cluster (the same bytes; needs pip install 'flashcp[ray]').")
def command(inputs: tuple[str, ...], output: Path, context_len: int, tokenizer: str, text_field: str,
            overflow: str, workers: int | None, include: tuple[str, ...], exclude: tuple[str, ...], eos: bool,
            strict: bool, force: bool, rows_per_file: int, row_group_rows: int, as_json: bool = False,
            engine: str = "local", ray_address: str | None = None) -> None:
    """Pack INPUT files (JSONL, JSONL.gz, Parquet, plain text; folders and globs of them) into a dataset.

    Documents are tokenized, EOS is appended, and they fill sequences of exactly --context-len tokens in
    input order. Bad records are skipped and counted; re-running an interrupted pack resumes it.
    """
    set_json_output(as_json)
    try:
        config = PackConfig(inputs=inputs, output=output, context_len=context_len, tokenizer=tokenizer,
                            text_field=text_field, overflow=overflow, append_eos=eos, include=include,
                            exclude=exclude, strict=strict,
                            workers=_default_workers() if workers is None else workers,
                            rows_per_file=rows_per_file, row_group_rows=row_group_rows, force=force)
    except ValueError as e:
        raise FlashcpError(str(e)) from None
    if ray_address is not None and engine != "ray":
        raise FlashcpError("--ray-address needs --engine ray")
    try:
        if engine == "ray":
            result = _run_on_ray(config, ray_address, workers)
        else:
            with progress("packing sequences", None) as advance:
                result = run_pack(config, on_rows=advance, on_phase=_phase(advance))
    except KeyboardInterrupt:
        message = f"interrupted; run the same command again to resume the pack in {output}"
        error(message)
        emit_json_error(message)
        raise SystemExit(130) from None
    for message in result.warnings:
        warn(message)
    for message in result.notes:
        info(message)
    manifest, counts = result.manifest, result.manifest["counts"]
    new_tokens = counts["tokens_packed"] - result.resumed_tokens
    if as_json:
        emit_json({"dataset": str(output), "already_done": result.already_done,
                   "resumed_parts": result.resumed_parts, "seconds": result.seconds,
                   "tokens_per_s": None if result.already_done else new_tokens / max(result.seconds, 1e-9),
                   "warnings": list(result.warnings), "notes": list(result.notes), "manifest": manifest})
    if result.already_done:
        console.print(f"{output} already holds this dataset ({manifest['num_sequences']:,} sequences of "
                      f"{manifest['context_len']:,} tokens); nothing to do")
        return
    if result.resumed_parts:
        info(f"resumed an interrupted pack after {result.resumed_parts} finished data file(s)")
    tokens = counts["tokens_packed"]
    resumed = f", {new_tokens:,} of them in this run" if result.resumed_parts else ""
    console.print(f"packed {manifest['num_sequences']:,} sequences of {context_len:,} tokens "
                  f"({tokens:,} tokens{resumed}) from {counts['documents_packed']:,} documents into {output} "
                  f"in {result.seconds:.1f} s "
                  f"({new_tokens / max(result.seconds, 1e-9):,.0f} tokens/s)")
    info(f"documents: {counts['documents_read']:,} read, {counts['documents_split']:,} split, "
         f"{counts['documents_truncated']:,} truncated, {counts['documents_dropped_empty']:,} empty; "
         f"{counts['tokens_dropped_tail']:,} tokens ({counts['documents_dropped_tail']:,} documents) in the "
         "last, partial sequence dropped")


def _run_on_ray(config: PackConfig, address: str | None, workers: int | None) -> PackResult:
    """``run_pack`` with the Ray engine, on the cluster at ``address`` or on one started here."""
    from flashcp.engines.ray_cluster import ray_session, require_ray

    require_ray()
    from flashcp.engines.ray_pack import RayPackEngine

    started = time.perf_counter()
    with ray_session(address, workers) as ray:
        engine = RayPackEngine(workers)
        info(f"Ray: {engine.cpus} CPUs of {len(ray.nodes())} node(s) in use, ready in "
             f"{time.perf_counter() - started:.1f} s", level=2)
        with progress("packing sequences", None) as advance:
            return run_pack(config, on_rows=advance, engine=engine, on_phase=_phase(advance))


def _phase(advance):
    """Say each long phase of a pack: as the bar's description, and as a line with -v."""
    def on_phase(text: str) -> None:
        advance.describe(text)
        info(text, level=2)

    return on_phase
