"""``flashcp pack --engine ray`` against the local engine, on the same input in one run.

    python scripts/ray_pack.py throughput --repeat 3  # stdlib JSONL, deepseek-v3: local 1/2 workers, ray 1/2 CPUs
    python scripts/ray_pack.py memory --gb 0.1,1     # generated JSONL, byte tokenizer, ray with 2 CPUs

Every pack runs in a fresh process (so each Ray run pays its own start-up, which is timed apart) and writes
into a temporary folder deleted afterwards. Reported per run:

- seconds and tokens/s of ``run_pack`` alone, and for Ray the start-up (``ray.init`` until a first task has
  returned) on top;
- the driver's own CPU time: of its main thread (``time.thread_time``: the layout, task submission and
  result fetching) and of the whole process (``time.process_time``: with Ray's client threads, which also
  tick while the driver waits); the tokenize and write tasks run in other processes;
- peak RSS of the driver, and the largest private RSS (``RssAnon``) of a worker process, with the most
  shared memory it had mapped (``RssShmem``: Ray's object store pages, shared by all workers), sampled from
  /proc every 0.2 s (Ray worker processes are the driver's descendants whose command line starts with
  ``ray::``; the local engine's are its multiprocessing children);
- every Ray run's output is checked byte for byte against the local one.

Ray runs its worker processes at nice 15; like ``flashcp pack --engine ray`` (``ray_session``), the bench sets
``RAY_worker_niceness=0`` so that on a shared machine they compete as the local engine's workers do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import stdlib_texts, write_jsonl, write_synthetic_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MEASURE = r"""
import json, os, sys, threading, time
from pathlib import Path
from flashcp.data.pack import PackConfig, run_pack

src, out, tokenizer, engine, workers, context_len = sys.argv[1:7]
workers, peaks, stop = int(workers), {"driver": 0, "worker": 0, "shared": 0}, threading.Event()

def rss_kb(pid, field="VmRSS:"):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))

def descendants():
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found

def sample():
    while not stop.wait(0.2):
        try:
            peaks["driver"] = max(peaks["driver"], rss_kb(os.getpid()))
        except OSError:
            pass
        for pid in descendants():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                if cmd.startswith(b"ray::") or b"multiprocessing" in cmd:
                    peaks["worker"] = max(peaks["worker"], rss_kb(pid, "RssAnon:"))
                    peaks["shared"] = max(peaks["shared"], rss_kb(pid, "RssShmem:"))
            except (OSError, StopIteration):
                pass

threading.Thread(target=sample, daemon=True).start()
config = PackConfig(inputs=(src,), output=Path(out), context_len=int(context_len), tokenizer=tokenizer,
                    workers=workers)
startup = 0.0
if engine == "ray":
    import logging
    import ray
    started = time.perf_counter()
    ray.init(num_cpus=workers, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    ray.get(ray.remote(lambda: 0).remote())
    startup = time.perf_counter() - started
    from flashcp.engines.ray_pack import RayPackEngine
    cpu, main, started = time.process_time(), time.thread_time(), time.perf_counter()
    result = run_pack(config, engine=RayPackEngine(workers))
else:
    cpu, main, started = time.process_time(), time.thread_time(), time.perf_counter()
    result = run_pack(config)
seconds, driver_cpu = time.perf_counter() - started, time.process_time() - cpu
main_cpu = time.thread_time() - main
stop.set()
peaks["driver"] = max(peaks["driver"], rss_kb(os.getpid()))
manifest = result.manifest
print(json.dumps({"seconds": seconds, "startup": startup, "driver_cpu": driver_cpu, "main_cpu": main_cpu,
                  "tokens": manifest["counts"]["tokens_read"], "documents": manifest["counts"]["documents_read"],
                  "driver_peak_mb": peaks["driver"] / 1024, "worker_peak_mb": peaks["worker"] / 1024,
                  "worker_shared_mb": peaks["shared"] / 1024}))
"""


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            h.update(path.relative_to(folder).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def measure(src: Path, work: Path, tokenizer: str, engine: str, workers: int, context_len: int) -> dict:
    out = work / f"out-{engine}-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(out), tokenizer, engine, str(workers),
                           str(context_len)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_worker_niceness": "0"})
    if proc.returncode != 0:
        raise SystemExit(proc.stderr)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["digest"] = digest(out)
    result["data_bytes"] = sum(p.stat().st_size for p in (out / "data").iterdir())
    shutil.rmtree(out)
    return result


def report(name: str, r: dict, base: dict | None) -> None:
    rate = r["tokens"] / r["seconds"]
    ratio = f"{base['seconds'] / r['seconds']:.2f}x" if base else "1.00x"
    same = "" if base is None else (" same bytes" if r["digest"] == base["digest"] else " DIFFERENT BYTES")
    print(f"| {name} | {r['seconds']:.1f} s | {rate / 1e6:.3f} M tok/s | {ratio} | {r['startup']:.1f} s | "
          f"{r['driver_cpu']:.2f} s, main thread {r['main_cpu']:.2f} s = {1e9 * r['main_cpu'] / r['tokens']:.1f} "
          f"ns/token | {r['driver_peak_mb']:.0f} MB | "
          f"{r['worker_peak_mb']:.0f} MB (+{r['worker_shared_mb']:.0f} MB shared) |{same}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["throughput", "memory"])
    parser.add_argument("--mb", type=float, default=None, help="throughput: first MB of the stdlib corpus")
    parser.add_argument("--gb", default="0.1,1", help="memory: generated input sizes (1e9 bytes); local runs on "
                        "the largest, and the driver's CPU per document is the difference between the first and "
                        "the last Ray run (start-up costs cancel)")
    parser.add_argument("--tokenizer", default=None, help="[throughput: deepseek-v3, memory: byte]")
    parser.add_argument("--context-len", type=int, default=16384)
    parser.add_argument("--tmp", default=None)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of all runs, interleaved; each run's best time is reported")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="flashcp-ray-bench-", dir=args.tmp))
    try:
        if args.what == "throughput":
            tokenizer = args.tokenizer or "deepseek-v3"
            src = work / "in.jsonl"
            size = write_jsonl(src, stdlib_texts(None if args.mb is None else int(args.mb * 1e6)))
            runs = [(src, size, "local", 1), (src, size, "local", 2), (src, size, "ray", 1), (src, size, "ray", 2)]
        else:
            tokenizer = args.tokenizer or "byte"
            runs = []
            for i, gb in enumerate(sorted(float(x) for x in args.gb.split(","))):
                src = work / f"in-{i}.jsonl"
                size, _ = write_synthetic_jsonl(src, int(gb * 1e9))
                runs.append((src, size, "ray", 2))
            runs.insert(len(runs) - 1, (src, size, "local", 2))
        print(f"tokenizer {tokenizer}, C = {args.context_len}")
        print("| input | run | pack | tokens/s | vs first run | Ray start-up | driver CPU | driver peak RSS "
              "| largest worker peak private RSS (+ object store pages mapped) |")
        print("|---|---|---|---|---|---|---|---|---|")
        best: dict = {}
        for round_ in range(args.repeat - 1):  # earlier rounds: only the best time of each run is kept
            for src, size, engine, workers in runs:
                r = measure(src, work, tokenizer, engine, workers, args.context_len)
                earlier = best.get((src, engine, workers))
                if earlier is None or r["seconds"] < earlier["seconds"]:
                    best[(src, engine, workers)] = r
                print(f"round {round_ + 1}: {engine} {workers}: {r['seconds']:.1f} s", flush=True)
        base, rays = None, []
        for src, size, engine, workers in runs:
            r = measure(src, work, tokenizer, engine, workers, args.context_len)
            earlier = best.get((src, engine, workers))
            if earlier is not None:
                print(f"round {args.repeat}: {engine} {workers}: {r['seconds']:.1f} s", flush=True)
                if earlier["seconds"] < r["seconds"]:
                    r = earlier
            if base is not None and base["tokens"] != r["tokens"]:
                base = None
            report(f"{size / 1e6:,.0f} MB | {engine}, {workers} {'worker' if engine == 'local' else 'CPU'}"
                   f"{'s' if workers > 1 else ''}", r, base)
            base = base or r
            rays += [r] if engine == "ray" else []
            print(f"|   | tokens {r['tokens']:,}, documents {r['documents']:,}, data files {r['data_bytes']:,} bytes "
                  f"({r['data_bytes'] / r['tokens']:.2f} B/token) |", flush=True)
        if len(rays) > 1 and rays[-1]["documents"] > rays[0]["documents"]:
            docs, tokens = rays[-1]["documents"] - rays[0]["documents"], rays[-1]["tokens"] - rays[0]["tokens"]
            for what, key in (("driver main thread", "main_cpu"), ("driver process", "driver_cpu")):
                cpu = rays[-1][key] - rays[0][key]
                print(f"{what} CPU, last Ray run minus first: {cpu:.2f} s for {docs:,} documents and {tokens:,} "
                      f"tokens = {1e6 * cpu / docs:.2f} us/document, {1e9 * cpu / tokens:.3f} ns/token")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
