"""The goodput controller's choices over time, from a benchmark Engine's log: what `bench_engine --trace` plots and
the SGLang demo (demo/engines.py) words.

With `--trace` a DFLASH arm's child logs the controller's per-step debug line (`adapter/step/shapes.py`: "DFLASH goodput
step: shape=<rows, or NODESxTOPK for a tree> bs=<batch> accepted=<drafts, summed over the batch> seconds=<wall>") to the
same log as the child's round lines ("[arm] s<k> c=<c> <wall>s" of a switch round, "[arm] c<c>.r<pass> c=<c> <wall>s"
of an eval round, printed after each round), so each step belongs to the round whose line follows it. The plot: the
verify rows chosen at every decode step (1 = a plain step; trees marked), with the tokens it committed, the rounds
shaded by phase. Debug logging costs the traced arm a little, so bench_engine's traces come from their own run, not a
timed one; the demo times its traced arm, on CPU, where a line's microseconds are nothing beside a ~90 ms step.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dflash_sglang.measure.plotting import pyplot

_STEP = re.compile(r"DFLASH goodput step: shape=(\d+)(?:x(\d+))? bs=(\d+) accepted=(\d+)")
_ROUND = re.compile(r"^\[[^\]]+\] (?:s(\d+)|c\d+\.r(\d+)|warmup) c=\d+ ")


@dataclass(frozen=True)
class TracedStep:
    nodes: int  # the verify rows chosen per request (1: a plain step)
    committed: float  # tokens committed per request (1 + mean accepted drafts)
    round: int  # the round it belongs to (switch: its index in the stream; eval: its pass)
    topk: int = 1  # > 1: a tree over this top-k

    @property
    def shape(self) -> str:
        """core/shape/goodput.py's label: '4' a chain of 4 rows (1: a plain step), '8x4' a tree of 8 nodes over
        top-4."""
        return f"{self.nodes}x{self.topk}" if self.topk > 1 else str(self.nodes)


def logging_config(path: Path) -> Path:
    """A dictConfig file for SGLANG_LOGGING_CONFIG_PATH: the controller's per-step lines on stderr."""
    path.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "handlers": {"stderr": {"class": "logging.StreamHandler"}},
        "loggers": {"dflash_sglang.adapter.step.shapes": {"level": "DEBUG", "handlers": ["stderr"],
                                                          "propagate": False}},
    }))
    return path


def parse_trace(log_text: str) -> list[TracedStep]:
    """The decode steps of a traced child log, each with its round (the warm-up's and any after the last round line
    are dropped)."""
    steps, pending = [], []
    for line in log_text.splitlines():
        if m := _STEP.search(line):
            pending.append((int(m[1]), 1 + int(m[4]) / int(m[3]), int(m[2] or 1)))
        elif m := _ROUND.match(line):
            if (k := m[1] or m[2]) is not None:
                steps += [TracedStep(n, c, int(k), t) for n, c, t in pending]
            pending = []
    return steps


def shape_mix(steps: list[TracedStep]) -> Counter[str]:
    """Decode steps per shape label ('1': plain steps)."""
    return Counter(s.shape for s in steps)


def plot_trace(steps: list[TracedStep], phases: list[str], path: Path) -> str | None:
    """phases[k]: the phase letter of round k ("A" / "B")."""
    plt = pyplot()
    if plt is None or not steps:
        return None
    fig, ax = plt.subplots(figsize=(10, 3.2))
    x = range(len(steps))
    start = 0
    for k in sorted({s.round for s in steps}):
        n = sum(1 for s in steps if s.round == k)
        if k < len(phases):
            ax.axvspan(start, start + n, color="tab:blue" if phases[k] == "A" else "tab:orange", alpha=0.12, lw=0)
        ax.axvline(start, color="grey", lw=0.4)  # a round (one request) starts
        start += n
    ax.step(x, [s.nodes for s in steps], where="post", color="black", lw=0.8, label="verify rows chosen")
    trees = [i for i, s in enumerate(steps) if s.topk > 1]
    if trees:
        ax.plot(trees, [steps[i].nodes for i in trees], "^", color="tab:green", ms=3, label="a tree")
    ax.plot(x, [s.committed for s in steps], ".", color="tab:red", ms=3, label="tokens committed")
    ax.set_xlabel("decode step (a line per round; blue: A, eval chat; orange: B, predictable)")
    ax.set_ylabel("rows / tokens")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
