"""Helpers of the command-line tests: ``run`` invokes ``flashcp`` in-process."""

import shutil

from click.testing import CliRunner

from flashcp.cli import cli


def run(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def fresh_copy(dataset, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(dataset, target)
    shutil.rmtree(target / "plans", ignore_errors=True)
    return target
