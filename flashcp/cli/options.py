"""Click options that more than one command declares, declared once here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

__all__ = ["ENGINES", "engine_options"]

ENGINES = ("local", "ray")
"""Where ``--engine`` runs a command's heavy work: here, or on a Ray cluster (``flashcp.engines``)."""

F = TypeVar("F", bound=Callable)


def engine_options(engine_help: str) -> Callable[[F], F]:
    """``--engine`` (with the help ``engine_help``) and ``--ray-address``, for a command that can run on Ray.

    The command receives ``engine`` (``local`` or ``ray``) and ``ray_address`` (None unless given).
    """
    def decorate(command: F) -> F:
        command = click.option(
            "--ray-address", default=None, metavar="ADDRESS",
            help="With --engine ray: join the cluster at ADDRESS ('auto': the running one) instead of starting "
                 "Ray on this machine with --workers CPUs.")(command)
        return click.option("--engine", type=click.Choice(ENGINES), default="local", show_default=True,
                            help=engine_help)(command)

    return decorate
