"""Every process the tests start sees tests/fork_start first on PYTHONPATH: its `sitecustomize` makes the SGLang
Engines and servers they start fork their processes rather than spawn them (that file says why)."""
import os
from pathlib import Path

FORK_START = str(Path(__file__).resolve().parent / "fork_start")
if FORK_START not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (FORK_START, os.environ.get("PYTHONPATH")) if p)
