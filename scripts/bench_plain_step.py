#!/usr/bin/env python3
"""A plain step under the goodput controller against a plain decoding step, in the reference decoder.

    python scripts/bench_plain_step.py --concurrency 1,16 --repeats 6 --new-tokens 48

Interleaved repeats, each arm's ratio to plain with its 95% interval, and where a step's time went. See
`dflash_sglang/bench/engine/plain_step.py` and docs/benchmarks.md. Last stdout line: JSON.
"""
from dflash_sglang.bench.engine.plain_step import main

if __name__ == "__main__":
    raise SystemExit(main())
