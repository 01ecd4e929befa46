"""Every ordered pair of strategies through the on-disk kernel cache, each in processes of its own.

For each strategy A: an empty Numba cache, ``flashcp plan --strategy A`` in one process; then, for each other
strategy B, a copy of that cache and ``flashcp plan --strategy B`` in a second process, then ``flashcp
verify``. Every plan is validated by ``plan`` itself and again by ``verify``; a pair fails when any of the
three exits non-zero. This is what a new user meets when a first command compiles some kernels and the
next one links them into new ones (tests/test_first_contact.py runs the README's order in CI; this runs
every order, which takes about an hour of CPU).

    python scripts/cache_pairs.py [--strategies flashcp2,flashcp,...] [--jobs 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flashcp.outputs import check_script_output, json_report, write_json_output  # noqa: E402
from flashcp.planner.registry import STRATEGIES  # noqa: E402

REPORT = json_report("flashcp-cache-pairs", "a scripts/cache_pairs.py report")
"""``--json`` replaces only such a report (flashcp.outputs: never a dataset's file or a user's)."""


def _run(args: list[str], cache: Path) -> tuple[int, str]:
    """``flashcp -q ARGS`` in a new process with its Numba cache in ``cache``: (exit code, end of stderr)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "flashcp", "-q", *args], env=env, capture_output=True,
                          text=True)
    return done.returncode, done.stderr.strip()[-500:]


def _pairs_of(first: str, others: list[str], root: Path, data: Path) -> list[dict]:
    """Plan ``first`` in an empty cache, then every other strategy in a copy of that cache."""
    base = root / f"cache-{first}"
    rc, err = _run(["plan", str(data / first), "--cp", "8", "--strategy", first], base)
    rows = []
    for second in others:
        cache = root / f"cache-{first}-then-{second}"
        shutil.copytree(base, cache)
        work = data / f"{first}-then-{second}"
        shutil.copytree(data / "clean", work)
        rc2, err2 = _run(["plan", str(work), "--cp", "8", "--strategy", second], cache)
        rc3, err3 = _run(["verify", str(work)], cache)
        rows.append({"first": first, "then": second, "first_rc": rc, "plan_rc": rc2, "verify_rc": rc3,
                     "ok": rc == rc2 == rc3 == 0, "error": err or err2 or err3})
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--jobs", type=int, default=1, help="first strategies run at once (default 1)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    names = [s for s in args.strategies.split(",") if s]
    if args.json is not None:
        check_script_output(args.json, REPORT)  # before the runs, not after them
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flashcp-pairs-") as tmp:
        root = Path(tmp)
        data = root / "data"
        synth = _run(["synth", str(data / "clean"), "--dist", "wlb", "--num-seqs", "8", "--context-len", "8192",
                      "--no-tokens"], root / "cache-synth")
        if synth[0] != 0:
            print(f"synth failed: {synth[1]}", file=sys.stderr)
            return 1
        for name in names:
            shutil.copytree(data / "clean", data / name)
        with ThreadPoolExecutor(args.jobs) as pool:
            groups = list(pool.map(lambda a: _pairs_of(a, [b for b in names if b != a], root, data), names))
    rows = [row for group in groups for row in group]
    for row in rows:
        print(f"{row['first']:>9} then {row['then']:<9} {'ok' if row['ok'] else 'FAILED: ' + row['error']}")
    failed = sum(not row["ok"] for row in rows)
    print(f"{len(rows)} ordered pairs, {failed} failed, {time.perf_counter() - started:.0f} s wall")
    if args.json is not None:
        write_json_output(args.json, REPORT, {"format": "flashcp-cache-pairs", "rows": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
