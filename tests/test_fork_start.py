"""tests/fork_start/sitecustomize.py, the tests' start-up hook: where no CUDA device is, SGLang's request for the spawn
start method becomes fork, after the model registry is imported and the imports frozen out of gc's way; a machine with
a CUDA device (the GPU session's) keeps spawn and imports nothing; DFLASH_TEST_SPAWN=1 leaves spawn everywhere."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

FORK_START = Path(__file__).resolve().parent / "fork_start"
SHIMS = Path(__file__).resolve().parent / "sglang_shims"

# a child that answers what SGLang's Engine would get: the start method after its set_start_method("spawn"), whether
# the model registry was imported by then, and whether gc leaves the imports alone (frozen)
PROBE = """
import gc, multiprocessing, sys
import torch
torch.cuda.is_available = lambda: {cuda}
multiprocessing.set_start_method("spawn", force=True)
print(multiprocessing.get_start_method(), "sglang.srt.models.registry" in sys.modules, gc.get_freeze_count() > 0)
"""


def _probe(cuda: bool, spawn_env: str | None = None) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FORK_START), str(SHIMS), os.environ.get("PYTHONPATH", "")])}
    env.pop("DFLASH_TEST_SPAWN", None)
    if spawn_env is not None:
        env["DFLASH_TEST_SPAWN"] = spawn_env
    proc = subprocess.run([sys.executable, "-c", PROBE.format(cuda=cuda)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang")
@pytest.mark.parametrize("cuda,spawn_env,expect", [
    (False, None, ["fork", "True", "True"]),  # the CPU machine: forked, the registry inherited
    (True, None, ["spawn", "False", "False"]),  # a CUDA machine: SGLang's own start, nothing imported early
    (False, "1", ["spawn", "False", "False"]),  # asked to spawn everywhere
])
def test_spawn_becomes_fork_only_without_cuda(cuda, spawn_env, expect):
    assert _probe(cuda, spawn_env) == expect
