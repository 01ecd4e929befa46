"""The one console every command prints through, and the verbosity it honours.

Strings are never read as rich markup (a path holding ``[/b]`` prints as it is); styled output builds
``rich.text.Text`` instead. With ``--json`` the human text goes to stderr and stdout carries exactly one JSON
document: the result (:func:`emit_json`, with ``"ok": true``), or, when the command fails,
``{"ok": false, "error": SENTENCE}`` (:func:`emit_json_error`, called by the CLI's error handler).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

__all__ = ["console", "emit_json", "emit_json_error", "err_console", "error", "info", "json_output", "one_line",
           "progress", "set_json_output", "set_verbosity", "warn"]

console = Console(highlight=False, soft_wrap=True, markup=False)
err_console = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
_verbosity = 1  # 0 quiet, 1 normal, 2 verbose
_json = {"on": False, "emitted": False}


def set_json_output(on: bool) -> None:
    """With ``on``, everything printed goes to stderr: stdout is kept for :func:`emit_json`."""
    console.stderr = on
    _json["on"], _json["emitted"] = on, False


def json_output() -> bool:
    """True while a command runs with ``--json`` (its one JSON document not yet written)."""
    return _json["on"] and not _json["emitted"]


def emit_json(result: dict) -> None:
    """Write a command's machine-readable result to stdout as one JSON document (``"ok"`` first)."""
    sys.stdout.write(json.dumps({"ok": True, **result}, allow_nan=False, default=str) + "\n")
    sys.stdout.flush()
    _json["emitted"] = True


def emit_json_error(message: str) -> None:
    """With ``--json``, the one JSON document of a failed command: ``{"ok": false, "error": message}``."""
    if json_output():
        emit_json({"ok": False, "error": message})


def one_line(message: str) -> str:
    """``message`` with control characters (newlines in a hostile file name) shown as escapes."""
    return "".join(c if c >= " " and c != "\x7f" else repr(c)[1:-1] for c in message)


def set_verbosity(level: int) -> None:
    """0: only results and errors; 1: normal; 2: verbose detail."""
    global _verbosity
    _verbosity = level


def info(message: str, *, level: int = 1) -> None:
    """Print a status line when the verbosity is at least ``level``."""
    if _verbosity >= level:
        err_console.print(message)


def warn(message: str) -> None:
    """Print a warning (shown even with --quiet)."""
    err_console.print(Text.assemble(("warning:", "yellow"), " ", one_line(message)))


def error(message: str) -> None:
    """Print an expected error as one plain sentence on one line."""
    err_console.print(Text.assemble(("error:", "red"), " ", one_line(message)))


class Advance:
    """What ``progress`` yields: ``advance(n=1)`` moves the bar, ``advance.describe(text)`` says what is done now.

    A long phase before the first step (compiling, hashing) is described until ``describe(None)`` or, with
    ``until_advance``, until the next step puts the bar's own description back.
    """

    def __init__(self, bar: Progress | None = None, task=None, description: str = ""):
        self._bar, self._task, self._description, self._restore = bar, task, description, False

    def __call__(self, n: int = 1) -> None:
        if self._bar is None:
            return
        if self._restore:
            self._restore = False
            self._bar.update(self._task, description=self._description)
        self._bar.advance(self._task, n)

    def describe(self, text: str | None, *, until_advance: bool = False) -> None:
        """Show ``text`` as the bar's description (None: its own again)."""
        if self._bar is None:
            return
        self._restore = until_advance
        self._bar.update(self._task, description=self._description if text is None else text)


@contextmanager
def progress(description: str, total: int | None) -> Iterator[Advance]:
    """A progress bar on an interactive terminal; otherwise a no-op ``Advance``."""
    if not err_console.is_terminal or _verbosity == 0:
        yield Advance()
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err_console, transient=True)
    with bar:
        task = bar.add_task(description, total=total)
        yield Advance(bar, task, description)


def track(items: Iterable, description: str, total: int | None = None) -> Iterator:
    """Iterate ``items`` behind a progress bar when interactive."""
    with progress(description, total) as advance:
        for item in items:
            yield item
            advance()
