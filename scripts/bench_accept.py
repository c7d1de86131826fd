#!/usr/bin/env python3
"""Acceptance length per dataset/category and block size, with a histogram of committed tokens per step.

    python scripts/bench_accept.py --block-sizes 4,8,16 --num-prompts 32 --max-new-tokens 128

See `dflash_sglang/bench/serving/accept.py` (method) and docs/benchmarks.md, "Serving benchmarks". Last stdout line:
JSON. """
from dflash_sglang.bench.serving.accept import main

if __name__ == "__main__":
    raise SystemExit(main())
