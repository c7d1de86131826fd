"""The GPU session's stages, in order, with what each decides (docs/gpu_session.md) and its cost estimates.

0. install: the carried wheels, the Engine's import chain, the GPU (gpu_prelude.py);
1. kernels: our CUDA ops against their core/ references, eagerly and replayed from CUDA graphs, and the FlashInfer
   draft attention per layer kind, over an fp8 pool and inside captured draft graphs, against the torch reference
   (the GPU cases of the test files, by pytest; CUDA only);
2. identity: SGLang Engines, DFLASH against plain (gpu_identity.py);
3. throughput: ours vs builtin vs none at a simulated acceptance, a Qwen3-8B-shaped pair first, the controller's steps
   (gpu_throughput.py);
4. experimental: each gated feature against plain (gpu_identity.py);
5. training: `dflash-sglang train` on the device (bf16 autocast, the trainer's loop) on the seeded SmolLM2-shaped
   target with synthetic prompts: that the path runs, and its steps/s; only if time remains.

Stages 4 and 5 are optional: the earlier stages keep no reserve for them, so they run on what is left.

The estimates are guesses from the 2026-11-23 sessions until a session's session.json gives measured seconds.
"""
from __future__ import annotations

import json
import os
import math
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from dflash_sglang.bench.gpu.identity import stage_experimental, stage_identity
from dflash_sglang.bench.gpu.prelude import stage_prelude
from dflash_sglang.bench.gpu.context import Context, Stage, Table, run_logged
from dflash_sglang.bench.gpu.targets import REPO, smollm2_dummy, synthetic_sharegpt, tests_importable
from dflash_sglang.bench.gpu.throughput import stage_throughput

KERNEL_TESTS = (  # (what, test file, estimated seconds on CUDA: nvcc / FlashInfer JIT builds included)
    ("CUDA ops vs core references, eager and CUDA-graph replay", "tests/test_ops_gpu.py", 70.0),
    ("FlashInfer draft attention per layer kind vs torch", "tests/test_draft_attention.py", 60.0),
    ("FlashInfer over an fp8 draft pool vs torch", "tests/test_draft_kv.py", 20.0),
    ("captured draft graphs vs eager (DFlash, DFlash2)", "tests/test_draft_graphs.py", 30.0),
)
# A GPU case may skip only for a feature this GPU lacks, and says so with these words in its skip reason (e.g. fp8
# on an sm80 part); any other skip (no flashinfer, no sglang, no CUDA device) means the case did not run where it
# had to: a failure.
GPU_LACKS = "this GPU lacks"


def pytest_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


@dataclass(frozen=True)
class Case:
    """One test case of a junit report: its name, and its outcome (passed / failed / skipped) with the message."""

    name: str
    outcome: str
    message: str = ""


def junit_cases(xml_path) -> list[Case]:
    """Every test case of a pytest --junitxml report."""
    cases = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        child = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        if child is None:
            cases.append(Case(name, "passed"))
        else:
            outcome = "skipped" if child.tag == "skipped" else "failed"
            cases.append(Case(name, outcome, (child.get("message") or child.text or "").strip().splitlines()[0]
                              if (child.get("message") or child.text) else ""))
    return cases


def kernel_verdict(cases: list[Case], rc: int | str) -> str:
    """pass only when GPU cases ran and passed, none failed, and every skip names a feature this GPU lacks."""
    if rc == "timeout":
        return "FAIL: pytest was killed at its timeout"
    if not cases:
        return f"FAIL: no GPU case ran (pytest {rc}: nothing collected under -m gpu, or it broke before)"
    failed = [c for c in cases if c.outcome == "failed"]
    wrong_skips = [c for c in cases if c.outcome == "skipped" and GPU_LACKS not in c.message]
    if failed:
        return f"FAIL: {len(failed)} failed ({failed[0].name}: {failed[0].message[:100]})"
    if wrong_skips:
        return (f"FAIL: {len(wrong_skips)} GPU cases skipped for no missing GPU feature ({wrong_skips[0].name}: "
                f"{wrong_skips[0].message[:100]})")
    if not any(c.outcome == "passed" for c in cases):
        return "FAIL: every GPU case was skipped"
    if rc != 0:
        return f"FAIL: pytest exited {rc} with no failed case (kernels log)"
    return "pass"


def ran_by_test(cases: list[Case]) -> str:
    """The GPU cases that passed, by test function: 'test_a x12, test_b x4'."""
    counts: dict[str, int] = {}
    for c in cases:
        if c.outcome == "passed":
            fn = c.name.split("::")[-1].split("[")[0]
            counts[fn] = counts.get(fn, 0) + 1
    return ", ".join(f"{fn} x{n}" for fn, n in counts.items())


def stage_kernels(ctx: Context) -> Table:
    """Stage 1: each kernel test file's GPU cases (`-m gpu`), one row per file, naming the cases that ran."""
    table = Table("Stage 1: CUDA kernels vs references", ["what", "file", "passed", "failed", "skipped", "seconds",
                                                           "ran", "verdict"])
    for i, (what, path, est) in enumerate(KERNEL_TESTS):
        reserve = 0.0 if i == 0 else ctx.reserve_s
        if not ctx.budget.fits(est, reserve):
            table.add(what=what, file=path, verdict=ctx.budget.skip_reason(est, reserve))
            continue
        xml = ctx.work / f"kernels_{i}.xml"
        xml.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", path, "-m", "gpu",
               f"--junitxml={xml}"]
        t0 = time.monotonic()
        rc = run_logged(cmd, ctx.work / f"kernels_{i}.log", ctx.timeout(est), cwd=REPO, env=pytest_env())
        cases = junit_cases(xml) if xml.is_file() else []
        counts = {k: sum(c.outcome == k for c in cases) for k in ("passed", "failed", "skipped")}
        table.add(what=what, file=path, **counts, seconds=round(time.monotonic() - t0, 1), ran=ran_by_test(cases),
                  verdict=kernel_verdict(cases, rc))
        ctx.publish(table)
    table.notes.append(f"only the files' GPU cases (-m gpu) run; a skip passes only when its reason says "
                       f"'{GPU_LACKS} ...'")
    return table


STAGE_TRAIN_S = {"cuda": 100.0, "cpu": 20.0}  # the training stage's estimate (minutes of steps + generation + start)
TRAIN = {  # per device: prompts, new tokens regenerated, the time budget (minutes) of the optimizer steps
    "cuda": dict(samples=512, new_tokens=64, minutes=1.0, batch=32),
    "cpu": dict(samples=6, new_tokens=6, minutes=None, batch=2),
}


def stage_training(ctx: Context) -> Table:
    """Stage 5: a short `dflash-sglang train` run on the device, from random init (its steps/s, final numbers)."""
    table = Table("Stage 5: drafter training on " + ctx.device, ["target", "sequences", "steps", "steps/s",
                                                                  "loss", "seconds", "verdict"])
    size = TRAIN[ctx.device]
    if ctx.cuda:
        target = ctx.cache.setdefault("smollm2", smollm2_dummy(ctx.work / "smollm2_dummy"))
    else:
        tests_importable()
        from factories import save_chat_target

        target = ctx.work / "chat_target" / "target"
        if not (target / "config.json").is_file():
            save_chat_target(target.parent)
    data = synthetic_sharegpt(ctx.work / "train_data.json", size["samples"] + 16)
    out = ctx.work / "trained_draft"
    cmd = [sys.executable, "-m", "dflash_sglang", "train", "--target", str(target), "--data", str(data), "--out",
           str(out), "--num-samples", str(size["samples"]), "--val-samples", "8" if ctx.cuda else "2",
           "--max-new-tokens", str(size["new_tokens"]), "--gen-batch-size", "64" if ctx.cuda else "4",
           "--num-layers", "1" if not ctx.cuda else "2", "--num-features", "2" if not ctx.cuda else "5",
           "--mask-token-id", "95", "--init", "random", "--batch-size", str(size["batch"]), "--num-anchors",
           "16" if ctx.cuda else "4", "--save-every", "1000", "--epochs", "40", "--device", ctx.device,
           *(["--time-budget-min", str(size["minutes"])] if size["minutes"] else ["--max-steps", "3", "--no-bf16"])]
    rc = run_logged(cmd, ctx.work / "training.log", ctx.timeout(STAGE_TRAIN_S[ctx.device]), cwd=REPO, env=pytest_env())
    summary = json.loads((out / "train_summary.json").read_text()) if (out / "train_summary.json").is_file() else {}
    steps = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()] \
        if (out / "train_log.jsonl").is_file() else []
    timed = [r for r in steps if "loss" in r and "elapsed_s" in r]
    rate = round(len(timed) / (timed[-1]["elapsed_s"] - timed[0]["elapsed_s"]), 2) if len(timed) > 2 and \
        timed[-1]["elapsed_s"] > timed[0]["elapsed_s"] else None
    losses = [float(r["loss"]) for r in timed]
    table.add(target="SmolLM2-135M shape, seeded" if ctx.cuda else "tiny llama", sequences=summary.get("sequences"),
              steps=summary.get("steps") or (timed[-1]["step"] if timed else None), **{"steps/s": rate},
              loss=f"{losses[0]:.3g} -> {losses[-1]:.3g}" if losses else None, seconds=summary.get("train_time_s"),
              verdict=training_verdict(rc, bool(summary), losses))
    table.notes.append("synthetic prompts on a random target: the training path and its speed, not a drafter to ship")
    return table


def training_verdict(rc: int | str, summary: bool, losses: list[float]) -> str:
    """pass when the run ended with its summary, logged optimizer steps, a finite loss throughout and, over 20 steps
    or more, a last loss below the first (a run that learns nothing is broken: the target is random, but the drafter
    can still learn its token statistics)."""
    if rc != 0 or not summary:
        return f"FAIL: train exited {rc}{'' if summary else ' without its summary'} (training.log)"
    if not losses:
        return "FAIL: no optimizer step was logged"
    if not all(math.isfinite(x) for x in losses):
        return f"FAIL: the loss went non-finite ({losses[-1]})"
    if len(losses) >= 20 and losses[-1] >= losses[0]:
        return f"FAIL: the loss did not fall over {len(losses)} steps ({losses[0]:.3g} -> {losses[-1]:.3g})"
    return "pass"


STAGES = (
    Stage(0, "install", "the carried wheels installed, the Engine's import chain, the GPU",
          "the stages after it can start an Engine with our plugin on this machine",
          stage_prelude, min_s={"cuda": 45.0, "cpu": 10.0}, full_s={"cuda": 60.0, "cpu": 20.0}),
    Stage(1, "kernels", "CUDA ops and FlashInfer draft attention vs references",
          "our kernels and the draft attention are exact on this GPU: the e2e stages' results can be trusted",
          stage_kernels, min_s={"cuda": 70.0}, full_s={"cuda": 180.0}),
    Stage(2, "identity", "SGLang Engine on the GPU: controller, chain, tree vs plain, graphs on and off",
          "ours is lossless under CUDA graphs on GPU: the precondition for serving and for stage 3's numbers",
          stage_identity, min_s={"cuda": 60.0, "cpu": 70.0}, full_s={"cuda": 90.0, "cpu": 90.0}),
    Stage(3, "throughput", "ours vs builtin vs none at simulated tau: Qwen3-8B shape (dummy weights) at tau 4 / 6, "
          "then SmolLM2-135M at tau 4 / 2 / 6; c = 1 / 8 / 32",
          "where ours stands against the builtin at the user's shape and equal acceptance (faster / same / slower per "
          "c), that the simulation held, and which verify widths the controller runs eagerly",
          # min: the headline at tau 4 (none, controller, chain, builtin: the first Engine ~90 s with FlashInfer's JIT
          # for head_dim 128, then ~60 s each); full: + tau 6, the probe Engine, the ten SmolLM2 Engines
          stage_throughput, min_s={"cuda": 270.0, "cpu": 70.0}, full_s={"cuda": 910.0, "cpu": 70.0}),
    Stage(4, "experimental", "DFlash2, fp8 draft KV, draft window, GDN hybrid, Gemma 4-style draft vs plain",
          "an identical run lifts that feature's --speculative-dflash-experimental gate (boot/draft_checks.py)",
          stage_experimental, min_s={"cuda": 60.0, "cpu": 70.0}, full_s={"cuda": 90.0, "cpu": 90.0}, optional=True),
    Stage(5, "training", "a short drafter training run on the device",
          "the training path runs on CUDA and how many steps/s a real run gets",
          stage_training, min_s=STAGE_TRAIN_S, full_s=STAGE_TRAIN_S, optional=True),
)


def select(numbers: str) -> list[Stage]:
    """The stages named by a comma list of numbers ('1,2,4'), in the order given."""
    by_number = {s.number: s for s in STAGES}
    try:
        chosen = [by_number[int(n)] for n in numbers.split(",") if n.strip()]
    except (KeyError, ValueError):
        raise SystemExit(f"--stages {numbers!r}: expected numbers among {sorted(by_number)}") from None
    return chosen
