"""Every process the tests start sees tests/fork_start first on PYTHONPATH: its `sitecustomize` makes the SGLang
Engines and servers they start fork their processes rather than spawn them (that file says why).

Under pytest-xdist (`.ci/run`: two workers on CI's two cores) each worker's own torch runs one thread: with torch's
default of one thread per core, two busy workers ran four OpenMP threads on two cores, which spin while they wait for
each other (beside the e2e file's Engines, tests/test_reference.py had used 17 CPU-minutes and was not done; alone it
takes 4.5 minutes). The same holds for what a worker starts (servers, scripts, Engines): they inherit
OMP_NUM_THREADS=1 (the e2e Engines set it themselves; a script given --threads sets its own). A CPU server's script
test beside a busy core took 91-92 s with torch's two threads and 53-55 s with one (docs/benchmarks.md "CI cost")."""
import os
from pathlib import Path

FORK_START = str(Path(__file__).resolve().parent / "fork_start")
if FORK_START not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (FORK_START, os.environ.get("PYTHONPATH")) if p)


def pytest_configure(config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # (every process this worker starts)
