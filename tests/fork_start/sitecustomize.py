"""Test processes only: tests/conftest.py puts this folder on PYTHONPATH, and Python imports `sitecustomize` from the
path at start-up, so every process the tests start (Engine children, servers, scripts) runs this first.

What it does: the SGLang Engine or server such a process starts forks its scheduler and detokenizer processes instead
of spawning them. Why: SGLang forces the spawn start method (a CUDA context cannot be forked), so each of an Engine's
processes imports SGLang again, ~14 s of CPU apiece on CI's machine; on the CPU path nothing needs CUDA, and forked
processes inherit the parent's imports: a tiny Engine starts in ~23 s of CPU instead of ~56 (docs/testing.md, "What
CI costs"). What runs in the scheduler (SGLang's code and our worker's) is the same either way. The spawn path stays
tested: the stress test's tree server (tests/test_stress.py) starts spawned, with our worker in its scheduler.
Only where no CUDA device is (`_cuda_available`): a GPU machine's Engines spawn as SGLang intends.
DFLASH_TEST_SPAWN=1 spawns in every test process; any other value spawns in the processes whose command line holds it
(the stress test: `--speculative-eagle-topk`, its tree server). (`.ci/run` puts this folder on the GPU session's CPU
rehearsal's path too.)"""
import os
import sys

_SPAWN = os.environ.get("DFLASH_TEST_SPAWN", "")


def _cuda_available() -> bool:
    """A machine with a CUDA device keeps SGLang's spawn: there an Engine's own process may have made a CUDA context
    before it starts its schedulers (the GPU session's tests), and a forked child cannot use it. (SGLang imported
    torch already; asking whether a device exists makes no context.)"""
    import torch

    return torch.cuda.is_available()


def preload() -> bool:
    """What every forked scheduler would otherwise do again: import SGLang's model registry (it imports every model
    module to find the architecture's class, ~4 s of CPU) and collect garbage over every object of the imports (SGLang
    runs `gc.collect()` before sizing its KV pool, ~0.9 s). Done once in the process that forks (an Engine's, a
    server's, the e2e zygote's), whose children inherit the imports, and `gc.freeze()` moves what exists by then out of
    every later collection. A tiny Engine forked after it starts in ~1.1 s instead of ~5.9 (docs/benchmarks.md, "CI
    cost"); what runs in the scheduler is unchanged (its own import of the registry finds it loaded). Returns whether
    it did: False, and nothing imported, on a machine with a CUDA device (nothing may fork there, and a model module
    may ask the device at import)."""
    if _cuda_available():
        return False
    import gc

    import sglang.srt.models.registry  # noqa: F401

    gc.freeze()
    return True


if _SPAWN and _SPAWN != "1" and _SPAWN in sys.argv:  # (said, so that a test can tell that it spawned)
    print(f"fork_start: this process spawns (DFLASH_TEST_SPAWN={_SPAWN})", file=sys.stderr, flush=True)
elif _SPAWN != "1":
    import multiprocessing

    _set_start_method = multiprocessing.set_start_method

    def _fork_instead_of_spawn(method, force=False):
        if method == "spawn" and preload():  # (SGLang's Engine, just before it starts its processes)
            method = "fork"
        _set_start_method(method, force=force)

    multiprocessing.set_start_method = _fork_instead_of_spawn
