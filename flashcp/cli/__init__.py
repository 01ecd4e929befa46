"""The ``flashcp`` command line: one root group, one module per command, loaded on first use."""

from __future__ import annotations

import importlib
import importlib.util

import click

from flashcp import __version__
from flashcp.cli.console import error, set_json_output, set_verbosity
from flashcp.errors import FlashcpError

__all__ = ["cli", "main"]

# command name -> module under flashcp.cli exposing a click command called ``command``
COMMANDS = {
    "pack": "pack",
    "synth": "synth",
    "plan": "plan",
    "audit": "audit",
    "show": "show",
    "bench": "bench",
    "verify": "verify",
    "ls": "ls",
}


class LazyGroup(click.Group):
    """Imports a command's module only when that command runs (keeps ``flashcp --help`` fast)."""

    def list_commands(self, ctx):
        return [name for name, module in COMMANDS.items() if _has_module(module)]

    def get_command(self, ctx, name):
        if name not in COMMANDS or not _has_module(COMMANDS[name]):
            return None
        return _with_verbosity(importlib.import_module(f"flashcp.cli.{COMMANDS[name]}").command)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FlashcpError as e:
            error(str(e))
            ctx.exit(1)
        except OSError as e:  # the machine's state (disk full, permissions), never a flashcp bug
            where = f" {e.filename}" if e.filename else ""
            error(f"cannot access{where}: {e.strerror or e}")
            ctx.exit(1)


def _with_verbosity(command: click.Command) -> click.Command:
    """Accept ``-v`` / ``-q`` after the command name as well as before it."""
    names = {opt for param in command.params for opt in getattr(param, "opts", ())}
    for flags, level, text in ((("-v", "--verbose"), 2, "Print more detail."),
                               (("-q", "--quiet"), 0, "Print only results and errors.")):
        if not names & set(flags):
            command.params.append(click.Option(
                flags, is_flag=True, expose_value=False, help=text,
                callback=lambda ctx, param, value, level=level: set_verbosity(level) if value else None))
    return command


def _has_module(module: str) -> bool:
    return importlib.util.find_spec(f"flashcp.cli.{module}") is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flashcp")
@click.option("-v", "--verbose", is_flag=True, help="Print more detail.")
@click.option("-q", "--quiet", is_flag=True, help="Print only results and errors.")
def cli(verbose: bool, quiet: bool) -> None:
    """flashcp: load-balanced, communication-efficient context parallelism for long-context training."""
    set_verbosity(0 if quiet else 2 if verbose else 1)
    set_json_output(False)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="flashcp")


if __name__ == "__main__":
    main()
