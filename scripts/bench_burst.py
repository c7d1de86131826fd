#!/usr/bin/env python3
"""A mixed burst of requests against CPU SGLang servers, plain vs DFLASH, interleaved repeats with their spread.

    python scripts/bench_burst.py --arms plain,default,floor --concurrency 64,256 --repeats 3

See `dflash_sglang/bench/serving/burst.py` (what is sent and measured) and docs/benchmarks.md. Exits 1 when a greedy
answer differs from plain's or a request fails.
"""
from dflash_sglang.bench.serving.burst import main

if __name__ == "__main__":
    raise SystemExit(main())
