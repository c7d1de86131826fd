"""The benchmarks, run from a checkout (none of bench/ is in the wheel), one folder per kind of measurement:

- `common/`   what the server benchmarks share: starting servers, prompt datasets
- `engine/`   CPU `sgl.Engine` throughput per arm (`scripts/bench_engine.py`), a plain step's cost
- `serving/`  SGLang servers under load: concurrency sweeps, PD, the burst, recipes, the roofline, acceptance
- `memory/`   the draft KV pool: dtypes, draft windows, what a window buys at long contexts
- `soak/`     the soak / stress harness: hostile mixed workloads against DFLASH and plain servers
- `gpu/`      the GPU window: the prepared check (`scripts/gpu_session.sh`) and the training window (`gpu/train/`)

The timed Engine passes they share with the demo live in `dflash_sglang/measure/`. Importing a module here never
imports sglang: SGLang is imported inside the functions that drive a server or an Engine.
"""
