"""The one console every command prints through, and the verbosity it honours."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["console", "err_console", "error", "info", "progress", "set_verbosity", "warn"]

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)
_verbosity = 1  # 0 quiet, 1 normal, 2 verbose


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
    err_console.print(f"[yellow]warning:[/] {escape(message)}")


def error(message: str) -> None:
    """Print an expected error as one plain sentence."""
    err_console.print(f"[red]error:[/] {escape(message)}", markup=True)


@contextmanager
def progress(description: str, total: int | None) -> Iterator:
    """A progress bar on an interactive terminal; otherwise a no-op advancing callable.

    Yields ``advance(n=1)``.
    """
    if not err_console.is_terminal or _verbosity == 0:
        yield lambda n=1: None
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err_console, transient=True)
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


def track(items: Iterable, description: str, total: int | None = None) -> Iterator:
    """Iterate ``items`` behind a progress bar when interactive."""
    with progress(description, total) as advance:
        for item in items:
            yield item
            advance()
