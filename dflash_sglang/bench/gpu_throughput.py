"""Stage 3: tokens/s of ours vs SGLang's builtin DFLASH vs no speculation at a simulated acceptance, and how the
controller spends its steps.

The target is the SmolLM2-135M architecture with seeded weights (gpu_targets.py), the draft the shipped drafter (block
16). A random target accepts nothing, so acceptance is simulated at the same tau for both implementations, which makes
this the fair comparison of the two: the builtin commits a mean of tau tokens a step (SGLANG_SIMULATE_ACC_LEN, its own
law), ours accepts each draft position with the rate p at which a block-16 chain commits tau on average
(DFLASH_SIMULATE_ACC_RATE, `rate_for_tau`), as a pinned chain of 16 and under the goodput controller (no shape flag),
which chooses shorter chains or plain steps where they pay. Per arm and tau one Engine (one at a time), then
bench/engine.py's plan: per concurrency c a warm-up and one timed greedy call of c prompts x new tokens; its
`summarize` gives tokens/s and the ratio to no speculation.

Then one more controller Engine at the middle tau with the verify probe (gpu_probe.py): the shape mix and, per verify
width, the share of steps that replayed a CUDA graph and the median step time. On CPU (the rehearsal) the table's
format only: tiny sizes, float32, no speculation and the pinned chain (probed: the probe's plumbing), no builtin (its
DFLASH worker needs CUDA).
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from .gpu_probe import PROBE_ENV, width_uses
from .gpu_context import Context, Table
from .gpu_targets import REPO, SHIPPED_DRAFT, smollm2_dummy
from .pareto import OURS_LOG_MARKER

BLOCK = 16  # the shipped drafter's block
IMPL_ENV = "DFLASH_SGLANG_IMPL"
SIZES = {  # per device: taus in the order run (the first is the stage's must part), the speculative arms,
    # concurrency, new tokens, an Engine's estimated seconds; probed: the arm whose timed Engine is also probed (CPU,
    # where timings mean nothing: the table's format and the probe's plumbing), else one more probed controller Engine
    "cuda": dict(taus=(4.0, 2.0, 6.0), arms=("ours_chain", "ours_controller", "builtin"), concurrency=(1, 8, 32),
                 new_tokens=128, prompt_len=128, engine_s=40.0, probed=None),
    "cpu": dict(taus=(2.0,), arms=("ours_chain",), concurrency=(1, 2), new_tokens=16, prompt_len=16, engine_s=60.0,
                probed="ours_chain"),
}


def rate_for_tau(tau: float, block: int = BLOCK) -> float:
    """The per-position acceptance p at which a chain of `block` rows commits `tau` tokens a step on average:
    1 + p + p^2 + ... + p^(block-1) = tau (bisection; tau in [1, block])."""
    if not 1.0 <= tau <= block:
        raise ValueError(f"tau {tau} outside [1, {block}]")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        lo, hi = (p, hi) if sum(p**k for k in range(block)) < tau else (lo, p)
    return (lo + hi) / 2


def arms(tau: float, device: str) -> dict[str, tuple[dict, dict[str, str]]]:
    """name -> (Engine kwargs beyond the common ones, environment) of every speculative arm at `tau`."""
    draft = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(SHIPPED_DRAFT)}
    rate = {"DFLASH_SIMULATE_ACC_RATE": f"{rate_for_tau(tau):.6f}"}
    out = {"ours_chain": ({**draft, "speculative_num_draft_tokens": BLOCK}, rate),
           "ours_controller": (dict(draft), rate)}
    if device == "cuda":
        # (its draft attention on FlashInfer: sglang-kernel travels without FA3, gpu_wheels.TRIMS)
        out["builtin"] = ({**draft, "speculative_num_draft_tokens": BLOCK, "speculative_draft_attention_backend":
                           "flashinfer"},
                          {IMPL_ENV: "builtin", "SGLANG_SIMULATE_ACC_LEN": str(tau),
                           "SGLANG_SIMULATE_ACC_METHOD": "match-expected"})
    return out


def child_env(ctx: Context, extra: dict[str, str]) -> dict[str, str]:
    """The Engine child's environment: on CPU bench/server.py's (import shims, one OpenMP thread); on CUDA the
    checkout first on PYTHONPATH (our plugin), nothing shimmed. Every arm logs dflash_sglang at INFO (our worker's
    start-up line: `ours_started`), SGLang's own loggers at WARNING."""
    from .server import cpu_env

    base = cpu_env(REPO) if not ctx.cuda else {
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "SGLANG_PLUGINS": "dflash_sglang"}
    logging_json = ctx.work / "throughput" / "logging_info.json"
    logging_json.parent.mkdir(parents=True, exist_ok=True)
    logging_json.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False, "handlers": {"stderr": {"class": "logging.StreamHandler"}},
        "root": {"level": "WARNING", "handlers": ["stderr"]}, "loggers": {"dflash_sglang": {"level": "INFO"}}}))
    return {**os.environ, **base, "SGLANG_LOGGING_CONFIG_PATH": str(logging_json), **extra}


def ours_started(name: str, log: Path) -> bool:
    """An `ours` arm's log shows our worker's start-up line (a plugin that failed to load leaves SGLang's builtin
    serving DFLASH, which would be timed as ours)."""
    return not name.startswith("ours") or OURS_LOG_MARKER in log.read_text(errors="replace")


def _engine_verdict(rc, log: Path) -> str:
    if rc == "timeout":  # the budget ran out under it: not the Engine's fault
        return f"skipped: budget (killed at the session's deadline; log {log.name})"
    return f"FAIL: the Engine exited {rc} (log {log.name})"


def run_engine(ctx: Context, name: str, kwargs: dict, env: dict[str, str], plan: list[dict],
               new_tokens: int) -> tuple[dict | None, Path, int | str]:
    """One Engine child (its own session, killed as a group at the budget's end): (its result or None, its log, its
    exit status or "timeout")."""
    job = ctx.work / "throughput" / f"{name}.job.json"
    job.parent.mkdir(parents=True, exist_ok=True)
    result, log = job.with_suffix("").with_suffix(".result.json"), job.with_suffix("").with_suffix(".log")
    result.unlink(missing_ok=True)
    job.write_text(json.dumps({"arm": name, "plan": plan, "new_tokens": new_tokens, "engine_kwargs": kwargs,
                               "sampling": {}, "result": str(result)}))
    cmd = [sys.executable, "-m", "dflash_sglang.bench.gpu_probe", str(job)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=child_env(ctx, env), stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(ctx.budget.left(), 10.0))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its scheduler and detokenizer too
    return (json.loads(result.read_text()) if rc == 0 and result.is_file() else None), log, rc


def common_kwargs(ctx: Context, target: Path, sizes: dict) -> dict:
    c = max(sizes["concurrency"])
    kw = {"model_path": str(target), "skip_tokenizer_init": True, "random_seed": 0, "log_level": "warning",
          "max_running_requests": c, "max_total_tokens": max(8192, 2 * c * (sizes["prompt_len"] + sizes["new_tokens"]
                                                                               + 2 * BLOCK))}
    if ctx.cuda:
        return {**kw, "dtype": "bfloat16", "attention_backend": "flashinfer", "cuda_graph_max_bs_decode": c}
    return {**kw, "device": "cpu", "dtype": "float32", "attention_backend": "torch_native"}


def stage_throughput(ctx: Context) -> Table:
    from .engine import build_plan, summarize

    sizes = SIZES[ctx.device]
    table = Table(f"Stage 3: tokens/s at a simulated acceptance ({ctx.device})",
                  ["arm", "tau", "c", "tok/s", "vs none", "accept len", "ms/step", "verdict"])
    target = ctx.cache.setdefault("smollm2", smollm2_dummy(ctx.work / "smollm2_dummy"))  # (bf16; CPU runs float32)
    rng = random.Random(0)  # token ids 100.. (below: special and character ids), the same prompts for every arm
    prompts = [[rng.randrange(100, 49000) for _ in range(sizes["prompt_len"])]
               for _ in range(max(sizes["concurrency"]))]
    plan = build_plan("eval", list(sizes["concurrency"]), 1, prompts, [])
    common, est = common_kwargs(ctx, target, sizes), sizes["engine_s"]
    results: dict[str, dict | None] = {}
    skipped = []
    cells = [("none", None, {}, {})] + [(f"{arm}@{tau:g}", tau, kw, env) for tau in sizes["taus"]
                                        for arm, (kw, env) in arms(tau, ctx.device).items() if arm in sizes["arms"]]
    for name, tau, kw, env in cells:
        # the first tau is the stage's must part; later taus leave room for the later stages and the probe Engine
        reserve = 0.0 if tau is None or tau == sizes["taus"][0] else ctx.reserve_s + est
        if not ctx.budget.fits(est, reserve):
            skipped.append(dict(arm=name.split("@")[0], tau=tau, verdict=ctx.budget.skip_reason(est, reserve)))
            continue
        probe = {PROBE_ENV: "1"} if sizes["probed"] and name.startswith(sizes["probed"] + "@") else {}
        res, log, rc = run_engine(ctx, name, {**common, **kw}, {**env, **probe}, plan, sizes["new_tokens"])
        if probe:
            ctx.cache["probe_log"] = log
        if res is not None and not ours_started(name, log):
            res, rc = None, f"0 but our worker did not start (no '{OURS_LOG_MARKER}' line)"
        results[name] = res
        if res is None:
            table.add(arm=name.split("@")[0], tau=tau, verdict=_engine_verdict(rc, log))
        ctx.publish(table)
    for row in summarize(plan, {k: v for k, v in results.items() if v is not None}, baseline="none"):
        arm, _, tau = row["arm"].partition("@")
        table.add(arm=arm, tau=float(tau) if tau else None, c=row["c"], **{"tok/s": row["tok_s"]},
                  **{"vs none": row["ratio"] if arm != "none" else None}, **{"accept len": row["accept_mean"]},
                  **{"ms/step": row["ms_per_step"]}, verdict="pass")
    table.rows += skipped
    table.notes += [f"SmolLM2-135M architecture, seeded weights, {'bf16 FlashInfer' if ctx.cuda else 'float32 CPU'}; "
                    f"shipped drafter; {sizes['prompt_len']}-token prompts x {sizes['new_tokens']} new tokens, one "
                    "Engine at a time, one repeat (a ratio without an interval)",
                    "ours: DFLASH_SIMULATE_ACC_RATE=p, 1 + p + ... + p^15 = tau; builtin: SGLANG_SIMULATE_ACC_LEN=tau"]
    table.notes += controller_steps(ctx, common, plan, sizes, est)
    return table


def controller_steps(ctx: Context, common: dict, plan: list[dict], sizes: dict, est: float) -> list[str]:
    """The controller's shape mix at the middle tau, from a probed Engine: one note per verify width."""
    tau = sorted(sizes["taus"])[len(sizes["taus"]) // 2]
    what = f"controller at tau {tau:g}"
    if "probe_log" in ctx.cache:  # (CPU: a timed Engine was probed)
        log, ok, what = ctx.cache.pop("probe_log"), True, f"{sizes['probed']} at tau {sizes['taus'][0]:g}"
    elif not ctx.budget.fits(est, ctx.reserve_s):
        return [f"controller shape mix: {ctx.budget.skip_reason(est, ctx.reserve_s)}"]
    else:
        kw, env = arms(tau, ctx.device)["ours_controller"]
        res, log, rc = run_engine(ctx, f"probe@{tau:g}", {**common, **kw}, {**env, PROBE_ENV: "1"}, plan,
                                  sizes["new_tokens"])
        if res is None:
            return [f"controller shape mix: {_engine_verdict(rc, log)}"]
        ok = True
    uses = width_uses(log.read_text(errors="replace"))
    if not ok or not uses:
        return [f"controller shape mix: FAIL: no probe lines (log {log.name})"]
    total = sum(u.steps for u in uses)
    return [f"{what}, width {u.width}{' (tree)' if u.tree else ''}: {u.steps}/{total} verify "
            f"steps, {100 * u.graphed_share:.0f}% CUDA-graphed, median step {u.step_ms} ms" for u in uses]
