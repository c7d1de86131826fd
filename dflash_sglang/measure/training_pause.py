"""A quiet machine for timings: pause the standing background training job (scripts/train_job.sh) around a
benchmark, and measure how busy the machine is anyway (it is shared) and what it is (`lscpu`).

    with training_paused() as job:   # SIGSTOP now, SIGCONT on exit (also on an error, Ctrl-C or SIGTERM)
        job.pause()                  # again before each timed part: idempotent, nothing when the job is not running

A job someone had paused before is not resumed on exit (only a pause of ours is undone).
"""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_job.sh"


def _job(action: str, script: Path) -> str | None:
    """`bash train_job.sh action`'s output, or None when the script is missing or fails."""
    if not script.is_file():
        return None
    try:
        r = subprocess.run(["bash", str(script), action], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout + r.stderr if r.returncode == 0 else None


class TrainingPause:
    """Pauses the training job; resumes it only if a pause of ours stopped a running job. A job that was paused already
    (by hand, or by another benchmark) is left as it was found: the script says "already paused" and sends nothing,
    and `resume` undoes only our own pause."""

    def __init__(self, script: Path = SCRIPT) -> None:
        self.script = Path(script)
        self.paused = False

    def pause(self) -> bool:
        """Whether the job is paused by us now (a repeated pause of ours finds it "already paused": still ours)."""
        out = _job("pause", self.script)
        if out is None or "not running" in out:
            return False
        if "already paused" in out:  # by an earlier call of ours, or by someone else: it stays whose it was
            return self.paused
        self.paused = True
        return True

    def resume(self) -> None:
        if self.paused:
            _job("resume", self.script)
            self.paused = False


@contextmanager
def training_paused(script: Path = SCRIPT) -> Iterator[TrainingPause]:
    """The training job paused for the block (SIGTERM turned into SystemExit meanwhile, so it is resumed then too)."""
    job = TrainingPause(script)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if main else None
    job.pause()
    try:
        yield job
    finally:
        job.resume()
        if main:
            signal.signal(signal.SIGTERM, previous)


def _busy_total() -> tuple[int, int] | None:
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(f) - f[3] - f[4], sum(f)  # busy = every state but idle and iowait


def busy_share(seconds: float = 1.0) -> float | None:
    """Share of the whole machine's CPU capacity busy over the next `seconds` (Linux /proc/stat), else None."""
    a = _busy_total()
    time.sleep(seconds)
    b = _busy_total()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def cpu_model() -> str | None:
    """`lscpu`'s model name, or None."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), None)
    return None
