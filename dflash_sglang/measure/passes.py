"""Timed CPU `sgl.Engine` passes: what the demo measures with and the Engine benchmarks build on.

A plan (`build_plan`) of greedy `engine.generate` calls per arm; each arm a child process running one Engine
(`child_command` / `run_arm`, never two decoding at once); `run_passes` interleaves the repeats: pass r asks every arm
in turn, so a slow spell of the shared machine hits every arm alike (`resident`: each arm's Engine started once and
kept for every pass). `summarize` turns the rounds into one row per arm and group: tokens/s, the median of the
per-pass ratios to the baseline with a 95% interval (`RatioSpread`), the mean accept length, mismatches against the
baseline. The training job is paused meanwhile (training_pause.py). The benchmark's command line, its arms and plots:
bench/engine/compare.py.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_sglang.measure import resident, step_profile
from dflash_sglang.measure.spread import SAME, RatioSpread
from dflash_sglang.measure.training_pause import busy_share, training_paused
from dflash_sglang.measure.cpu_env import cpu_env

REPO = Path(__file__).resolve().parents[2]
ENV_KEY = "env."  # an arm spec's `env.NAME=value`: set in that arm's child only
WARMUP_NEW, WARMUP_PROMPTS, KV_MARGIN = 8, 4, 80  # KV_MARGIN: tokens per request beyond prompt + new (verify rows)


@dataclass
class RunSettings:
    """What every arm's child shares: `run_arm` and `run_passes` read these (bench_engine's argparse namespace has
    the same fields; the demo, demo/engines.py, builds one)."""

    out: Path  # each child's job, result and log: <out>/<arm>.p<pass>.*
    new_tokens: int  # per request of a timed round (warm-ups: WARMUP_NEW)
    repeats: int = 1  # interleaved passes over the arms
    sampling: list[str] = field(default_factory=list)  # KEY=VALUE sampling params added to every request
    env: dict[str, str] = field(default_factory=dict)  # the children's environment beyond cpu_env's
    child_timeout: float = 3600.0
    profile: bool = False  # each child under py-spy (measure/step_profile.py): <stem>.pyspy.txt
    resident: bool = False  # each arm's Engine started once, kept for every pass (measure/resident.py)


def parse_value(text: str) -> Any:
    """'3' -> 3, '0.5' -> 0.5, 'true'/'false' -> bool, 'none' -> None, else the string."""
    if (low := text.lower()) in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[low]
    for cast in (int, float):
        with contextlib.suppress(ValueError):
            return cast(text)
    return text


def kv_pairs(items: list[str]) -> dict[str, str]:
    """['k=v', ...] -> {'k': 'v'} (stripped, as written); an item without a key or '=' is an error."""
    pairs = [item.partition("=") for item in items if item]
    if bad := [k for k, eq, _ in pairs if not eq or not k]:
        raise ValueError(f"expected KEY=VALUE, got {bad}")
    return {k.strip(): v.strip() for k, _, v in pairs}


def parse_kv(items: list[str]) -> dict[str, Any]:
    return {k: parse_value(v) for k, v in kv_pairs(items).items()}


def split_env(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """An arm's (Engine kwargs, child environment): its `env.NAME` entries are the environment."""
    return ({k: v for k, v in kwargs.items() if not k.startswith(ENV_KEY)},
            {k[len(ENV_KEY):]: str(v) for k, v in kwargs.items() if k.startswith(ENV_KEY)})



def switch_schedule(phases: str, rounds: int) -> list[tuple[int, str]]:
    """(round index, phase) of the switch stream: each phase letter `rounds` times, in order (ABA, 2: AABBAA)."""
    return list(enumerate(p for p in phases for _ in range(rounds)))


def take(pool: list[list[int]], start: int, n: int) -> list[list[int]]:
    return [pool[(start + i) % len(pool)] for i in range(n)]


def build_plan(workload: str, concurrency: list[int], repeats: int, evals: list[list[int]],
               predictable: list[list[int]], phases: str = "ABA", phase_rounds: int = 2) -> list[dict]:
    """The generate calls every arm makes, in order, each in its repeat's pass (`pass`: one Engine per arm and
    pass): warm-ups (`warmup`) and timed rounds (key, group, c, phase, ids). eval: pass r holds round r of every c,
    eval prompts r*c .. r*c+c-1 (cycling), each after its c's warm-up; switch: every pass the whole stream, phase A
    eval prompts, B the predictable ones, each phase continuing where its last round stopped."""
    plan: list[dict] = []
    for r in range(repeats):
        if workload == "eval":
            for c in concurrency:
                plan.append({"warmup": True, "pass": r, "c": c, "ids": take(evals, 0, min(c, WARMUP_PROMPTS))})
                plan.append({"key": f"c{c}.r{r}", "pass": r, "group": f"c={c}", "c": c, "phase": "eval",
                             "ids": take(evals, r * c, c)})
            continue
        c, used = concurrency[0], {"A": 0, "B": 0}
        plan.append({"warmup": True, "pass": r, "c": c, "ids": take(evals, 0, min(c, WARMUP_PROMPTS))})
        for i, phase in switch_schedule(phases, phase_rounds):
            ids = take(evals if phase == "A" else predictable, used[phase] * c, c)
            plan.append({"key": f"s{i}", "pass": r, "group": f"{i}:{phase}", "c": c, "phase": phase, "ids": ids})
            used[phase] += 1
    return plan


def round_id(x: dict) -> tuple[int, str]:
    """A timed round's identity across passes: (pass, key) of a plan step or of a child's round."""
    return x.get("pass", 0), x["key"]


def run_child(job_path: Path) -> None:
    """Child body: one Engine, the plan's generate calls, the result JSON (written even if a call fails); a resident
    job (measure/resident.py) instead serves the passes its parent asks for, one at a time."""
    import sglang as sgl

    job = json.loads(Path(job_path).read_text())
    t0 = time.perf_counter()
    engine = sgl.Engine(**job["engine_kwargs"])
    startup_s = time.perf_counter() - t0
    print(f"[{job['arm']}] Engine up in {startup_s:.1f}s", file=sys.stderr, flush=True)
    if job.get("resident"):
        try:
            with os.fdopen(job["answer_fd"], "w") as answer:
                resident.serve_commands(lambda k: run_steps(engine, job, [s for s in job["plan"]
                                                                          if s.get("pass", 0) == k]),
                                        sys.stdin, answer, startup_s)
        finally:
            engine.shutdown()
        return
    res: dict = {"startup_s": startup_s, "rounds": []}
    try:
        run_steps(engine, job, job["plan"], into=res["rounds"])
    finally:
        engine.shutdown()
        Path(job["result"]).write_text(json.dumps(res))


def run_steps(engine: Any, job: dict, steps: list[dict], into: list[dict] | None = None) -> list[dict]:
    """The steps' greedy generate calls on `engine`, each timed; the timed rounds (appended to `into` as they end,
    so that a failing call keeps the rounds before it)."""
    rounds = [] if into is None else into
    for step in steps:
        new = step.get("new_tokens") or (WARMUP_NEW if step.get("warmup") else job["new_tokens"])
        cpu0 = engine_cpu_s()  # (before the clock starts: the probe's own time is not the round's)
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=step["ids"], sampling_params={
            "temperature": 0, "max_new_tokens": new, "ignore_eos": True, **job.get("sampling", {})})
        wall, cpu, metas = time.perf_counter() - t0, engine_cpu_s() - cpu0, [o["meta_info"] for o in outs]
        print(f"[{job['arm']}] {step.get('key', 'warmup')} c={step['c']} {wall:.2f}s (CPU {cpu:.2f}s)",
              file=sys.stderr, flush=True)
        if not step.get("warmup"):
            rounds.append({"key": step["key"], "pass": step.get("pass", 0), "wall_s": wall, "cpu_s": cpu,
                           "ids": [o["output_ids"] for o in outs],
                           "accept": [m.get("spec_accept_length") for m in metas],
                           "verify_ct": [m.get("spec_verify_ct") for m in metas]})
    return rounds


def engine_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and every process under it: the Engine's tokenizer
    side here, its scheduler(s) and detokenizer. A round's CPU time counts the work done, not the waits between the
    processes, so it varies less from round to round than its wall time on a shared CPU."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # (a process that ended meanwhile)
            continue
        total += times.user + times.system
    return total


def mismatches(arm: dict | None, base: dict | None, ids: list[tuple[int, str]]) -> int | None:
    """Requests of rounds `ids` (`round_id`) whose output ids differ from the baseline's (None without a baseline)."""
    if arm is None or base is None:
        return None
    a, b = ({round_id(r): r["ids"] for r in res["rounds"]} for res in (arm, base))
    return sum(x != y for k in ids if k in a and k in b for x, y in zip(a[k], b[k]))


def _tps(rounds: list[dict], measure: str = "wall_s") -> float | None:
    """Output tokens per second of `measure`: wall time, or the Engine's CPU time (`cpu_s`, engine_cpu_s)."""
    if not all(r.get(measure) for r in rounds):  # (rounds recorded before `cpu_s` existed have none)
        return None
    tokens, seconds = sum(len(i) for r in rounds for i in r["ids"]), sum(r[measure] for r in rounds)
    return tokens / seconds if seconds and tokens else None


def ratio_spread(steps: list[dict], mine: dict, base: dict | None, measure: str = "wall_s") -> RatioSpread | None:
    """The arm's per-pass tokens per second (of `measure`) over the baseline's on the same steps (`round_id` ->
    round), passes both ran."""
    if base is None:
        return None
    arm_tps, base_tps = [], []
    for k in sorted({s.get("pass", 0) for s in steps}):
        ids = [round_id(s) for s in steps if s.get("pass", 0) == k]
        if all(i in mine for i in ids) and all(i in base for i in ids):
            a, b = _tps([mine[i] for i in ids], measure), _tps([base[i] for i in ids], measure)
            if a and b:
                arm_tps.append(a)
                base_tps.append(b)
    return RatioSpread.paired(arm_tps, base_tps) if arm_tps else None


def summarize(plan: list[dict], results: dict[str, dict | None], baseline: str = "plain") -> list[dict]:
    """One row per arm x group: tokens/s (tokens / wall over its rounds), the median of its per-repeat ratios to the
    baseline's with their range and 95% interval and the verdict (`RatioSpread`), mean accept length over requests,
    mismatches vs the baseline."""
    timed = [s for s in plan if not s.get("warmup")]
    groups = list(dict.fromkeys(s["group"] for s in timed))
    by_arm = {arm: {round_id(r): r for r in res["rounds"]} for arm, res in results.items() if res is not None}
    rows = []
    for arm, mine in by_arm.items():
        for g in groups:
            steps = [s for s in timed if s["group"] == g and round_id(s) in mine]
            rounds = [mine[round_id(s)] for s in steps]
            wall = sum(r["wall_s"] for r in rounds)
            acc = [a for r in rounds for a in r["accept"] if a]
            steps_per_round = [max(v or 0 for v in r["verify_ct"]) for r in rounds]  # (decode steps of the round)
            spread = ratio_spread(steps, mine, by_arm.get(baseline))
            ci = spread.interval if spread is not None and arm != baseline else None  # (plain over itself: 1.0)
            # the same over the Engine's CPU time: the work per token, without the waits between its processes
            cpu = ratio_spread(steps, mine, by_arm.get(baseline), "cpu_s") if arm != baseline else None
            cpu_tps = _tps(rounds, "cpu_s") if rounds else None
            rows.append({"arm": arm, "group": g, "c": steps[0]["c"] if steps else None,
                         "phase": steps[0]["phase"] if steps else None, "rounds": len(rounds),
                         "tokens": sum(len(i) for r in rounds for i in r["ids"]), "wall_s": _r(wall),
                         "tok_s": _r(_tps(rounds)) if rounds else None,
                         "ratio": _r(spread.median) if spread else None,
                         "ratio_min": _r(min(spread.ratios)) if spread else None,
                         "ratio_max": _r(max(spread.ratios)) if spread else None,
                         "ratio_ci95": list(ci) if ci else None, "repeats": len(spread.ratios) if spread else 0,
                         "verdict": _named(spread.verdict, baseline) if spread and arm != baseline else None,
                         "cpu_ms_per_token": _r(1e3 / cpu_tps, 2) if cpu_tps else None,
                         "cpu_ratio": _r(cpu.median) if cpu else None,
                         "cpu_ratio_ci95": list(cpu.interval) if cpu and cpu.interval else None,
                         "cpu_verdict": _named(cpu.verdict, baseline) if cpu else None,
                         "accept_mean": _r(statistics.fmean(acc)) if acc else None,
                         "ms_per_step": _r(1e3 * wall / sum(steps_per_round), 1) if all(steps_per_round) else None,
                         "mismatches": mismatches(results[arm], results.get(baseline), [round_id(s) for s in steps])})
    return rows


def _named(verdict: str, baseline: str) -> str:
    """A verdict that names the baseline arm ("same as kv_auto within noise"); plain's words as they are."""
    return f"same as {baseline} within noise" if verdict == SAME else verdict


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def cpu_engine_kwargs(target: Path | str, plan: list[dict], new_tokens: int, max_running: int) -> dict[str, Any]:
    """The Engine kwargs every arm shares on CPU: the target in float32 on torch_native attention, a KV pool that holds
    the plan's largest round (prompt + new tokens + verify rows per request), SGLang's warnings only, seed 0."""
    need = max(sum(len(p) + new_tokens + KV_MARGIN for p in s["ids"]) for s in plan)
    return {"model_path": str(target), "device": "cpu", "dtype": "float32", "attention_backend": "torch_native",
            "log_level": "warning", "random_seed": 0, "max_total_tokens": max(16384, need),
            "chunked_prefill_size": 512, "max_running_requests": max_running}


def child_command(name: str, kwargs: dict, plan: list[dict], args: RunSettings | argparse.Namespace, common: dict,
                  stem: str) -> resident.ChildSpec:
    """An arm's child process, its files `<stem>.*` in --out (absolute: the child runs in the checkout)."""
    kwargs, arm_env = split_env(kwargs)
    out = Path(args.out).resolve()
    job = {"arm": name, "plan": plan, "new_tokens": args.new_tokens, "engine_kwargs": {**common, **kwargs},
           "sampling": parse_kv(args.sampling), "result": str(out / f"{stem}.result.json")}
    cmd = [sys.executable, "-m", "dflash_sglang.measure.passes", "--child", str(out / f"{stem}.job.json")]
    if getattr(args, "profile", False):
        cmd = step_profile.command(out / f"{stem}.pyspy.txt", cmd)
    env = {**os.environ, **cpu_env(REPO), **args.env, **arm_env}
    return resident.ChildSpec(cmd, job, out / f"{stem}.job.json", env, out / f"{stem}.log", REPO)


def run_arm(name: str, kwargs: dict, plan: list[dict], args: RunSettings | argparse.Namespace, common: dict,
            stem: str | None = None) -> dict | None:
    """One arm's child process (its own session, killed as a group on timeout / Ctrl-C) on the plan's steps; its
    result or None. Its job, result and log files are `<stem>.*` in --out (default stem: the arm's name)."""
    spec = child_command(name, kwargs, plan, args, common, stem or name)
    spec.job_path.write_text(json.dumps(spec.job))
    result = Path(spec.job["result"])
    result.unlink(missing_ok=True)
    with open(spec.log, "w") as log:
        proc = subprocess.Popen(spec.cmd, env=spec.env, stdout=log, stderr=subprocess.STDOUT, cwd=spec.cwd,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.child_timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the Engine's scheduler / detokenizer, if left behind
    if rc != 0 or not result.is_file():
        tail = spec.log.read_text()[-3000:]
        print(f"[{name}] FAILED ({rc}), log {spec.log}:\n{tail}", file=sys.stderr, flush=True)
        return None
    return json.loads(result.read_text())


def run_passes(arms: dict[str, dict], plan: list[dict], args: RunSettings | argparse.Namespace, common: dict,
               busy_probe_s: float = 2.0, say: Callable[[str], None] = lambda line: print(line, flush=True),
               on_engine: Callable[[str, dict], None] | None = None) -> tuple[dict[str, dict | None], dict[str, dict]]:
    """Every repeat a pass over the arms in turn, one Engine at a time (the training job paused before each): the
    arms' results, their rounds merged over passes (None: an arm that failed in any pass, not run after), and per
    arm what each pass's child did (busy share over `busy_probe_s` before it, startup, child seconds, rounds).
    `say` gets the progress lines; `on_engine(arm, what its pass's child did)` is called after each Engine.
    `args.resident`: each arm's Engine started once and kept for every pass (measure/resident.py)."""
    if getattr(args, "resident", False):
        with training_paused() as job:
            return resident.run_resident(
                arms, plan, args, lambda name, kwargs, stem: child_command(name, kwargs, plan, args, common, stem),
                busy_share, job, busy_probe_s, say, on_engine)
    results: dict[str, dict | None] = {name: {"rounds": []} for name in arms}
    info: dict[str, dict] = {name: {"kwargs": kwargs, "passes": []} for name, kwargs in arms.items()}
    with training_paused() as job:
        for k in range(args.repeats):
            steps = [s for s in plan if s.get("pass", 0) == k]
            for name, kwargs in arms.items():
                if results[name] is None:
                    continue
                job.pause()
                busy = busy_share(busy_probe_s)
                say(f"[{name}] pass {k + 1}/{args.repeats}: starting Engine {kwargs} (machine busy {_r(busy)})")
                t0 = time.perf_counter()
                res = run_arm(name, kwargs, steps, args, common, stem=f"{name}.p{k}")
                seen = resident.pass_record(k, busy, Path(args.out) / f"{name}.p{k}.log", time.perf_counter() - t0,
                                            (res or {}).get("startup_s"), None if res is None else res["rounds"])
                info[name]["passes"].append(seen)
                say(f"[{name}] Engine startup {seen['startup_s']}s, child {seen['child_s']}s")
                if on_engine is not None:
                    on_engine(name, seen)
                results[name] = None if res is None else {"rounds": results[name]["rounds"] + res["rounds"]}
    return results, info


if __name__ == "__main__":  # an arm's child (child_command): python -m dflash_sglang.measure.passes --child JOB
    run_child(Path(sys.argv[sys.argv.index("--child") + 1]))
