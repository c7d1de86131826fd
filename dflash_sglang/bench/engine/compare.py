"""CPU `sgl.Engine` decoding throughput per speculation arm on the SmolLM2 testbed pair, one Engine at a time.

Measured: each arm is a child process running one Engine (never two at once); per concurrency c, a warm-up, then one
greedy `engine.generate` call with c prompts (all concurrent, N new tokens, `ignore_eos`): wall seconds, output
tokens, tokens/s, per request `spec_accept_length` / `spec_verify_ct`. Arms: `plain`, DFLASH `default`, `chain16`,
`static` (the static adaptive table), `floor` (adaptive `inf:1x1`: every step a plain step through our worker),
`adaptive`, or `name:key=value;...` (DFLASH plus those Engine kwargs; `none` drops a key; `env.NAME=value` sets
NAME in that arm's child only, e.g. an implementation switch's before and after interleaved).
Repeats are interleaved: repeat r is a pass over every arm in turn (plain, default, ..., plain, default, ...), each
arm's Engine starting, decoding round r (eval: its own c prompts per concurrency; switch: the whole stream) and
stopping before the next arm's, so slow drift of the shared machine hits every arm alike (the price: an Engine
start per arm and repeat). `--resident` starts each arm's Engine once and keeps it for every pass
(measure/resident.py): no start-up per pass, passes seconds apart, so many more fit. Each row reports the median of
the per-repeat ratios to plain (same round, same prompts; `--baseline ARM` another arm) and a 95% interval
(`RatioSpread`): a ratio is called a speedup or slower only when the interval excludes 1.0, else "same as plain within
noise"; one repeat gives no interval and no such word. Why: where speculation stops paying over plain decoding as the
batch grows, what our worker's floor costs against plain SGLang, and what the adaptive policy recovers: the adaptive
tables come from this. Every arm decodes the same prompts and must be token-identical to plain (lossless): a mismatch is
printed loudly and exits 1. `--workload switch`: one stream at the first concurrency alternating A (ShareGPT eval chat)
and B (count / repeat prompts), for a policy that follows acceptance. The training job is paused meanwhile
(measure/training_pause.py); the machine's busy share before each Engine is recorded (it is shared).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from dflash_sglang.measure import step_profile
from dflash_sglang.measure.passes import (ENV_KEY, build_plan, cpu_engine_kwargs, kv_pairs, parse_kv, parse_value,
                                          run_passes, summarize, switch_schedule)
from dflash_sglang.measure.plotting import pyplot
from dflash_sglang.measure.shape_trace import logging_config, parse_trace, plot_trace
from dflash_sglang.measure.training_pause import cpu_model

REPO = Path(__file__).resolve().parents[3]
STATIC_TABLE = "1:64x4,4:32x2,8:16x2,32:16x1,64:8x1,inf:4x1"
ARMS: dict[str, dict[str, Any] | None] = {  # None: no speculation; a dict: DFLASH plus these kwargs
    "plain": None, "default": {}, "chain16": {"speculative_num_draft_tokens": 16},
    "static": {"speculative_adaptive": True, "speculative_dflash_adaptive_table": STATIC_TABLE},
    "floor": {"speculative_adaptive": True, "speculative_dflash_adaptive_table": "inf:1x1"},
    "adaptive": {"speculative_adaptive": True},
    "chains": {"speculative_adaptive": True, "speculative_eagle_topk": 1},  # the controller without trees
}

PREDICTABLE = (
    "Count from 1 to 300, separated by commas.", "Repeat the word 'apple' 200 times.",
    "Count down from 500 to 1, separated by commas.", "Write 'hello world' 100 times, one per line.",
    "List the numbers from 100 to 400, one per line.", "Repeat the sentence 'The cat sat on the mat.' 50 times.",
    "Write the alphabet from A to Z ten times, separated by spaces.", "Print the even numbers from 2 to 600.",
)

def parse_arm(spec: str, draft: str) -> tuple[str, dict[str, Any]]:
    """(name, the arm's Engine kwargs beyond the common ones) of a built-in arm or a `name:key=value;...` spec."""
    name, sep, extra = spec.partition(":")
    if not sep and name not in ARMS:
        raise ValueError(f"unknown arm {spec!r}: one of {', '.join(ARMS)} or NAME:key=value;key=value")
    base = ARMS.get(name) if not sep else {}
    if base is None:
        return name, {}
    kw = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(draft), **base}
    pairs = kv_pairs(extra.split(";"))
    kw.update({k: parse_value(v) for k, v in pairs.items() if not k.startswith(ENV_KEY)})
    kw = {k: v for k, v in kw.items() if v is not None}
    # env.NAME=value: the arm's child environment (kept as written: an environment holds strings)
    return name, {**kw, **{k: v for k, v in pairs.items() if k.startswith(ENV_KEY)}}



def profile_rows(info: dict[str, dict], out: Path) -> list[dict]:
    """Per arm: each part's sampled ms per timed output token (measure/step_profile.py), the mean over its passes
    (a resident Engine: one profile over all of them)."""
    rows = []
    for name, arm in info.items():
        raws = ([(out / f"{name}.resident.pyspy.txt", arm["passes"])] if arm.get("resident") else
                [(out / f"{name}.p{seen['pass']}.pyspy.txt", [seen]) for seen in arm["passes"]])
        per_pass = [step_profile.ms_per_token(path.read_text(), sum(r["tokens"] for s in seen for r in s["rounds"]))
                    for path, seen in raws if path.is_file()]
        if per_pass:
            rows.append({"arm": name, "passes": len(per_pass),
                         **{part: round(statistics.fmean(p[part] for p in per_pass), 2) for part in per_pass[0]}})
    return rows


def plot_switch(rows: list[dict], path: Path) -> str | None:
    plt = pyplot()
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    if plt is None or not arms:
        return None
    fig, axes = plt.subplots(len(arms), 1, sharex=True, sharey=True, figsize=(8, 1.8 * len(arms) + 1), squeeze=False)
    for ax, arm in zip(axes[:, 0], arms):
        mine = [r for r in rows if r["arm"] == arm]
        ax.bar(range(len(mine)), [r["tok_s"] or 0 for r in mine],
               color=["tab:blue" if r["phase"] == "A" else "tab:orange" for r in mine])
        ax.set_ylabel(f"{arm}\ntok/s")
    axes[-1, 0].set_xlabel("round (blue: A, eval chat; orange: B, predictable)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="plain,default,chain16,static,floor")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved passes over the arms (a fresh Engine per arm and pass): the ratios' median "
                        "and 95%% interval come from them; 1 reports a ratio with no interval, never a speedup or "
                        "slower")
    p.add_argument("--resident", action="store_true",
                   help="start each arm's Engine once and keep it for every pass (measure/resident.py): passes "
                        "cost no start-up and sit seconds apart, so many more fit and the interval tightens")
    p.add_argument("--baseline", default="plain",
                   help="the arm every ratio is taken against (default plain), e.g. the same KV budget without a "
                        "window; outputs are always checked against it")
    p.add_argument("--workload", choices=("eval", "switch"), default="eval")
    p.add_argument("--phases", default="ABA", help="switch: phase order (A eval chat, B predictable)")
    p.add_argument("--phase-rounds", type=int, default=2, help="switch: rounds per phase")
    p.add_argument("--out", type=Path, default=REPO / "work_tmp" / "bench_engine")
    p.add_argument("--engine-kwarg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="child environment")
    p.add_argument("--sampling", action="append", default=[], metavar="KEY=VALUE",
                   help="sampling params added to every request (e.g. frequency_penalty=0.5)")
    p.add_argument("--trace", action="store_true",
                   help="switch: log the goodput controller's every step and plot its choices (<arm>.trace.png); "
                        "the logging costs a little, so do not quote a traced run's timings; the plot is the first "
                        "pass's")
    p.add_argument("--profile", action="store_true",
                   help="each child under py-spy: where its scheduler's time went per output token, by part of the "
                        "step (measure/step_profile.py); a profiled run is slower, so do not quote its timings")
    p.add_argument("--child-timeout", type=float, default=3600.0)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    from transformers import AutoTokenizer

    from dflash_sglang.testbed import default_pair
    from dflash_sglang.testbed.data import chat_prompt_ids, eval_prompts

    target, draft = default_pair()
    arms = dict(parse_arm(s, str(draft)) for s in args.arms.split(",") if s)
    if args.baseline not in arms:
        parser.error(f"--baseline {args.baseline!r} is not one of --arms ({', '.join(arms)})")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    args.env = {k: str(v) for k, v in parse_kv(args.env).items()}
    tok = AutoTokenizer.from_pretrained(target)
    n_eval = (max(concurrency) * args.repeats if args.workload == "eval"
              else concurrency[0] * args.phase_rounds * max(args.phases.count("A"), 1))
    evals = [list(p.ids) for p in eval_prompts(tok, n_eval)]
    plan = build_plan(args.workload, concurrency, args.repeats, evals,
                      [chat_prompt_ids(tok, t) for t in PREDICTABLE], args.phases, args.phase_rounds)
    common = {**cpu_engine_kwargs(target, plan, args.new_tokens, max(concurrency)), **parse_kv(args.engine_kwarg)}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.trace:
        args.env["SGLANG_LOGGING_CONFIG_PATH"] = str(logging_config(args.out / "trace_logging.json"))
    results, info = run_passes(arms, plan, args, common)
    rows = summarize(plan, results, args.baseline)
    cols = ["arm", "group", "c", "phase", "rounds", "tokens", "wall_s", "tok_s", "ratio", "ratio_min", "ratio_max",
            "ratio_ci95", "repeats", "verdict", "cpu_ms_per_token", "cpu_ratio", "cpu_ratio_ci95", "cpu_verdict",
            "accept_mean", "ms_per_step", "mismatches"]
    print(f"\n{'arm':<12}{'group':>8}{'tok/s':>9}{'ratio':>7}{'95% interval':>14}{'CPU ratio':>10}"
          f"{'95% interval':>14}{'accept':>8}{'ms/step':>9}{'mism':>6}  verdict (ratio: median of {args.repeats} "
          f"interleaved repeats; CPU: per the Engine's CPU seconds)")
    for r in rows:
        ci, cpu_ci = ("-" if not c else "{:.2f}-{:.2f}x".format(*c) for c in (r["ratio_ci95"], r["cpu_ratio_ci95"]))
        print(f"{r['arm']:<12}{r['group']:>8}{r['tok_s'] or '-':>9}{r['ratio'] or '-':>7}{ci:>14}"
              f"{r['cpu_ratio'] or '-':>10}{cpu_ci:>14}{r['accept_mean'] or '-':>8}{r['ms_per_step'] or '-':>9}"
              f"{'-' if r['mismatches'] is None else r['mismatches']:>6}  {r['verdict'] or '-'}"
              + (f"; CPU: {r['cpu_verdict']}" if r["cpu_verdict"] else ""))
    with open(args.out / "bench_engine.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows({k: r[k] for k in cols} for r in rows)
    total = sum(r["mismatches"] or 0 for r in rows)
    if total:
        bar = "!" * 80
        print(f"\n{bar}\nWARNING: {total} request(s) NOT identical to {args.baseline} (lossless broken)\n{bar}",
              file=sys.stderr, flush=True)
    failed = [a for a, res in results.items() if res is None]
    summary = {"script": "bench_engine", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "cpu_model": cpu_model(), "cpus": os.cpu_count(), "workload": args.workload,
               "new_tokens": args.new_tokens, "concurrency": concurrency, "repeats": args.repeats,
               "engine_kwargs": common, "env": args.env, "sampling": parse_kv(args.sampling),
               "arms": info, "rows": rows, "mismatches": total, "failed": failed, "out": str(args.out),
               "png": plot_switch(rows, args.out / "switch.png") if args.workload == "switch" else None}
    if args.profile:
        summary["profile"] = profile_rows(info, args.out)
        for row in summary["profile"]:
            print("profile " + " ".join(f"{k}={v}" for k, v in row.items()))
    if args.trace and args.workload == "switch":
        phases = [phase for _, phase in switch_schedule(args.phases, args.phase_rounds)]
        summary["traces"] = {name: plot_trace(parse_trace((args.out / f"{name}.p0.log").read_text()), phases,
                                              args.out / f"{name}.trace.png")
                             for name, kwargs in arms.items() if kwargs is not None}
    (args.out / "bench_engine.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 1 if total or failed else 0




if __name__ == "__main__":
    raise SystemExit(main())
