"""Soak / stress test of our DFLASH worker behind a real CPU SGLang server, against a plain server of the same target.

What is measured, per DFLASH mode (chain, tree, adaptive) and client concurrency, on one seeded mixed workload
(stress_workload.py): greedy and sampled requests over /generate (ids, batched, n=2) and /v1/chat/completions,
streamed and not, with stop strings / stop tokens / ignore_eos / temperature, top-p, top-k, min-p; requests that
decode up to the context limit; requests the client aborts via /abort_request or abandons mid-stream or mid-wait;
malformed requests and requests our worker refuses on purpose. The plain server answers the same workload first
(without the interruptions) and is the reference. Counted per row (stress_report.py):

- mismatches: a greedy answer not token-identical to plain's (text for chat; a prefix of plain's when aborted or
  abandoned), with the plain server's top-2 logprob gap at the first differing token (near ties show up there);
- errors: unexpected statuses, broken streams, answers over max_new_tokens, stop strings left in, wrong refusals;
- hangs: no progress within --request-timeout, or requests still running when the server should be idle;
- leaked slots / deaths: after each workload the harness waits for the server to go idle (SGLang's strict idle
  check, SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, then raises `pool memory leak detected! ... total=T,
  available=A, evictable=E ...` and the server dies), sends /health_generate, and reads the process and its log.

Prints the table and, as its last line, a JSON object; exits 1 if any row has a mismatch, error, hang, leaked slot
or death. CPU only (`--device cpu --attention-backend torch_native`), the servers one at a time beside the plain one.
"""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dflash_sglang.bench.common.server import Server, ServerError, http_json
from dflash_sglang.bench.soak.client import Outcome, post_json, run_all
from dflash_sglang.bench.soak.report import Row, judge, read_health, table
from dflash_sglang.bench.soak.workload import GENERATE, Case, WorkloadSpec, build_workload, load_pool
from dflash_sglang.core.shape.adaptive import DEFAULT_TABLE
from dflash_sglang.measure.cpu_env import cpu_env

# goodput: no shape flag (the controller, the default); chain: pinned to the checkpoint's block (top-k 1 pins it);
# adaptive: the static table (--adaptive-table, default core.shape.adaptive.DEFAULT_TABLE)
MODE_FLAGS = {"goodput": [], "chain": ["--speculative-eagle-topk", "1"],
              "tree": ["--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"],
              "adaptive": ["--speculative-adaptive"]}
IDLE_SETTLE_S = 3.0  # after the queues drain: SGLang runs its leak check on every idle loop iteration


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stress.py", description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="goodput", help="comma list of DFLASH modes: goodput, chain, tree, adaptive")
    p.add_argument("--requests", type=int, default=300, help="requests per workload (one per concurrency)")
    p.add_argument("--concurrency", default="64,256", help="comma list: requests in flight, one workload each")
    p.add_argument("--aborts", type=int, default=30, help="aborted or abandoned requests per workload")
    p.add_argument("--target", help="target model dir (default: the SmolLM2 testbed target)")
    p.add_argument("--draft", help="DFLASH draft dir (default: the shipped testbed drafter)")
    p.add_argument("--python", help="interpreter that runs the servers (e.g. .venv-sglang-0.5.17/bin/python)")
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--max-prompt-tokens", type=int, default=400, help="prompts are 5..this many tokens")
    p.add_argument("--max-new-tokens", type=int, default=48, help="max_new_tokens is 1..this")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool size (small: retractions happen)")
    p.add_argument("--dtype", default="float32", help="float32 keeps greedy comparisons free of fp16 near ties")
    p.add_argument("--adaptive-table", help="--speculative-dflash-adaptive-table for the adaptive mode")
    p.add_argument("--server-args", default="", help="extra launch_server args for every server (shell-quoted)")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds without progress = a hang")
    p.add_argument("--idle-timeout", type=float, default=300.0, help="seconds for a server to drain after a workload")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench_out/stress"), help="server logs")
    return p


def server_argv(args, mode: str | None) -> list[str]:
    """launch_server args: the plain server (mode None) or DFLASH in one mode."""
    argv = ["--model-path", str(args.target), "--device", "cpu", "--attention-backend", "torch_native",
            "--context-length", str(args.context_length), "--max-total-tokens", str(args.max_total_tokens),
            "--dtype", args.dtype, "--random-seed", "0",
            "--sleep-on-idle",  # an idle scheduler otherwise spins a core, taken from the server under test
            *shlex.split(args.server_args)]
    if mode is None:  # synchronous like the DFLASH servers on CPU: SGLang's overlap scheduler feeds the penalizers
        argv.append("--disable-overlap-schedule")  # one token late (docs/request-options.md, "Request options")
    else:
        argv += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(args.draft),
                 *MODE_FLAGS[mode]]
        if mode == "adaptive":
            argv += ["--speculative-dflash-adaptive-table", args.adaptive_table or DEFAULT_TABLE]
    return argv


def settle(srv: Server, row: Row, idle_timeout: float) -> None:
    """After a workload: wait for the server to drain (stuck requests are hangs), let SGLang's idle leak check run,
    prove the scheduler still serves (/health_generate), then read the process and log for deaths and leaks."""
    deadline, busy = time.monotonic() + idle_timeout, None
    while srv.proc.poll() is None and time.monotonic() < deadline:
        try:
            load = http_json(srv.url + "/v1/loads", timeout=30)["loads"][0]
            busy = load["num_running_reqs"] + load["num_waiting_reqs"]
        except (OSError, KeyError, IndexError, ValueError):
            busy = None
        if busy == 0:
            break
        time.sleep(1)
    if busy:
        row.hangs += busy
        row.note(f"{busy} requests still running {idle_timeout:.0f}s after the workload")
    time.sleep(IDLE_SETTLE_S)
    try:
        http_json(srv.url + "/health_generate", timeout=120)
    except (OSError, ValueError) as e:
        row.note(f"/health_generate failed: {type(e).__name__}: {e}")
    time.sleep(IDLE_SETTLE_S)  # the health request's own idle check
    health = read_health(srv.log.read_text(errors="replace"), alive=srv.proc.poll() is None)
    row.leaked_slots, row.deaths = health.leaked_slots, int(health.dead)
    if health.dead:
        row.note(f"server died: {health.reason}")


def explainer(plain_url: str, timeout: float):
    """For a /generate mismatch: the plain server's top-2 logprob gap at the first differing token."""

    def explain(case: Case, out: Outcome, ref: Outcome) -> str:
        for a, r in zip(out.answers, ref.answers):
            if case.path != GENERATE or a.ids is None or r.ids is None or a.ids == r.ids or a.prompt_ids is None:
                continue
            k = next((j for j, (x, y) in enumerate(zip(a.ids, r.ids)) if x != y), min(len(a.ids), len(r.ids)))
            try:
                _, body = post_json(plain_url, GENERATE, {
                    "input_ids": a.prompt_ids + r.ids[:k], "return_logprob": True, "top_logprobs_num": 2,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 1}}, timeout=timeout)
                top = body["meta_info"]["output_top_logprobs"][0]
                return f" (ours {a.ids[k:k + 3]}, plain {r.ids[k:k + 3]}; plain top-2 gap {top[0][0] - top[1][0]:.2e})"
            except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
                return f" (no gap: {type(e).__name__})"
        return ""

    return explain


def run(args) -> list[Row]:
    from dflash_sglang.testbed import default_pair

    if not args.target or not args.draft:
        target, draft = default_pair()
        args.target, args.draft = args.target or target, args.draft or draft
    modes = [m for m in args.mode.split(",") if m]
    if unknown := set(modes) - set(MODE_FLAGS):
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {sorted(MODE_FLAGS)}")
    if args.max_prompt_tokens + args.max_new_tokens > args.context_length - 6:
        raise SystemExit("--max-prompt-tokens + --max-new-tokens must leave 6 tokens of --context-length (only the "
                         "context-limit cases run into it)")
    pool = load_pool(args.target, max_prompt_tokens=args.max_prompt_tokens)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    workloads = [build_workload(pool, WorkloadSpec(args.requests, args.aborts, args.context_length, seed=args.seed + k,
                                                   max_new=args.max_new_tokens, max_prompt=args.max_prompt_tokens))
                 for k in range(len(levels))]
    args.out.mkdir(parents=True, exist_ok=True)
    servers = {name: Server(server_argv(args, None if name == "plain" else name), cpu_env(),
                            args.out / f"{name}.log", args.startup_timeout, args.python)
               for name in ["plain", *modes]}
    try:
        # each DFLASH server starts while the previous one works (start-up is minutes on CPU); at most 3 alive
        servers["plain"].start()
        if modes:
            servers[modes[0]].start()
        rows, refs = run_plain(args, servers["plain"].wait_ready(), levels, workloads)
        for i, mode in enumerate(modes):
            if i + 1 < len(modes):
                servers[modes[i + 1]].start()
            rows += run_mode(args, servers[mode], mode, levels, workloads, refs, servers["plain"].url)
            servers[mode].stop()
    finally:
        with ThreadPoolExecutor(len(servers)) as pool_:  # SGLang takes seconds to shut down: all at once
            list(pool_.map(lambda s: s.stop(), servers.values()))
    return rows


def _progress(row: Row) -> None:
    print(table([row]).splitlines()[-1], flush=True)
    for f in row.failures:
        print(f"    {f}", flush=True)


def run_plain(args, plain: Server, levels: list[int], workloads: list[list[Case]]):
    """The plain server answers every workload in full (no aborts or disconnects): the reference answers."""
    rows, refs = [], []
    for c, cases in zip(levels, workloads):
        sent = [x for x in cases if x.plain]
        t0 = time.monotonic()
        outs = run_all(plain.url, sent, c, args.request_timeout, act=False)
        row = judge("plain", c, sent, outs, None)
        row.seconds = time.monotonic() - t0
        settle(plain, row, args.idle_timeout)
        rows.append(row)
        refs.append({o.case: o for o in outs})
        _progress(row)
    return rows, refs


def run_mode(args, srv: Server, mode: str, levels: list[int], workloads: list[list[Case]],
             refs: list[dict[int, Outcome]], plain_url: str) -> list[Row]:
    rows = []
    try:
        srv.wait_ready()
    except ServerError as e:
        row = Row(mode, 0, deaths=1)
        row.note(f"server did not start: {str(e).splitlines()[0]}")
        print(f"[{mode}] {e}", file=sys.stderr, flush=True)  # with its log's tail (the report keeps one line)
        _progress(row)
        return [row]
    for c, cases, ref in zip(levels, workloads, refs):
        t0 = time.monotonic()
        outs = run_all(srv.url, cases, c, args.request_timeout)
        row = judge(mode, c, cases, outs, ref, explainer(plain_url, args.request_timeout))
        row.seconds = time.monotonic() - t0
        settle(srv, row, args.idle_timeout)
        rows.append(row)
        _progress(row)
        if row.deaths:
            break  # the next workload would only count connection errors
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # `timeout` / CI cancellation send SIGTERM: unwind, so every server this run started is stopped
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.monotonic()
    try:
        rows = run(args)
    except ServerError as e:  # the plain server did not start: nothing to compare with
        rows = [Row("plain", 0, deaths=1, failures=[f"server did not start: {str(e).splitlines()[0]}"])]
        print(f"[plain] {e}", file=sys.stderr, flush=True)  # with its log's tail (the report keeps one line)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(table(rows), flush=True)
    for r in rows:
        for f in r.failures:
            print(f"[{r.server} c={r.concurrency}] {f}", flush=True)
    failed = any(r.failed for r in rows)
    print(json.dumps({"script": "stress", "target": str(args.target), "draft": str(args.draft), "mode": args.mode,
                      "concurrency": args.concurrency, "requests": args.requests, "aborts": args.aborts,
                      "context_length": args.context_length, "python": args.python or sys.executable,
                      "wall_s": round(time.monotonic() - t0, 1), "failed": failed,
                      "rows": [r.as_dict() for r in rows]}), flush=True)
    return 1 if failed else 0
