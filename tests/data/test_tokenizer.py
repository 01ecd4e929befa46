"""The tokenizers of ``flashcp pack`` (flashcp.data.tokenizer): bytes, the offline default and tokenizer.json files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flashcp.data.tokenizer import Encoder, resolve_tokenizer
from flashcp.errors import FlashcpError


def test_byte_tokenizer_appends_eos():
    spec = resolve_tokenizer("byte")
    tokens, lens = Encoder(spec, append_eos=True).encode(["ab", "", "é"])
    assert tokens.dtype == np.int32 and lens.tolist() == [3, 1, 3]
    assert tokens.tolist() == [97, 98, 256, 256, 0xC3, 0xA9, 256]
    tokens, lens = Encoder(spec, append_eos=False).encode(["ab", ""])
    assert tokens.tolist() == [97, 98] and lens.tolist() == [2, 0]


def test_default_tokenizer_is_offline_deepseek_with_its_eos():
    spec = resolve_tokenizer("deepseek-v3")
    assert spec.eos_id == 1 and spec.vocab_size == 129280 and len(spec.sha256) == 64
    encoder = Encoder(spec, append_eos=True)
    tokens, lens = encoder.encode(["Hello world", "a<｜end▁of▁sentence｜>b"])
    first = tokens[:lens[0]].tolist()
    assert first[-1] == 1 and 1 not in tokens[lens[0]:-1].tolist()  # text cannot inject EOS
    assert encoder._tokenizer.decode(first[:-1]) == "Hello world"


def test_tokenizer_json_path_and_errors(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    spec = resolve_tokenizer(str(tmp_path))
    assert spec.eos_id == 3 and spec.name == str(tmp_path / "tokenizer.json")
    assert Encoder(spec, append_eos=True).encode(["hello world moon"])[0].tolist() == [1, 2, 0, 3]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "world"}}))
    assert resolve_tokenizer(str(tmp_path / "tokenizer.json")).eos_id == 2
    with pytest.raises(FlashcpError, match=r"unknown tokenizer 'gpt7'.*deepseek-v3, byte"):
        resolve_tokenizer("gpt7")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(FlashcpError, match="not a readable tokenizer.json"):
        resolve_tokenizer(str(tmp_path / "broken.json"))
