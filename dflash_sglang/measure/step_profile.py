"""Where an Engine's scheduler spends its time, by part of the step: a py-spy profile of a benchmark child, summed.

`bench_engine --profile` runs each arm's child under `py-spy record --subprocesses --nonblocking --format raw`
(sampled wall time of every thread that is not idle, `RATE` samples per second; nonblocking: a process paused for a
sample cannot be reaped at the Engine's shutdown), so the profile covers the Engine's scheduler process, where a step
runs. Each sampled stack of the scheduler's event loop (`SCHEDULER` in it: not its start-up, model loading included)
counts toward the first part of `PARTS` it contains; stacks of the other processes (the Engine's tokenizer,
detokenizer, the child's own calls) are left out. A part's cost is reported per output token of the timed rounds
(its samples x the sampling interval / those tokens): warm-ups and prefills are in the samples, so decode-heavy runs
(long outputs, one concurrency per run) read as the decode step.
Why: "the controller's plain step costs X% more than plain" needs a where, and only the scheduler knows (the
difference between arms of one part is what the change bought). The sampler shares the machine: a profiled run is
slower and its parts' sizes move with the load, so never quote its timings.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

RATE = 100  # py-spy samples per second
SCHEDULER = "Scheduler.event_loop"  # (event_loop_normal / event_loop_overlap: serving, not start-up)
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (  # (part, stack substrings: any one places a sample), first match
    ("draft K/V upkeep", ("PagedDrafter.commit (", "DraftGraphs.commit (", "PagedDrafter.commit_extend (",
                          "DeferredPlainCommit.catch_up (")),
    ("drafter pass", ("DFlashWorker._draft_pass (", "DraftGraphs.__call__ (", "DraftGraphs.select (")),
    ("target forward", ("ModelRunner.forward (",)),
    ("our worker, rest", ("dflash_sglang/adapter/",)),
    ("SGLang scheduler, rest", (SCHEDULER,)),
)


def command(out: Path, cmd: list[str]) -> list[str]:
    """`cmd` under py-spy, its raw stacks (one `frame;frame;... count` line each) written to `out`."""
    return ["py-spy", "record", "--subprocesses", "--nonblocking", "--format", "raw", "-r", str(RATE), "-o", str(out),
            "--", *cmd]


def parts(raw: str) -> Counter:
    """Samples per part of `PARTS` in py-spy's raw output (scheduler stacks only)."""
    counts: Counter = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if SCHEDULER not in stack or not n.isdigit():
            continue
        part = next(name for name, keys in PARTS if any(k in stack for k in keys))
        counts[part] += int(n)
    return counts


def ms_per_token(raw: str, tokens: int) -> dict[str, float]:
    """Each part's sampled milliseconds per output token (and `all`), in `PARTS` order."""
    counts = parts(raw)
    scale = 1e3 / RATE / max(tokens, 1)
    row = {name: round(counts[name] * scale, 2) for name, _ in PARTS}
    row["all"] = round(sum(counts.values()) * scale, 2)
    return row
