"""What the README tells a new user to run, read from the README itself."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_main_job() -> list[list[str]]:
    """The ``flashcp`` commands of the README's main-job line, in their order, as argument lists."""
    text = re.sub(r"[ \t]*\\\n[ \t]*", " ", (REPO / "README.md").read_text(encoding="utf-8"))  # one step a line
    match = re.search(r"^pip install -c constraints-cpu\.txt -e \. && (.+)$", text, re.M)
    assert match, "the README's main-job line is gone"
    steps = [shlex.split(part) for part in match.group(1).split(" && ")]
    return [step[1:] for step in steps if step[0] == "flashcp"]
