"""The throughput stage's Engine child: measure/passes.py's `run_child` (one Engine, a plan of timed generate
calls), and, with DFLASH_VERIFY_PROBE=1, one line per target verify in the scheduler's log.

The probe line says what the controller's step looked like on the device: `DFLASH verify probe: width=W bs=B tree=T
graphed=G t=SECONDS` (G: the verify replayed a CUDA graph). It wraps `adapter/step/verify.py run_target_verify`
before the worker imports it. SGLang starts its scheduler with multiprocessing's spawn, which imports this module again
there (as `__mp_main__`), so the wrapper is installed in the process that verifies; in the Engine's own process it is
installed and never called. Measurement only: the Engines that are timed for the table run without it.

  python -m dflash_sglang.bench.gpu.probe JOB.json
"""
from __future__ import annotations

import functools
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass

PROBE_ENV = "DFLASH_VERIFY_PROBE"
_LINE = re.compile(r"DFLASH verify probe: width=(\d+) bs=(\d+) tree=(\d) graphed=(\d) t=([\d.]+)")


def install() -> None:
    """Wrap run_target_verify (before adapter/step/worker.py binds the name) to print one probe line per call."""
    from dflash_sglang.adapter.step import verify

    original = verify.run_target_verify
    if getattr(original, "probed", False):
        return

    @functools.wraps(original)
    def probed(target_worker, batch, ids, positions, slots, tree_mask=None, *args, **kwargs):
        out = original(target_worker, batch, ids, positions, slots, tree_mask, *args, **kwargs)
        print(f"DFLASH verify probe: width={ids.shape[1]} bs={ids.shape[0]} tree={int(tree_mask is not None)} "
              f"graphed={int(bool(out[1]))} t={time.monotonic():.6f}", file=sys.stderr, flush=True)
        return out

    probed.probed = True
    verify.run_target_verify = probed


@dataclass(frozen=True)
class WidthUse:
    """How a controller used one verify width: steps, the share that replayed a CUDA graph, median step seconds (the
    time to the next verify while decoding continued)."""

    width: int
    tree: bool
    steps: int
    graphed_share: float
    step_ms: float | None


def width_uses(log_text: str, gap_s: float = 0.5) -> list[WidthUse]:
    """The probe lines of a log, grouped by (width, tree). A step's time is the interval to the next verify when it
    is under `gap_s` (longer ones held a prefill, a new round or the end)."""
    calls = [(int(m[1]), int(m[3]) == 1, int(m[4]) == 1, float(m[5])) for m in _LINE.finditer(log_text)]
    groups: dict[tuple[int, bool], list[tuple[bool, float | None]]] = {}
    for i, (width, tree, graphed, t) in enumerate(calls):
        dt = calls[i + 1][3] - t if i + 1 < len(calls) else None
        groups.setdefault((width, tree), []).append((graphed, dt if dt is not None and dt < gap_s else None))
    uses = []
    for (width, tree), steps in sorted(groups.items()):
        times = [dt for _, dt in steps if dt is not None]
        uses.append(WidthUse(width, tree, len(steps), sum(g for g, _ in steps) / len(steps),
                             round(1e3 * statistics.median(times), 2) if times else None))
    return uses


if os.environ.get(PROBE_ENV) == "1":  # every process of a probed Engine (the scheduler imports this module)
    install()


if __name__ == "__main__":
    from dflash_sglang.measure.passes import run_child

    run_child(sys.argv[1])
