"""flashcp: load-balanced, communication-efficient context parallelism with offline sharding plans."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flashcp")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"

__all__ = ["__version__"]

COMMAND_LINE = False
"""True in a ``flashcp`` command-line process (``flashcp.cli.main``), False in a library user's."""
