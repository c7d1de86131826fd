"""PD disaggregation vs one server on CPU: tokens/s and acceptance of DFLASH across a prefill -> decode transfer.

Arms (each a fresh set of servers, one arm at a time; interleaved repeats: whole, pd, whole, pd, ...):
- `whole`: one DFLASH server (a chain of the draft's block, so that acceptance is comparable step for step);
- `pd`: a DFLASH prefill server and a DFLASH decode server with the same flags behind `sglang_router
  --pd-disaggregation`, the target and draft KV moved by SGLang's mooncake transfer engine over TCP;
- `plain`, `plain-pd`: the same without speculation (what PD itself costs here).
Each repeat sends the same greedy ShareGPT eval prompts (chat-templated, `--requests` of them, at most `--concurrency`
in flight) and measures the burst's wall seconds; tokens/s = generated tokens / seconds; acceptance = generated tokens /
verify steps (SGLang's meta_info, as the e2e tests read it). Greedy answers of every arm must equal the first arm's
(exit 1 otherwise). The ratio of each arm over the first is reported with its 95% interval (measure/spread.py).

On a 2-core machine the three processes of a PD arm share the cores a whole server has to itself, so its tokens/s
measures the transfer path's overhead there, not what separate prefill and decode GPUs give; acceptance is the figure
that must carry over (the decode server drafts from the transferred draft K/V).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from dflash_sglang.measure.spread import RatioSpread
from dflash_sglang.measure.training_pause import busy_share, cpu_model, training_paused
from dflash_sglang.bench.common.server import ROUTER, Server, await_router_workers, free_port, http_json
from dflash_sglang.measure.cpu_env import cpu_env

ARMS = ("whole", "pd", "plain", "plain-pd")
# (CPU: SGLang's prefill sender allocates CUDA events on two paths these switches avoid; the decode server keeps a
# retracted request's KV in CPU tensors instead of its pinned host pool; as tests/test_sglang_e2e.py runs PD)
PREFILL_ENV = {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1",
               "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"}


@dataclass
class ArmResult:
    name: str
    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    mismatches: int = 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_pd.py", description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="whole,pd", help=f"comma list of {', '.join(ARMS)}; ratios are over the first")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (2+ for an interval)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=400)
    p.add_argument("--max-total-tokens", type=int, default=32768)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--target", help="target model dir (default: the SmolLM2 testbed target)")
    p.add_argument("--draft", help="DFLASH draft dir (default: the shipped testbed drafter)")
    p.add_argument("--block", type=int, help="the chain's length (default: the draft's block size)")
    p.add_argument("--out", type=Path, default=Path("bench_out/pd"))
    return p


def common_argv(args) -> list[str]:
    return ["--model-path", str(args.target), "--device", "cpu", "--attention-backend", "torch_native",
            "--context-length", str(args.max_prompt_tokens + args.max_new_tokens + 6),
            "--max-total-tokens", str(args.max_total_tokens), "--dtype", args.dtype, "--random-seed", "0"]


def spec_argv(args) -> list[str]:
    block = ["--speculative-num-draft-tokens", str(args.block)] if args.block else []
    return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(args.draft),
            "--speculative-eagle-topk", "1", *block]


def launch(stack: ExitStack, args, arm: str, repeat: int) -> str:
    """Start the arm's servers (closed with the stack); returns the URL requests go to."""
    base = common_argv(args) + (spec_argv(args) if arm in ("whole", "pd") else [])
    log = args.out / f"{arm}.{repeat}"
    if arm in ("whole", "plain"):
        return stack.enter_context(Server(base, cpu_env(), Path(f"{log}.log"))).url
    bootstrap = free_port()
    transfer = ["--disaggregation-transfer-backend", "mooncake_tcp"]
    prefill = Server(base + transfer + ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                        str(bootstrap)], {**cpu_env(), **PREFILL_ENV}, Path(f"{log}.prefill.log"))
    decode = Server(base + transfer + ["--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup",
                                       "cpu_tensor"], cpu_env(), Path(f"{log}.decode.log"))
    for s in (prefill, decode):
        stack.callback(s.stop)
        s.start()
    for s in (prefill, decode):
        s.wait_ready()
    router = stack.enter_context(Server(["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap), "--decode",
                                         decode.url, "--policy", "round_robin"], cpu_env(),
                                        Path(f"{log}.router.log"), startup_timeout=120, module=ROUTER))
    await_router_workers(router.url, {"max_new_tokens": 1})
    return router.url


def send(url: str, prompts: list[list[int]], args) -> tuple[float, list[dict]]:
    """The burst: every prompt greedy, at most `concurrency` in flight -> (wall seconds, outputs in prompt order)."""
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    t = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        outs = list(pool.map(lambda p: http_json(url + "/generate", {"input_ids": p, "sampling_params": params}),
                             prompts))
    return time.monotonic() - t, outs


def report(results: list[ArmResult]) -> list[dict]:
    base, rows = results[0], []
    for arm in results:
        tps = [t / s for t, s in zip(arm.tokens, arm.seconds)]
        row = {"arm": arm.name, "tokens_per_s": round(statistics.median(tps), 1), "seconds": [round(s, 2) for s in
               arm.seconds], "acceptance": round(sum(arm.tokens) / sum(arm.steps), 3) if sum(arm.steps) else None,
               "mismatches": arm.mismatches}
        if arm is not base:
            spread = RatioSpread.paired(tps, [t / s for t, s in zip(base.tokens, base.seconds)], base.name)
            row.update(ratio=round(spread.median, 3), interval=spread.interval, words=spread.words())
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms: a comma list of {', '.join(ARMS)}")
    if not args.target or not args.draft:
        from dflash_sglang.testbed import default_pair

        target, draft = default_pair()
        args.target, args.draft = args.target or target, args.draft or draft
    from dflash_sglang.bench.soak.workload import load_pool

    prompts = [list(p) for p in load_pool(args.target, args.requests, args.max_prompt_tokens).ids[: args.requests]]
    args.out.mkdir(parents=True, exist_ok=True)
    results, ref, t0 = [ArmResult(a) for a in arms], None, time.monotonic()
    with training_paused() as job:
        for r in range(args.repeats):
            for arm in results:
                with ExitStack() as stack:  # (fresh servers: no prefix cache to flush)
                    url = launch(stack, args, arm.name, r)
                    job.pause()
                    busy = busy_share()
                    secs, outs = send(url, prompts, args)
                answers = [o["output_ids"] for o in outs]
                ref = answers if ref is None else ref
                arm.mismatches += sum(a != b for a, b in zip(answers, ref))
                arm.seconds.append(secs)
                arm.tokens.append(sum(o["meta_info"]["completion_tokens"] for o in outs))
                arm.steps.append(sum(o["meta_info"].get("spec_verify_ct") or 0 for o in outs))
                print(f"[repeat {r + 1}/{args.repeats}] {arm.name}: {secs:.1f} s (machine busy "
                      f"{'?' if busy is None else f'{busy:.0%}'} before)", flush=True)
    rows = report(results)
    for row in rows:
        print(f"{row['arm']:>9} {row['tokens_per_s']} tok/s {row['seconds']} acceptance {row['acceptance']} "
              f"mismatches {row['mismatches']}{'  ' + row['words'] if 'words' in row else ''}", flush=True)
    result = {"script": "bench_pd", "date": datetime.date.today().isoformat(), "cpu": cpu_model(),
              "python": sys.executable, "requests": args.requests, "concurrency": args.concurrency,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "dtype": args.dtype,
              "wall_s": round(time.monotonic() - t0, 1), "rows": rows}
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return 1 if any(r["mismatches"] for r in rows) else 0
