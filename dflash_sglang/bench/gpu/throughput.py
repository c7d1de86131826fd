"""Stage 3: tokens/s of ours vs SGLang's builtin DFLASH vs no speculation at a simulated acceptance, each verdict read
from a figure, and how the controller spends its steps.

First the user's shape (the headline): a Qwen3-8B target and a drafter of z-lab/Qwen3-8B-DFlash-b16's config, both
with SGLang's dummy weights (`load_format` "dummy": built from config.json alone, gpu_targets.py `qwen3_8b_pair`),
bf16 on FlashInfer with CUDA graphs, at tau 4 (then 6 where the budget allows). Then, if time is left, the SmolLM2-135M
architecture with seeded weights and the shipped drafter at tau 4, 2, 6. A random target accepts nothing, so
acceptance is simulated at the same tau for both implementations, which makes this the fair comparison of the two: the
builtin commits a mean of tau tokens a step (SGLANG_SIMULATE_ACC_LEN, its own law), ours accepts each draft position
with the rate p at which a block-16 chain commits tau on average (DFLASH_SIMULATE_ACC_RATE, `rate_for_tau`), as a
pinned chain of 16 and under the goodput controller (no shape flag), which chooses shorter chains or plain steps where
they pay. Per target, arm and tau one Engine (one at a time), then measure/passes.py's plan: per concurrency c a
warm-up and one timed greedy call of c prompts x new tokens; its `summarize` gives tokens/s and the ratio to no
speculation.

Verdicts (`speed_rows`): a speculative arm whose accept length over all its timed rounds misses tau (`simulation_check`)
fails, since its speed would then be measured at another acceptance; per c, ours against the builtin is faster, the
same or slower (`versus_builtin`); no speculation is the baseline. Then one more controller Engine on the headline
pair at its first tau with the verify probe (gpu_probe.py): the shape mix and, per verify width, the share of steps
that replayed a CUDA graph and the median step time.

On CPU (the rehearsal) the headline's code path at toy size: the same two architectures (gpu_targets.QWEN3_TINY),
dummy-loaded in float32, no speculation, the controller and the pinned chain (probed: the probe's plumbing), no
builtin (its DFLASH worker needs CUDA) and no SmolLM2 rows; its timings mean nothing, its verdicts' plumbing does.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_sglang.bench.gpu.probe import PROBE_ENV, width_uses
from dflash_sglang.bench.gpu.context import Context, Table
from dflash_sglang.bench.gpu.targets import (QWEN3_8B_SHAPE, QWEN3_TINY, REPO, SHIPPED_DRAFT, qwen3_8b_pair,
                                             smollm2_dummy)
from dflash_sglang.bench.serving.pareto import OURS_LOG_MARKER

BLOCK = 16  # both drafters' block
IMPL_ENV = "DFLASH_SGLANG_IMPL"
NONE = "none"
FASTER, SLOWER = 1.05, 0.95  # ours / builtin tokens/s at or beyond which a row says faster / slower
ACCEPT_BAND = 0.10  # an arm's accept length may miss tau by this share of tau (or 3 standard errors, if wider)


@dataclass(frozen=True)
class Bench:
    """A target + drafter the stage times on one device, at that device's sizes."""

    key: str  # the table's `target` column
    what: str  # the table's note on it
    pair: Callable[[Context], tuple[Path, Path]]  # built where it runs: (target dir, draft dir)
    dummy: bool  # both models on SGLang's dummy load format (their folders hold config.json only)
    taus: tuple[float, ...]  # in the order run
    arms: tuple[str, ...]  # the speculative arms, in the order run (after `none`)
    concurrency: tuple[int, ...]
    new_tokens: int
    prompt_len: int
    first_s: float  # the bench's first Engine's estimated seconds
    engine_s: float  # each later Engine's
    probed: str | None = None  # an arm whose timed Engine also carries the probe (CPU); None: one more Engine


def _qwen3(ctx: Context) -> tuple[Path, Path]:
    return qwen3_8b_pair(ctx.work / f"qwen3_{ctx.device}", QWEN3_8B_SHAPE if ctx.cuda else QWEN3_TINY)


def _smollm2(ctx: Context) -> tuple[Path, Path]:
    return ctx.cache.setdefault("smollm2", smollm2_dummy(ctx.work / "smollm2_dummy")), SHIPPED_DRAFT  # (bf16)


# The headline's 256 new tokens: ~64 batch steps per c at tau 4, ~190 simulated draws per arm (`accept_tolerance`:
# +-0.7 tokens at tau 4; 128 would give +-1.0), for ~4 s more per Engine than 128.
# Seconds on a fresh H100: an 8B Engine starts in ~40-50 s (process and imports ~15 s, dummy weights drawn on the GPU
# ~5 s, target + draft CUDA graphs for batch sizes up to 32 ~20-30 s) and decodes its plan in ~10 s (16 GB of weights
# read per step: ~8 ms a plain step at c = 1); the first also JIT-builds FlashInfer's head_dim-128 kernels (~30-40 s;
# stage 2 built only head_dim 64's). The SmolLM2 Engines: the 2026-11-23 sessions' ~40 s. CPU (2 cores, measured): a
# toy Engine ~15 s from launch to exit (~7 s to start, its plan under 2 s); the first pays the cold imports.
SIZES: dict[str, tuple[Bench, ...]] = {  # per device, in the order run; the first bench's first tau is the must part
    "cuda": (Bench("qwen3-8b", "Qwen3-8B (Qwen3ForCausalLM, 36 layers, hidden 4096, 32/8 heads of 128, vocab 151936) "
                   "+ a drafter of z-lab/Qwen3-8B-DFlash-b16's config (5 layers, 5 target features), SGLang dummy "
                   "weights", _qwen3, True, (4.0, 6.0), ("ours_controller", "ours_chain", "builtin"), (1, 8, 32),
                   256, 128, 90.0, 60.0),
             Bench("smollm2-135m", "the SmolLM2-135M architecture, seeded weights, the shipped drafter", _smollm2,
                   False, (4.0, 2.0, 6.0), ("ours_controller", "ours_chain", "builtin"),
                   (1, 8, 32), 128, 128, 40.0, 40.0)),
    "cpu": (Bench("qwen3-tiny", "the Qwen3-8B pair's architectures at toy size (gpu_targets.QWEN3_TINY), SGLang "
                  "dummy weights", _qwen3, True, (4.0,), ("ours_controller", "ours_chain"), (1, 4), 128, 16, 30.0,
                  20.0, probed="ours_chain"),),
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


def chain_sd(tau: float, block: int = BLOCK) -> float:
    """The standard deviation of the tokens a chain of `block` rows commits in one step at `rate_for_tau(tau)` = p:
    P(L = k) = p^(k-1) (1 - p) for k < block, P(L = block) = p^(block-1)."""
    p = rate_for_tau(tau, block)
    law = [(k, p ** (k - 1) * (1 - p)) for k in range(1, block)] + [(block, p ** (block - 1))]
    mean = sum(k * q for k, q in law)
    return math.sqrt(sum((k - mean) ** 2 * q for k, q in law))


def accept_tolerance(tau: float, draws: int) -> float:
    """How far an accept length measured over `draws` simulated commit lengths may land from `tau`: ACCEPT_BAND of
    tau, or 3 standard errors of the chain's law where that is wider. A few dozen draws (the CPU rehearsal's) scatter
    by more than 10% of tau on their own (the law's sd is ~3.3 tokens at tau 4), so a 10% band alone would fail a
    correct simulation there; the band binds from ~620 draws at tau 4."""
    return max(ACCEPT_BAND * tau, 3 * chain_sd(tau) / math.sqrt(max(draws, 1)))


def accept_figure(result: dict) -> tuple[float, int] | None:
    """(tokens committed per verify step, the simulated commit lengths behind them) over every timed round of an
    Engine's result (measure/passes.py `run_steps`: per request its output ids and `spec_verify_ct`); None where
    no verify step was counted. The mean is over requests' steps (a request's first token comes from its prefill, not a
    verify step); the draws are each round's batch steps (its largest verify count): the simulation draws one length per
    batch step for all its requests (adapter/simulate.py, and the builtin alike), so c requests' steps are not c
    independent samples."""
    committed = steps = draws = 0
    for r in result["rounds"]:
        counted = [(len(ids) - 1, verify_ct) for ids, verify_ct in zip(r["ids"], r["verify_ct"]) if verify_ct]
        committed += sum(n for n, _ in counted)
        steps += sum(ct for _, ct in counted)
        draws += max((ct for _, ct in counted), default=0)
    return (committed / steps, draws) if steps else None


def simulation_check(arm: str, tau: float, figure: tuple[float, int] | None) -> str | None:
    """None where the arm committed what the simulation asks, else its FAIL verdict. The pinned chain and the builtin
    must land within `accept_tolerance` of tau on both sides; the controller only not above it (its shorter chains and
    plain steps commit less)."""
    if figure is None:
        return "FAIL: no accept length (no verify step counted)"
    accept, draws = figure
    off, tolerance = accept - tau, accept_tolerance(tau, draws)
    if off > tolerance or (arm != "ours_controller" and off < -tolerance):
        return f"FAIL: simulation off (accept length {accept:.2f} at tau {tau:g})"
    return None


def versus_builtin(ratio: float) -> str:
    """Ours / builtin tokens/s in words: faster from FASTER up, slower from SLOWER down, else the same."""
    word = "faster" if ratio >= FASTER else "slower" if ratio <= SLOWER else "same"
    return f"{word}: {ratio:.2f}x builtin"


def speed_rows(rows: list[dict], results: dict[str, dict]) -> list[dict]:
    """The table's rows of one bench from measure/passes.py `summarize`'s (arm "name@tau" or "none" x c) and the
    Engines' results: tok/s, vs none, vs builtin (the builtin's tokens/s at the same tau and c), accept len, ms/step,
    verdict. Verdicts: no figure: FAIL; a speculative arm whose simulation is off (`simulation_check`): FAIL on all its
    rows; none: pass (the baseline); ours: `versus_builtin` where that builtin passed; else pass with the ratio to
    none."""
    sim = {arm: simulation_check(arm.partition("@")[0], float(arm.partition("@")[2]), accept_figure(res))
           for arm, res in results.items() if arm != NONE}
    builtin = {r["arm"].partition("@")[2]: {} for r in rows if r["arm"].startswith("builtin@")}
    for r in rows:  # (a builtin whose simulation is off is no yardstick)
        if r["arm"].startswith("builtin@") and sim.get(r["arm"]) is None:
            builtin[r["arm"].partition("@")[2]][r["c"]] = r["tok_s"]
    out = []
    for r in rows:
        name, _, tau = r["arm"].partition("@")
        base = builtin.get(tau, {}).get(r["c"]) if name.startswith("ours") else None
        vs_builtin = round(r["tok_s"] / base, 3) if base and r["tok_s"] else None
        if not r["tok_s"]:
            verdict = "FAIL: no tokens/s figure"
        elif sim.get(r["arm"]):
            verdict = sim[r["arm"]]
        elif vs_builtin is not None:
            verdict = versus_builtin(vs_builtin)
        else:
            verdict = f"pass: {r['ratio']:.2f}x none" if name != NONE and r["ratio"] else "pass"
        out.append({"arm": name, "tau": float(tau) if tau else None, "c": r["c"], "tok/s": r["tok_s"],
                    "vs none": r["ratio"] if name != NONE else None, "vs builtin": vs_builtin,
                    "accept len": r["accept_mean"], "ms/step": r["ms_per_step"], "verdict": verdict})
    return out


def arms(tau: float, device: str, draft: Path = SHIPPED_DRAFT, dummy: bool = False
         ) -> dict[str, tuple[dict, dict[str, str]]]:
    """name -> (Engine kwargs beyond the common ones, environment) of every speculative arm at `tau` with `draft`
    (dummy: its weights drawn by SGLang's dummy loader, its folder holding config.json only)."""
    spec = {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(draft),
            **({"speculative_draft_load_format": "dummy"} if dummy else {})}
    rate = {"DFLASH_SIMULATE_ACC_RATE": f"{rate_for_tau(tau):.6f}"}
    out = {"ours_chain": ({**spec, "speculative_num_draft_tokens": BLOCK}, rate),
           "ours_controller": (dict(spec), rate)}
    if device == "cuda":
        # (its draft attention on FlashInfer: sglang-kernel travels without FA3, gpu_wheels.TRIMS)
        out["builtin"] = ({**spec, "speculative_num_draft_tokens": BLOCK, "speculative_draft_attention_backend":
                           "flashinfer"},
                          {IMPL_ENV: "builtin", "SGLANG_SIMULATE_ACC_LEN": str(tau),
                           "SGLANG_SIMULATE_ACC_METHOD": "match-expected"})
    return out


def cells(device: str) -> list[tuple[Bench, str, float | None]]:
    """Every Engine the stage times on `device`, in order: per bench no speculation, then per tau its arms."""
    return [(b, arm, tau) for b in SIZES[device]
            for arm, tau in [(NONE, None)] + [(arm, tau) for tau in b.taus for arm in b.arms]]


def child_env(ctx: Context, extra: dict[str, str]) -> dict[str, str]:
    """The Engine child's environment: on CPU bench/common/server.py's (import shims, one OpenMP thread); on CUDA the
    checkout first on PYTHONPATH (our plugin), nothing shimmed. Every arm logs dflash_sglang at INFO (our worker's
    start-up line: `ours_started`), SGLang's own loggers at WARNING."""
    from dflash_sglang.measure.cpu_env import cpu_env

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


def _engine_verdict(rc, log: Path, timeout_s: float) -> str:
    if rc == "timeout":  # over its share of the budget (Context.timeout): the time is the later stages'
        return f"skipped: budget (killed after {timeout_s:.0f} s; log {log.name})"
    return f"FAIL: the Engine exited {rc} (log {log.name})"


def run_engine(ctx: Context, name: str, kwargs: dict, env: dict[str, str], plan: list[dict], new_tokens: int,
               timeout_s: float) -> tuple[dict | None, Path, int | str]:
    """One Engine child (its own session, killed as a group after `timeout_s`): (its result or None, its log, its exit
    status or "timeout")."""
    job = ctx.work / "throughput" / f"{name}.job.json"
    job.parent.mkdir(parents=True, exist_ok=True)
    result, log = job.with_suffix("").with_suffix(".result.json"), job.with_suffix("").with_suffix(".log")
    result.unlink(missing_ok=True)
    job.write_text(json.dumps({"arm": name, "plan": plan, "new_tokens": new_tokens, "engine_kwargs": kwargs,
                               "sampling": {}, "result": str(result)}))
    cmd = [sys.executable, "-m", "dflash_sglang.bench.gpu.probe", str(job)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=child_env(ctx, env), stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its scheduler and detokenizer too
    return (json.loads(result.read_text()) if rc == 0 and result.is_file() else None), log, rc


def common_kwargs(ctx: Context, target: Path, bench: Bench) -> dict:
    c = max(bench.concurrency)
    kw = {"model_path": str(target), "skip_tokenizer_init": True, "random_seed": 0, "log_level": "warning",
          "max_running_requests": c, "max_total_tokens": max(8192, 2 * c * (bench.prompt_len + bench.new_tokens
                                                                               + 2 * BLOCK))}
    if bench.dummy:
        kw["load_format"] = "dummy"
    if ctx.cuda:
        return {**kw, "dtype": "bfloat16", "attention_backend": "flashinfer", "cuda_graph_max_bs_decode": c}
    return {**kw, "device": "cpu", "dtype": "float32", "attention_backend": "torch_native"}


@dataclass
class BenchRun:
    """One bench's Engines so far: its pair, plan and shared kwargs (set when its first Engine starts), their results
    (arm name "name@tau" or "none" -> result), and the rows of Engines that gave no result or were skipped."""

    bench: Bench
    target: Path | None = None
    draft: Path | None = None
    plan: list[dict] = field(default_factory=list)
    common: dict = field(default_factory=dict)
    results: dict[str, dict] = field(default_factory=dict)
    other_rows: list[dict] = field(default_factory=list)
    engines: int = 0  # Engines started

    def prepare(self, ctx: Context) -> None:
        """Build the pair and the plan: the same prompts for every arm, token ids from 100 (below: special and
        character ids) to 300 short of the vocabulary's end (Qwen3's special and unused ids)."""
        from dflash_sglang.measure.passes import build_plan

        self.target, self.draft = self.bench.pair(ctx)
        vocab = json.loads((self.target / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        prompts = [[rng.randrange(100, vocab - 300) for _ in range(self.bench.prompt_len)]
                   for _ in range(max(self.bench.concurrency))]
        self.plan = build_plan("eval", list(self.bench.concurrency), 1, prompts, [])
        self.common = common_kwargs(ctx, self.target, self.bench)

    def rows(self) -> list[dict]:
        from dflash_sglang.measure.passes import summarize

        measured = speed_rows(summarize(self.plan, self.results, baseline=NONE), self.results)
        return [{"target": self.bench.key, **r} for r in measured + self.other_rows]


def stage_throughput(ctx: Context) -> Table:
    table = Table(f"Stage 3: tokens/s at a simulated acceptance ({ctx.device})",
                  ["target", "arm", "tau", "c", "tok/s", "vs none", "vs builtin", "accept len", "ms/step", "verdict"])
    runs = {b.key: BenchRun(b) for b in SIZES[ctx.device]}
    headline = SIZES[ctx.device][0]
    # the headline's first tau is the stage's must part; the rest leave room for the later stages and the probe Engine
    optional_reserve = ctx.reserve_s + (0.0 if headline.probed else headline.engine_s)
    for bench, arm, tau in cells(ctx.device):
        run, name = runs[bench.key], arm if tau is None else f"{arm}@{tau:g}"
        est = bench.engine_s if run.engines else bench.first_s
        reserve = 0.0 if bench is headline and tau in (None, bench.taus[0]) else optional_reserve
        if not ctx.budget.fits(est, reserve):
            run.other_rows.append(dict(arm=arm, tau=tau, verdict=ctx.budget.skip_reason(est, reserve)))
            continue
        if run.target is None:
            run.prepare(ctx)
        kw, env = ({}, {}) if tau is None else arms(tau, ctx.device, run.draft, bench.dummy)[arm]
        probe = {PROBE_ENV: "1"} if arm == bench.probed and tau == bench.taus[0] else {}
        timeout_s, run.engines = ctx.timeout(est), run.engines + 1
        res, log, rc = run_engine(ctx, f"{bench.key}_{name}", {**run.common, **kw}, {**env, **probe}, run.plan,
                                  bench.new_tokens, timeout_s)
        if probe:
            ctx.cache["probe_log"] = log
        if res is not None and not ours_started(arm, log):
            res, rc = None, f"0 but our worker did not start (no '{OURS_LOG_MARKER}' line)"
        if res is None:
            run.other_rows.append(dict(arm=arm, tau=tau, verdict=_engine_verdict(rc, log, timeout_s)))
        else:
            run.results[name] = res
        table.rows = [r for b in runs.values() for r in b.rows()]
        ctx.publish(table)
    table.rows = [r for b in runs.values() for r in b.rows()]
    table.notes += [bench_note(b, ctx.cuda) for b in SIZES[ctx.device]]
    table.notes += ["ours: DFLASH_SIMULATE_ACC_RATE=p, 1 + p + ... + p^15 = tau; builtin: SGLANG_SIMULATE_ACC_LEN=tau. "
                    "A speculative arm fails where its tokens per verify step over all its rounds miss tau by more "
                    f"than max({ACCEPT_BAND:.0%} of tau, 3 standard errors) (the controller: only above); ours vs "
                    f"builtin is faster from {FASTER}x, slower from {SLOWER}x down"]
    if not ctx.cuda:
        table.notes.append("CPU: no builtin (its DFLASH worker needs CUDA) and no SmolLM2 rows; timings mean nothing")
    verdict, notes = controller_steps(ctx, runs[headline.key])
    table.add(target=headline.key, arm="controller probe", tau=headline.taus[0], verdict=verdict)
    table.notes += notes
    return table


def bench_note(bench: Bench, cuda: bool) -> str:
    return (f"{bench.key}: {bench.what}; {'bf16 FlashInfer, CUDA graphs' if cuda else 'float32 CPU'}; "
            f"{bench.prompt_len}-token prompts x {bench.new_tokens} new tokens, c = "
            f"{', '.join(map(str, bench.concurrency))}, one Engine at a time, one repeat (a ratio without an interval)")


def controller_steps(ctx: Context, run: BenchRun) -> tuple[str, list[str]]:
    """The controller's shape mix on the headline pair at its first tau, from a probed Engine (CPU: the probed timed
    Engine's): the probe's verdict (a row of the table, so a broken probe fails the stage) and one note per verify
    width."""
    bench, tau = run.bench, run.bench.taus[0]
    what = f"{bench.key} controller at tau {tau:g}"
    if "probe_log" in ctx.cache:  # (CPU: a timed Engine was probed)
        log, what = ctx.cache.pop("probe_log"), f"{bench.key} {bench.probed} at tau {tau:g}"
    elif run.target is None:
        return _shape_mix(f"skipped: the {bench.key} pair was not built (no Engine of it ran)")
    elif not ctx.budget.fits(bench.engine_s, ctx.reserve_s):
        return _shape_mix(ctx.budget.skip_reason(bench.engine_s, ctx.reserve_s))
    else:
        kw, env = arms(tau, ctx.device, run.draft, bench.dummy)["ours_controller"]
        timeout_s = ctx.timeout(bench.engine_s)
        res, log, rc = run_engine(ctx, f"{bench.key}_probe@{tau:g}", {**run.common, **kw}, {**env, PROBE_ENV: "1"},
                                  run.plan, bench.new_tokens, timeout_s)
        if res is None:
            return _shape_mix(_engine_verdict(rc, log, timeout_s))
    uses = width_uses(log.read_text(errors="replace"))
    if not uses:
        return _shape_mix(f"FAIL: no probe lines (log {log.name})")
    total = sum(u.steps for u in uses)
    return "pass", [f"{what}, width {u.width}{' (tree)' if u.tree else ''}: {u.steps}/{total} verify "
                    f"steps, {100 * u.graphed_share:.0f}% CUDA-graphed, median step {u.step_ms} ms" for u in uses]


def _shape_mix(verdict: str) -> tuple[str, list[str]]:
    return verdict, [f"controller shape mix: {verdict}"]
