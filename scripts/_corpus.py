"""Corpora for the pack benchmarks, made on the fly from the Python standard library's own files."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np


def stdlib_texts(max_bytes: int | None = None) -> list[str]:
    """UTF-8 .py and .txt files of the standard library (site-packages excluded), sorted by path."""
    root = Path(sysconfig.get_path("stdlib"))
    texts, total = [], 0
    for path in sorted(root.rglob("*")):
        if {"site-packages", "dist-packages"} & set(path.parts) or path.suffix not in (".py", ".txt"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            texts.append(text)
            total += len(text.encode())
            if max_bytes is not None and total >= max_bytes:
                break
    return texts


def write_jsonl(path: Path, texts: list[str]) -> int:
    """Write one {"text": ...} line per text; returns the file size."""
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False))
            f.write("\n")
    return path.stat().st_size


def write_synthetic_jsonl(path: Path, target_bytes: int, seed: int = 0) -> tuple[int, int]:
    """Documents cut from the standard library's text at random places, lengths log-normal (median ~2 KB,
    a few over 100 KB), until the file reaches ``target_bytes``. Returns ``(bytes, documents)``."""
    source = "\n".join(stdlib_texts())
    rng = np.random.default_rng(seed)
    written, documents = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_bytes:
            lengths = np.minimum(rng.lognormal(7.6, 1.3, 4096).astype(np.int64) + 1, 1 << 20)
            starts = rng.integers(0, len(source) - (1 << 20), lengths.size)
            lines = [json.dumps({"text": source[s:s + n]}, ensure_ascii=False) + "\n"
                     for s, n in zip(starts.tolist(), lengths.tolist())]
            chunk = "".join(lines)
            f.write(chunk)
            written += len(chunk.encode())
            documents += len(lines)
    return path.stat().st_size, documents
