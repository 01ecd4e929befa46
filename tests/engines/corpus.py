"""A corpus of every input format with bad records, and the pack command line, for the Ray engine's tests."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from flashcp.cli import cli

WORDS = ["alpha", "beta", "gamma", "délta", "ε", "zeta", "eta", "theta", "\n", "日本語"]


BAD_LINES = (
    (97, 5, b'{"text": "cut off\n'),
    (89, 7, b"\n"),
    (83, 9, b'{"title": "no text"}\n'),
    (79, 11, b'{"text": "caf\xe9"}\n'),
    (67, 15, b'{"text": 5}\n'),
    (71, 13, b'{"text": ""}\n'),
)
"""``(period, offset, line)``: line ``i`` of a JSONL file is ``line`` when ``i % period == offset`` (the first
that matches, in this order): a cut-off record, a blank line, no text field, invalid UTF-8, a non-string text,
an empty document."""


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_corpus(folder: Path, scale: int = 1, seed: int = 0) -> list[Path]:
    """Several files of every format, about ``scale`` x 0.5 MB: bad records, blank lines, empty documents,
    documents many times longer than the context, an empty input."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for part in range(2):
        path = folder / f"web-{part}.jsonl"
        with open(path, "wb") as f:
            for i in range(350 * scale):
                bad = next((line for period, offset, line in BAD_LINES if i % period == offset), None)
                if bad is not None:
                    f.write(bad)
                else:
                    f.write(json.dumps({"text": text(rng, 1500 if i % 40 == 0 else rng.randint(1, 120))}).encode())
                    f.write(b"\n")
        paths.append(path)
    path = folder / "books.jsonl.gz"
    with gzip.open(path, "wb") as f:
        for i in range(60 * scale):
            f.write(json.dumps({"text": text(rng, rng.randint(1, 400))}).encode() + b"\n")
    paths.append(path)
    path = folder / "table.parquet"
    values = [None if i % 37 == 3 else b"\xff\xfe" if i % 41 == 4 else text(rng, rng.randint(1, 150)).encode()
              for i in range(300 * scale)]
    pq.write_table(pa.table({"text": pa.array(values, pa.binary())}), path, row_group_size=40)
    paths.append(path)
    (folder / "empty.jsonl").write_bytes(b"")
    paths.append(folder / "empty.jsonl")
    (folder / "notes.txt").write_text(text(rng, 2000))
    paths.append(folder / "notes.txt")
    return paths


def run(*args, catch: bool = False):
    return CliRunner().invoke(cli, [*map(str, args)], catch_exceptions=catch)


def pack_args(inputs, context_len: int = 1024, *extra) -> list[str]:
    return [*map(str, inputs), "--context-len", str(context_len), "--rows-per-file", "6", "--row-group-rows", "4",
            *extra]
