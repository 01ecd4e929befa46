"""``--engine ray`` where Ray is not installed: one sentence saying what to install (runs without Ray too)."""

from __future__ import annotations

import socket
import sys

import pytest
from click.testing import CliRunner

from flashcp.cli import cli


def run(*args):
    return CliRunner().invoke(cli, [*map(str, args)], catch_exceptions=False)


def test_without_ray_one_sentence_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails as where it is not installed
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "abc"}\n')
    result = run("pack", src, "-o", tmp_path / "out", "--context-len", "8", "--tokenizer", "byte", "--engine",
                 "ray")
    assert result.exit_code == 1
    assert result.output.strip() == ("error: --engine ray needs Ray, which is not installed; install it with pip "
                                     "install 'flashcp[ray]'")
    assert not (tmp_path / "out").exists()
    result = run("pack", src, "-o", tmp_path / "out", "--context-len", "8", "--ray-address", "auto")
    assert result.exit_code == 1 and "--ray-address needs --engine ray" in result.output
    assert run("pack", src, "-o", tmp_path / "data", "--context-len", "2", "--tokenizer", "byte").exit_code == 0
    result = run("plan", tmp_path / "data", "--cp", "2", "--engine", "ray")
    assert result.exit_code == 1 and "install it with pip install 'flashcp[ray]'" in result.output
    assert not (tmp_path / "data" / "plans" / "cp2-flashcp").exists()


def test_an_address_nothing_answers_at_is_one_sentence(tmp_path):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process already joined a Ray cluster")
    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "abc"}\n')
    result = run("pack", src, "-o", tmp_path / "out", "--context-len", "2", "--tokenizer", "byte", "--engine", "ray",
                 "--ray-address", f"127.0.0.1:{port}")
    assert result.exit_code == 1 and f"no Ray cluster answers at 127.0.0.1:{port}" in result.output
    assert not (tmp_path / "out").exists()
