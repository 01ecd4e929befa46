"""Peak memory of ``flashcp pack`` does not grow with the input: pack a small and a large JSONL input.

    python scripts/pack_memory.py                      # 0.1 GB and 1 GB, byte tokenizer, 2 workers
    python scripts/pack_memory.py --sizes-gb 0.1,1,2 --tokenizer deepseek-v3

The inputs are generated into a temporary folder (documents cut from the standard library's text) and
deleted afterwards. Each pack runs in a fresh process; its peak RSS and the peak RSS of its worker processes
come from getrusage.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _corpus import write_synthetic_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MEASURE = """
import json, resource, sys, time
from pathlib import Path
from flashcp.data.pack import PackConfig, run_pack
src, out, tokenizer, workers, context_len = sys.argv[1:6]
started = time.perf_counter()
result = run_pack(PackConfig(inputs=(src,), output=Path(out), context_len=int(context_len),
                             tokenizer=tokenizer, workers=int(workers)))
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "tokens": result.manifest["counts"]["tokens_read"],
                  "sequences": result.manifest["num_sequences"],
                  "main_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", default="0.1,1", help="input sizes in GB (1e9 bytes), comma-separated")
    parser.add_argument("--tokenizer", default="byte")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--context-len", type=int, default=16384)
    parser.add_argument("--tmp", default=None, help="folder for the generated input and output")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="flashcp-pack-memory-", dir=args.tmp))
    rows = []
    try:
        for size_gb in [float(s) for s in args.sizes_gb.split(",")]:
            src, out = work / "input.jsonl", work / "out"
            started = time.perf_counter()
            size, documents = write_synthetic_jsonl(src, int(size_gb * 1e9))
            generated = time.perf_counter() - started
            proc = subprocess.run([sys.executable, "-c", MEASURE, str(src), str(out), args.tokenizer,
                                   str(args.workers), str(args.context_len)], cwd=ROOT, capture_output=True,
                                  text=True, check=True)
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            data_bytes = sum(p.stat().st_size for p in (out / "data").iterdir())
            rows.append({"input_gb": size / 1e9, "documents": documents, "generate_s": generated, **result,
                         "data_gb": data_bytes / 1e9})
            print(f"input {size / 1e9:6.2f} GB ({documents:,} docs): packed {result['tokens']:,} tokens into "
                  f"{result['sequences']:,} sequences in {result['seconds']:.1f} s "
                  f"({result['tokens'] / result['seconds'] / 1e6:.2f} M tokens/s); peak RSS main "
                  f"{result['main_peak_rss_mb']:.0f} MB, workers {result['worker_peak_rss_mb']:.0f} MB; "
                  f"data {data_bytes / 1e9:.2f} GB", flush=True)
            shutil.rmtree(out)
            src.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"tokenizer": args.tokenizer, "workers": args.workers, "context_len": args.context_len,
                      "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
