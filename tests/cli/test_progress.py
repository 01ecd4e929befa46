"""Long phases say what they do: the progress bar's description while a plan compiles or a pack hashes and
tokenizes, before the first step moves the bar."""

from __future__ import annotations

import contextlib
import io
import json

from rich.console import Console
from rich.progress import Progress

import flashcp.cli.pack as pack_cli
import flashcp.cli.plan as plan_cli
from flashcp.cli.console import Advance
from tests.cli import fresh_copy, run


class Recorder:
    """An ``Advance`` that keeps every description it is given and every step."""

    def __init__(self):
        self.descriptions, self.steps = [], 0

    def __call__(self, n=1):
        self.steps += n

    def describe(self, text, *, until_advance=False):
        self.descriptions.append(text)


def recording(recorder):
    @contextlib.contextmanager
    def progress(description, total):
        yield recorder

    return progress


def test_advance_describes_a_phase_until_the_next_step():
    bar = Progress(console=Console(file=io.StringIO()))
    task = bar.add_task("planning cp2 flashcp2", total=4)
    advance = Advance(bar, task, "planning cp2 flashcp2")
    advance.describe("compiling the planner kernels", until_advance=True)
    assert bar.tasks[0].description == "compiling the planner kernels"
    advance()
    assert bar.tasks[0].description == "planning cp2 flashcp2" and bar.tasks[0].completed == 1
    advance.describe("hashing")
    advance()
    assert bar.tasks[0].description == "hashing"  # kept until replaced
    Advance()(1)  # the no-op of a non-interactive run


def test_plan_says_on_its_bar_that_it_compiles(dataset, tmp_path, monkeypatch):
    import flashcp.planner.batch as batch

    root = fresh_copy(dataset, tmp_path)
    recorder = Recorder()
    monkeypatch.setattr(plan_cli, "progress", recording(recorder))
    monkeypatch.setattr(batch, "needs_compile", lambda strategy: True)
    result = run("plan", root, "--cp", 2, "--strategy", "llama3")
    assert result.exit_code == 0, result.output
    assert "compiling planner kernels, first run only" in result.output
    assert recorder.descriptions == ["planning cp2 llama3: compiling the planner kernels (once; later runs load "
                                     "them from the cache)"]
    assert recorder.steps == 24


def test_pack_says_each_long_phase(tmp_path, monkeypatch):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": "word " * 40}) + "\n" for _ in range(8)))
    recorder = Recorder()
    monkeypatch.setattr(pack_cli, "progress", recording(recorder))
    result = run("pack", tmp_path / "in.jsonl", "-o", tmp_path / "out", "--context-len", 64, "--tokenizer", "byte",
                 "--workers", 1, "-v")
    assert result.exit_code == 0, result.output
    hashing, packing = recorder.descriptions
    assert hashing.startswith("hashing 1 input file(s), 0.0 MB")
    assert packing.startswith("tokenizing and packing 0.0 MB into sequences of 64 tokens (counted as written")
    assert hashing in result.output and packing in result.output  # as lines too with -v
