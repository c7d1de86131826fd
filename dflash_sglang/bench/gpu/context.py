"""What a GPU session's stage gets and gives (session.py runs the stages, stages.py lists them): `Context`
(device, output folders, the `Budget`, what earlier stages built), `Stage` (its run and cost estimates), `Table` (its
result, one row per cell with a verdict) and `StageResult` (what the session records of it)."""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Table:
    """One stage's result table: rows of column -> value; `verdict` says pass / FAIL: ... / skipped: ... per row."""

    title: str
    columns: list[str]
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, **row) -> dict:
        self.rows.append(row)
        return row

    def markdown(self) -> str:
        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(_cell(r.get(c)) for c in self.columns) + " |" for r in self.rows]
        return "\n".join(lines + [""] + [f"- {n}" for n in self.notes])

    def status(self) -> str:
        """failed (a row failed), slower (a row measured ours slower than what it was compared with), partial (a row
        skipped), passed (every row passed or measured faster / the same), or empty. A row without a verdict is a
        bug of its stage: failed."""
        verdicts = [str(r.get("verdict") or "") for r in self.rows]
        if any(v.startswith("FAIL") or not v for v in verdicts):
            return "failed"
        if any(v.startswith("slower") for v in verdicts):
            return "slower"
        if any(v.startswith("skipped") for v in verdicts):
            return "partial"
        return "passed" if verdicts else "empty"


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value).replace("|", "/").replace("\n", " ")


class Budget:
    """Seconds left of the session's budget (a clock that tests replace)."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic):
        self.total_s, self.clock, self.start = float(total_s), clock, clock()

    def left(self) -> float:
        return self.total_s - (self.clock() - self.start)

    def fits(self, estimate_s: float, reserve_s: float = 0.0) -> bool:
        return estimate_s + reserve_s <= self.left()

    def timeout(self, estimate_s: float, reserve_s: float = 0.0) -> float:
        """How long a cell estimated at `estimate_s` may run: what is left beyond the later stages' reserve, but at
        least its own estimate (never more than is left, never under 10 s): one slow cell cannot starve the stages
        after it, and a cell that was allowed to start is not killed before its estimate."""
        left = self.left()
        return max(min(max(left - reserve_s, estimate_s), left), 10.0)

    def skip_reason(self, estimate_s: float, reserve_s: float = 0.0) -> str:
        later = f" + {reserve_s:.0f} s kept for later stages" if reserve_s else ""
        return f"skipped: budget (needs ~{estimate_s:.0f} s{later}, {max(self.left(), 0):.0f} s left)"


@dataclass
class Context:
    """What a stage gets: the device, where it writes (`out`: returned files; `work`: scratch and logs), the budget,
    the seconds later stages need at least (`reserve_s`), `publish` (rewrite the session files with a partial table),
    and `cache` (what earlier stages built: targets, plain Engines' results). Stage 0's: the carried wheel folder
    (`wheels`, None: nothing to install), the folder it installs into (`site`) and the seconds the call had run before
    the session's clock started (`started_s`)."""

    device: str
    out: Path
    work: Path
    budget: Budget
    wheels: Path | None = None
    site: Path = Path("/tmp/dflash_site")
    started_s: float = 0.0
    publish: Callable[[Table], None] = lambda table: None
    reserve_s: float = 0.0
    cache: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def timeout(self, estimate_s: float) -> float:
        """A cell's (an Engine wave's, a test file's) timeout: `Budget.timeout` beyond the later stages' reserve."""
        return self.budget.timeout(estimate_s, self.reserve_s)


@dataclass(frozen=True)
class Stage:
    """One stage: `run(ctx)` returns its table. min_s / full_s: estimated seconds of its smallest useful part and of
    all of it, per device (guesses until a GPU session's `session.json` gives measured ones). An `optional` stage
    runs on what the others leave: no earlier stage keeps a reserve for it."""

    number: int
    key: str
    title: str
    decides: str
    run: Callable[[Context], Table]
    min_s: dict[str, float]
    full_s: dict[str, float]
    optional: bool = False


@dataclass
class StageResult:
    number: int
    key: str
    title: str
    status: str  # passed | failed | partial | skipped | error
    seconds: float
    estimate_s: float
    reason: str = ""
    table: dict | None = None
    jit: str = ""  # what the stage JIT-compiled (gpu_jit.py), measured


def run_logged(cmd: list[str], log: Path, timeout: float, **kwargs) -> int | str:
    """A cell's command (a test file, the import check, a training run) with its output in `log`: its exit status, or
    "timeout" when it ran past `timeout` seconds (`Context.timeout`)."""
    with open(log, "w") as out:
        try:
            return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, **kwargs).returncode
        except subprocess.TimeoutExpired:
            return "timeout"
