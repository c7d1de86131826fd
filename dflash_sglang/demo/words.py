"""What the demo says, shared by its two backends (demo/main.py, demo/engines.py) and `dflash-sglang generate`: the
goodput controller's choice over a run in a user's words, from its `summary` (core/shape/goodput.py), and when a timing
is no result."""
from __future__ import annotations

from collections import Counter

from ..core.shape.goodput import describe

BUSY_SHARE = 0.15  # other processes' share of the machine's CPU above which timings are not reported as results


def _priced(summary: dict) -> bool:
    """Whether the controller has priced plain and drafted shapes (its cost model is ready) and took steps."""
    pred = summary.get("predicted_tps") or {}
    return "1" in pred and len(pred) > 1 and sum(summary["steps"].values()) > 0


# What the controller chose, in a user's words (both backends' reports start with one of these)
PLAIN_CHOICE = "drafting does not pay on this machine with this drafter: ran plain steps"
DRAFT_CHOICE = "drafting pays on this machine with this drafter: drafted"


def controller_choice(summary: dict) -> str:
    """What the goodput controller chose, in a user's words: the clause `controller_verdict` and the demo's headline
    start with."""
    if not _priced(summary):
        return "no verdict yet: too few steps to price plain and drafted steps"
    if summary["best"] == "1":
        return PLAIN_CHOICE
    return f"{DRAFT_CHOICE} (best a {spoken(summary['best'])})"


def controller_verdict(summary: dict, reasons: Counter | None = None) -> str:
    """One line: what the goodput controller chose over the run (first, `controller_choice`), how often, and why, from
    its `summary` (core/shape/goodput.py) and, when known, its decisions by reason."""
    if not _priced(summary):
        return f"controller: {describe(summary)}"
    steps, pred, best = summary["steps"], summary["predicted_tps"], summary["best"]
    total = sum(steps.values())
    drafted = {s: g for s, g in pred.items() if s != "1"}
    top = max(drafted, key=drafted.get)
    plain_share = steps.get("1", 0) / total
    how = "" if reasons is None else (f"; {reasons['warmup']} warm-up steps (longest chain, plain, middle chain), "
                                      f"{reasons['probe']} probes of a longer chain")
    if best == "1":
        share = f"{plain_share:.0%} of its {total} steps{how}"
        why = (f"a plain step is predicted {pred['1']} tok/s, the best drafted shape (a {spoken(top)}) "
               f"{drafted[top]} tok/s")
    else:
        share = f"{1 - plain_share:.0%} of its {total} steps drafted{how}"
        why = f"a {spoken(best)} is predicted {pred[best]} tok/s vs plain {pred['1']} tok/s"
    return f"controller: {controller_choice(summary)} ({share}): {why} ({describe(summary)})"


def spoken(shape: str) -> str:
    """'4' -> 'chain of 4 rows', '8x4' -> 'tree of 8 nodes over top-4' (core/shape/goodput.py `label`)."""
    nodes, _, topk = shape.partition("x")
    return f"tree of {nodes} nodes over top-{topk}" if topk else f"chain of {nodes} rows"
