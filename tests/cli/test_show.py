"""``flashcp show`` (flashcp.cli.show): refusals."""

from tests.cli import fresh_copy, run


def test_show_out_of_range(dataset, tmp_path):
    root = fresh_copy(dataset, tmp_path)
    assert run("plan", root, "--cp", 2, "--strategy", "perdoc").exit_code == 0
    result = run("show", root, "--seq", 24)
    assert result.exit_code == 1 and "sequence 24 is out of range" in result.output
