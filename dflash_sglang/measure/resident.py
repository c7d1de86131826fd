"""Resident Engines for measure/passes.py's interleaved passes: each arm's Engine starts once and serves every
pass.

Why: a fresh Engine per arm and pass (measure/passes.py `run_passes`) pays a start-up (~10-25 s on a 2-core CPU)
for a few seconds of decoding, and its passes sit minutes apart, so the machine's drift between passes (+-15% on a CPU
Engine) dominates the ratio's interval. Here every arm's child starts its Engine once, one start-up at a time, and idles
(`sleep_on_idle`: SGLang's scheduler waits on its sockets instead of spinning) until asked for a pass: pass k runs arm
after arm, the order reversed on odd passes (A B C, C B A, ...) so that a drift inside a pass hits no arm first every
time. Adjacent rounds of two arms sit seconds apart, and many cheap passes tighten the interval. Only one Engine decodes
at any time; the idle ones hold their memory (the testbed pair: ~1-2 GB each).

The child (`python -m dflash_sglang.measure.passes --child JOB`, the job's `resident` set) reads one JSON command
per line on stdin (`{"pass": k}` or `{"quit": true}`) and answers on the job's `answer_fd`, one JSON line per command:
`{"ready": startup_s}` once its Engine is up, then `{"pass": k, "rounds": [...]}`. Its log (stdout and stderr, SGLang's
included) is `<out>/<arm>.resident.log`.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

RESIDENT_KWARGS = {"sleep_on_idle": True}  # an idle Engine's scheduler must not spin beside the one decoding


def pass_order(arms: list[str], k: int) -> list[str]:
    """The arms' order in pass k: as given on even passes, reversed on odd ones."""
    return list(arms) if k % 2 == 0 else list(reversed(arms))


def serve_commands(run_pass: Callable[[int], list[dict]], commands: IO[str], answer: IO[str], startup_s: float) -> None:
    """Child body after its Engine is up: `ready`, then one answer per command until `quit` or end of input."""
    answer.write(json.dumps({"ready": startup_s}) + "\n")
    answer.flush()
    for line in commands:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        answer.write(json.dumps({"pass": cmd["pass"], "rounds": run_pass(int(cmd["pass"]))}) + "\n")
        answer.flush()


@dataclass(frozen=True)
class ChildSpec:
    """How to start one arm's child (measure/passes.py `child_command`)."""

    cmd: list[str]
    job: dict  # the job file's contents
    job_path: Path
    env: dict[str, str]
    log: Path  # its stdout and stderr
    cwd: Path


@dataclass
class ResidentChild:
    """One arm's resident child process, as the parent drives it."""

    name: str
    proc: subprocess.Popen
    answers: IO[str]  # the read end of its answer pipe
    log: Path
    timeout: float

    @classmethod
    def start(cls, name: str, spec: ChildSpec, timeout: float) -> ResidentChild:
        read_fd, write_fd = os.pipe()
        spec.job_path.write_text(json.dumps({**spec.job, "resident": True, "answer_fd": write_fd}))
        with open(spec.log, "w") as log:
            proc = subprocess.Popen(spec.cmd, env=spec.env, stdin=subprocess.PIPE, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=spec.cwd, start_new_session=True,
                                    pass_fds=(write_fd,), text=True)
        os.close(write_fd)
        return cls(name, proc, os.fdopen(read_fd), spec.log, timeout)

    def ask(self, command: dict | None) -> dict:
        """Send `command` (None: only wait for the next answer) and return the child's answer; raises RuntimeError
        when the child dies, times out or answers nothing."""
        if command is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(command) + "\n")
            self.proc.stdin.flush()
        ready, _, _ = select.select([self.answers], [], [], self.timeout)
        line = self.answers.readline() if ready else ""
        if not line:
            raise RuntimeError(f"[{self.name}] resident Engine gave no answer ({'timeout' if not ready else 'exited'}"
                               f", rc {self.proc.poll()}); log {self.log}:\n{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the Engine's scheduler / detokenizer, if left behind
        self.answers.close()


def run_resident(arms: dict[str, dict], plan: list[dict], args: Any, spawn: Callable[[str, dict, str], ChildSpec],
                 busy_share: Callable[[float], float | None], job_pause: Any, busy_probe_s: float,
                 say: Callable[[str], None], on_engine: Callable[[str, dict], None] | None
                 ) -> tuple[dict[str, dict | None], dict[str, dict]]:
    """measure/passes.py `run_passes` with resident Engines: the same results and per-pass info (each pass's
    `child_s` is its round's wall time there, `startup_s` the Engine's one start-up, on its first pass).
    `spawn(name, kwargs, stem)` builds an arm's child as `run_arm` does."""
    results: dict[str, dict | None] = {name: {"rounds": []} for name in arms}
    info: dict[str, dict] = {name: {"kwargs": kwargs, "passes": [], "resident": True} for name, kwargs in arms.items()}
    children: dict[str, ResidentChild] = {}
    startup: dict[str, float] = {}
    try:
        for name, kwargs in arms.items():  # one start-up at a time; the started ones idle meanwhile
            job_pause.pause()
            spec = spawn(name, {**RESIDENT_KWARGS, **kwargs}, f"{name}.resident")
            say(f"[{name}] starting a resident Engine {kwargs}")
            try:
                children[name] = ResidentChild.start(name, spec, args.child_timeout)
                startup[name] = float(children[name].ask(None)["ready"])
            except RuntimeError as err:
                print(str(err), file=sys.stderr, flush=True)
                results[name] = None
                info[name]["passes"].append(pass_record(0, None, spec.log, None, None, None))
                continue
            say(f"[{name}] Engine up in {startup[name]:.1f}s")
        for k in range(args.repeats):
            for name in pass_order([a for a in arms if results[a] is not None], k):
                job_pause.pause()
                busy = busy_share(busy_probe_s)
                t0 = time.perf_counter()
                try:
                    rounds = children[name].ask({"pass": k})["rounds"]
                except RuntimeError as err:
                    print(str(err), file=sys.stderr, flush=True)
                    rounds = None
                seen = pass_record(k, busy, children[name].log, time.perf_counter() - t0,
                                   startup[name] if k == 0 else None, rounds)
                info[name]["passes"].append(seen)
                say(f"[{name}] pass {k + 1}/{args.repeats}: {seen['child_s']}s (machine busy "
                    f"{seen['busy_share_before']})")
                if on_engine is not None:
                    on_engine(name, seen)
                results[name] = None if rounds is None else {"rounds": results[name]["rounds"] + rounds}
    finally:
        for child in children.values():
            child.stop()
    return results, info


def pass_record(k: int, busy: float | None, log: Path, child_s: float | None, startup_s: float | None,
                rounds: list[dict] | None) -> dict[str, Any]:
    """What one arm did in pass k, as `run_passes` / `run_resident` record it (None rounds: it failed): the machine's
    busy share before it, its log, its child's seconds, the Engine's start-up, each timed round's wall time and
    tokens."""
    return {"pass": k, "busy_share_before": _round(busy), "log": str(log), "child_s": _round(child_s),
            "startup_s": _round(startup_s), "failed": rounds is None,
            "rounds": [{"key": r["key"], "wall_s": _round(r["wall_s"]), "tokens": sum(map(len, r["ids"]))}
                       for r in rounds or []]}


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)
