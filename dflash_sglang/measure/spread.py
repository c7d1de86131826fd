"""A speed ratio over plain decoding (or another baseline arm) from interleaved repeats, and the words it may be
reported in.

One timing of each arm on a shared 2-core machine swings by +-15% from minute to minute; a ratio of such timings is
noise as often as signal. So arms run in turn, repeat after repeat (plain, arm, plain, arm, ...), each repeat gives
one ratio, and a ratio is called a speedup or slower only when its 95% interval excludes 1.0 (measure/passes.py
and the demo, demo/main.py, word their results with this).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

# Student t's 97.5% quantile for 1..30 degrees of freedom; more repeats use the last (a slightly wide interval, never
# a narrow one).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
FASTER, SLOWER, SAME, ONE_REPEAT = "speedup", "slower", "same as plain within noise", "one repeat"


@dataclass(frozen=True)
class RatioSpread:
    """An arm's speed over plain's: one ratio per interleaved repeat (the arm's tok/s / plain's tok/s in the same
    repeat, so drift of a shared machine between repeats cancels), their median, and a 95% interval of the ratio
    (Student t over the log ratios: repeats are few, and timing noise scales a speed rather than adding to it).
    The demo (demo/main.py) words its ratios with this too."""

    ratios: tuple[float, ...]  # [repeats] arm tok/s / baseline tok/s
    baseline: str = "plain"  # the arm the ratios are over, as `words` names it (PD's is the whole server, ...)

    @classmethod
    def paired(cls, arm: Sequence[float], base: Sequence[float], baseline: str = "plain") -> RatioSpread:
        """arm, base: [repeats] tokens/s of the arm and of the baseline arm (`baseline`: its name), repeat by
        repeat."""
        if len(arm) != len(base) or not arm:
            raise ValueError(f"paired speeds need the same number (>= 1) of repeats, got {len(arm)} and {len(base)}")
        if min(*arm, *base) <= 0:
            raise ValueError("speeds must be > 0 tokens/s")
        return cls(tuple(a / b for a, b in zip(arm, base)), baseline)

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def interval(self) -> tuple[float, float] | None:
        """(low, high) 95% interval of the ratio, rounded as printed (2 decimals); None from one repeat."""
        n = len(self.ratios)
        if n < 2:
            return None
        logs = [math.log(r) for r in self.ratios]
        half = T975[min(n - 1, len(T975)) - 1] * statistics.stdev(logs) / math.sqrt(n)
        mid = statistics.fmean(logs)
        return round(math.exp(mid - half), 2), round(math.exp(mid + half), 2)

    @property
    def verdict(self) -> str:
        """FASTER / SLOWER only when the (printed) interval excludes 1.0 and the median lies on the same side; SAME
        when the interval covers 1.0; ONE_REPEAT without an interval."""
        ci = self.interval
        if ci is None:
            return ONE_REPEAT
        if ci[0] > 1.0 and self.median > 1.0:
            return FASTER
        if ci[1] < 1.0 and self.median < 1.0:
            return SLOWER
        return SAME

    def words(self) -> str:
        """e.g. 'same as plain within noise: 0.97x (95% interval 0.85-1.10x, per repeat 0.85-1.09x, 6 interleaved
        repeats)' or 'speedup 1.35x (...)'; never a speedup or slower where the interval covers 1.0. The baseline is
        named as it is ('slower than whole: ...' over PD's whole server), plain by default."""
        ci, verdict, m, base = self.interval, self.verdict, self.median, self.baseline
        if ci is None:
            return f"{m:.2f}x from one repeat: no interval, so no verdict on speed"
        spread = (f"95% interval {ci[0]:.2f}-{ci[1]:.2f}x, per repeat {min(self.ratios):.2f}-{max(self.ratios):.2f}x, "
                  f"{len(self.ratios)} interleaved repeats")
        head = {FASTER: f"speedup {m:.2f}x", SLOWER: f"slower than {base}: {m:.2f}x"}.get(
            verdict, f"same as {base} within noise: {m:.2f}x")  # (SAME's words when the baseline is plain)
        return f"{head} ({spread})"
