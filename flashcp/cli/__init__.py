"""The ``flashcp`` command line: one root group, one module per command, loaded on first use."""

from __future__ import annotations

import importlib
import warnings

import click

from flashcp import __version__
from flashcp.cli.console import emit_json_error, error, set_json_output, set_verbosity, warn
from flashcp.errors import FlashcpError, KernelCacheWarning

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
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        return _with_verbosity(importlib.import_module(f"flashcp.cli.{COMMANDS[name]}").command)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FlashcpError as e:
            _fail(ctx, str(e))
        except OSError as e:  # the machine's state (disk full, permissions), never a flashcp bug
            where = f" {e.filename}" if e.filename else ""
            _fail(ctx, f"cannot access{where}: {e.strerror or e}")
        except click.UsageError as e:  # a bad option: click's usage text, exit 2; with --json also the document
            if self._json_flag_given(ctx):
                set_json_output(True)
                emit_json_error(e.format_message())
            raise

    def parse_args(self, ctx, args):
        ctx.meta["flashcp.argv"] = list(args)  # what a usage error of the subcommand is checked against
        return super().parse_args(ctx, args)

    def _json_flag_given(self, ctx) -> bool:
        """True when the command line names a command whose ``--json`` is a flag, and passes it."""
        argv = ctx.meta.get("flashcp.argv", [])
        name = next((a for a in argv if not a.startswith("-")), None)
        command = self.get_command(ctx, name) if name else None
        flags = [p for p in getattr(command, "params", []) if "--json" in getattr(p, "opts", ())
                 and getattr(p, "is_flag", False)]
        return bool(flags) and "--json" in argv


def _fail(ctx: click.Context, message: str) -> None:
    """An expected error: one sentence on stderr (and the JSON document with --json), exit 1."""
    error(message)
    emit_json_error(message)
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


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="flashcp")
@click.option("-v", "--verbose", is_flag=True, help="Print more detail.")
@click.option("-q", "--quiet", is_flag=True, help="Print only results and errors.")
def cli(verbose: bool, quiet: bool) -> None:
    """flashcp: load-balanced, communication-efficient context parallelism for long-context training."""
    set_verbosity(0 if quiet else 2 if verbose else 1)
    set_json_output(False)
    _show_kernel_cache_warnings()


def _show_kernel_cache_warnings() -> None:
    """Print a ``KernelCacheWarning`` as one ``warning:`` line; other warnings as Python prints them."""
    if getattr(warnings.showwarning, "flashcp", False):
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, KernelCacheWarning):
            warn(str(message))
        else:
            shown(message, category, filename, lineno, file, line)

    show.flashcp = True  # type: ignore[attr-defined]
    warnings.showwarning = show


def main() -> None:
    """Console-script entry point."""
    import flashcp

    flashcp.COMMAND_LINE = True  # read by flashcp._numba when a command first needs the kernels
    cli(prog_name="flashcp")


if __name__ == "__main__":
    main()
