"""A mixed burst against CPU SGLang servers: plain vs DFLASH arms, interleaved repeats, ratio with its spread.

What a serving engineer's traffic looks like at high concurrency, sent all at once: the stress harness's ordinary
requests (`stress_workload._mixed`: greedy and sampled, /generate and chat, streamed and not, stop strings and stop
ids, n=2, batched /generate, chat logprobs, prompts of 5..max_prompt tokens, 1..max_new new tokens), no aborts and no
bad requests (a speed benchmark, not a soak: scripts/stress.py is that). Per concurrency c, a burst is c requests
with at most c in flight.

One server at a time (each holds its whole KV pool: several at once would not fit the CI machine's memory): repeat r
starts each arm's server in turn (plain, default, floor, plain, ...) and sends it every level's burst, the prefix cache
flushed before each, so slow drift of the shared machine hits every arm alike (the price: a server start per arm and
repeat, untimed). Each repeat gives one ratio
plain seconds / arm seconds (the same requests), reported as a median and a 95% interval (measure/spread.py
`RatioSpread`): "speedup" / "slower" only when the interval excludes 1.0. Greedy answers of every arm must equal
plain's, token for token (exit 1 otherwise).

Arms: `plain` (SGLang as users run it: its overlap scheduler on), `plain-sync` (plain with
`--disable-overlap-schedule`), `default` (DFLASH, no shape flag: the goodput controller), `floor` (DFLASH pinned to a
plain step every step: what our worker costs over plain), `chain` (DFLASH, the checkpoint's block), or
`NAME=launch_server flags` (DFLASH plus those flags) for anything else.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_sglang.measure.spread import RatioSpread
from dflash_sglang.measure.training_pause import busy_share, cpu_model, training_paused
from dflash_sglang.bench.common.server import Server, flush_cache
from dflash_sglang.measure.cpu_env import cpu_env
from dflash_sglang.bench.soak.client import Outcome, run_all
from dflash_sglang.bench.soak.workload import Case, WorkloadSpec, _mixed, load_pool

ARM_FLAGS: dict[str, list[str] | None] = {  # None: no speculation
    "plain": None,
    "plain-sync": None,
    "default": [],
    "floor": ["--speculative-adaptive", "--speculative-dflash-adaptive-table", "inf:1x1"],
    "chain": ["--speculative-eagle-topk", "1"],
}


@dataclass
class Arm:
    name: str
    flags: list[str]  # launch_server flags beyond the common ones
    seconds: dict[int, list[float]] = field(default_factory=dict)  # concurrency -> [repeats] burst wall seconds
    mismatches: dict[int, int] = field(default_factory=dict)  # concurrency -> greedy answers unlike plain's
    errors: dict[int, int] = field(default_factory=dict)  # concurrency -> requests not answered 200


def parse_arm(spec: str, draft: Path) -> Arm:
    name, sep, extra = spec.partition("=")
    if not sep and name not in ARM_FLAGS:
        raise SystemExit(f"unknown arm {spec!r}: one of {', '.join(ARM_FLAGS)} or NAME=launch_server flags")
    flags = shlex.split(extra) if sep else []
    base = ARM_FLAGS.get(name) if not sep else []
    if name == "plain-sync":
        flags = ["--disable-overlap-schedule", *flags]
    elif base is not None:
        flags = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft), *base, *flags]
    return Arm(name, flags)


def burst(pool, n: int, seed: int, max_new: int, max_prompt: int) -> list[Case]:
    """n seeded ordinary requests (the same for every arm)."""
    rng = random.Random(seed)
    spec = WorkloadSpec(n, 0, max_prompt + max_new + 6, seed=seed, max_new=max_new, max_prompt=max_prompt)
    return [_mixed(seed * 100_000 + i, rng, spec, pool) for i in range(n)]


def greedy_answers(cases: list[Case], outs: list[Outcome]) -> dict[int, list]:
    """case id -> its greedy answers (token ids where /generate returns them, else text)."""
    return {c.id: [a.ids if a.ids is not None else a.text for a in o.answers]
            for c, o in zip(cases, outs) if c.compare and o.status == 200}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_burst.py", description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="plain,default,floor", help="comma list (see the module docstring)")
    p.add_argument("--concurrency", default="64,256", help="comma list: one burst of this many requests each")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats per level (2+ for an interval)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=400)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--dtype", default="float32", help="float32 keeps greedy comparisons free of fp16 near ties")
    p.add_argument("--target", help="target model dir (default: the SmolLM2 testbed target)")
    p.add_argument("--draft", help="DFLASH draft dir (default: the shipped testbed drafter)")
    p.add_argument("--python", help="interpreter that runs the servers (e.g. .venv-sglang-0.5.17/bin/python)")
    p.add_argument("--server-args", default="", help="extra launch_server args for every server (shell-quoted)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=Path("bench_out/burst"), help="server logs and result.json")
    return p


def server_argv(args, arm: Arm) -> list[str]:
    return ["--model-path", str(args.target), "--device", "cpu", "--attention-backend", "torch_native",
            "--context-length", str(args.max_prompt_tokens + args.max_new_tokens + 6),
            "--max-total-tokens", str(args.max_total_tokens), "--dtype", args.dtype, "--random-seed", "0",
            "--sleep-on-idle", *shlex.split(args.server_args), *arm.flags]


def report(arms: list[Arm], levels: list[int]) -> list[dict]:
    base = arms[0]
    rows = []
    for c in levels:
        for arm in arms:
            secs = arm.seconds.get(c, [])
            row = {"arm": arm.name, "concurrency": c, "median_s": round(statistics.median(secs), 2) if secs else None,
                   "seconds": [round(s, 2) for s in secs], "mismatches": arm.mismatches.get(c, 0),
                   "errors": arm.errors.get(c, 0)}
            if arm is not base and secs and len(secs) == len(base.seconds.get(c, [])):
                spread = RatioSpread.paired([1 / s for s in secs], [1 / s for s in base.seconds[c]], base.name)
                row.update(ratio=round(spread.median, 3), interval=spread.interval, words=spread.words())
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.target or not args.draft:
        from dflash_sglang.testbed import default_pair

        target, draft = default_pair()
        args.target, args.draft = args.target or target, args.draft or draft
    arms = [parse_arm(s, Path(args.draft)) for s in args.arms.split(",") if s]
    if not arms or arms[0].name not in ("plain", "plain-sync"):
        raise SystemExit("--arms must start with plain (or plain-sync): the baseline every ratio is over")
    levels = [int(c) for c in args.concurrency.split(",") if c]
    pool = load_pool(args.target, max_prompt_tokens=args.max_prompt_tokens)
    bursts = {c: burst(pool, c, args.seed + k, args.max_new_tokens, args.max_prompt_tokens)
              for k, c in enumerate(levels)}
    args.out.mkdir(parents=True, exist_ok=True)
    t0, ref = time.monotonic(), {}
    with training_paused() as job:
        for r in range(args.repeats):
            for arm in arms:
                log = args.out / f"{arm.name}.{r}.log"
                with Server(server_argv(args, arm), cpu_env(), log, python=args.python) as srv:
                    for c in levels:
                        flush_cache(srv.url)
                        job.pause()
                        busy = busy_share()
                        t = time.monotonic()
                        outs = run_all(srv.url, bursts[c], c, args.request_timeout, act=False)
                        secs = time.monotonic() - t
                        arm.seconds.setdefault(c, []).append(secs)
                        arm.errors[c] = arm.errors.get(c, 0) + sum(o.status != 200 for o in outs)
                        got = greedy_answers(bursts[c], outs)
                        if arm is arms[0] and r == 0:
                            ref[c] = got
                        else:
                            arm.mismatches[c] = arm.mismatches.get(c, 0) + sum(
                                got.get(k) != v for k, v in ref[c].items())
                        print(f"[repeat {r + 1}/{args.repeats}] {arm.name} c={c}: {secs:.1f} s "
                              f"(machine busy {'?' if busy is None else f'{busy:.0%}'} before)", flush=True)
    rows = report(arms, levels)
    for row in rows:
        extra = f"  {row['words']}" if "words" in row else ""
        print(f"{row['arm']:>12} c={row['concurrency']:<4} median {row['median_s']} s {row['seconds']} "
              f"mismatches {row['mismatches']} errors {row['errors']}{extra}", flush=True)
    result = {"script": "bench_burst", "date": datetime.date.today().isoformat(), "cpu": cpu_model(),
              "python": args.python or sys.executable, "arms": {a.name: a.flags for a in arms},
              "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
              "max_total_tokens": args.max_total_tokens, "dtype": args.dtype, "repeats": args.repeats,
              "wall_s": round(time.monotonic() - t0, 1), "rows": rows}
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    failed = any(r["mismatches"] or r["errors"] for r in rows)
    return 1 if failed else 0
