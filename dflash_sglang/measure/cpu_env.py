"""The environment of a CPU SGLang process started from a source checkout (a benchmark arm's child, a test server):
SGLang's CPU build imports triton, vllm._custom_ops and torchvision, which a CPU machine lacks; the checkout's
import shims stand in for them."""
from __future__ import annotations

import os
from pathlib import Path


def cpu_env(repo: Path | None = None) -> dict[str, str]:
    """Environment additions for a CPU-build SGLang server run from a source checkout: the import shims of
    tests/sglang_shims (triton, vllm._custom_ops and torchvision are not installed on CPU) and the checkout first on
    PYTHONPATH (another interpreter sees our plugin), the plugin whitelisted, one OpenMP thread per process."""
    repo = Path(repo) if repo is not None else Path(__file__).resolve().parents[2]
    shims = repo / "tests" / "sglang_shims"
    paths = [str(shims)] if shims.is_dir() else []
    paths += [str(repo), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in paths if p), "SGLANG_PLUGINS": "dflash_sglang",
            "OMP_NUM_THREADS": "1"}
