"""The GPU session's five stages, in order, with what each decides (docs/gpu_session.md) and its cost estimates.

1. kernels: our CUDA ops against their core/ references, eagerly and replayed from CUDA graphs, and the FlashInfer
   draft attention per layer kind, over an fp8 pool and inside captured draft graphs, against the torch reference
   (the GPU cases of the test files, by pytest; CUDA only);
2. identity: SGLang Engines, DFLASH against plain (gpu_identity.py);
3. throughput: ours vs builtin vs none at a simulated acceptance, the controller's steps (gpu_throughput.py);
4. experimental: each gated feature against plain (gpu_identity.py);
5. training: `dflash-sglang train` on the device (bf16 autocast, the trainer's loop) on the seeded SmolLM2-shaped
   target with synthetic prompts: that the path runs, and its steps/s; only if time remains.

The estimates are guesses from the 2026-11-23 sessions until a session's session.json gives measured seconds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

from .gpu_identity import stage_experimental, stage_identity
from .gpu_context import Context, Stage, Table
from .gpu_targets import REPO, smollm2_dummy, synthetic_sharegpt, tests_importable
from .gpu_throughput import stage_throughput

KERNEL_TESTS = (  # (what, test file, -k selection, estimated seconds on CUDA: nvcc / FlashInfer JIT builds included)
    ("CUDA ops vs core references, eager and CUDA-graph replay", "tests/test_ops_gpu.py", None, 70.0),
    ("FlashInfer draft attention per layer kind vs torch", "tests/test_draft_attention.py", "on_gpu", 60.0),
    ("FlashInfer over an fp8 draft pool vs torch", "tests/test_draft_kv.py", "flashinfer_reads", 20.0),
    ("captured draft graphs vs eager (DFlash, DFlash2)", "tests/test_draft_graphs.py", "on_gpu or host_sync", 30.0),
)


def pytest_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def stage_kernels(ctx: Context) -> Table:
    """Stage 1: each kernel test file's GPU cases, one row per file (pytest's counts)."""
    table = Table("Stage 1: CUDA kernels vs references", ["what", "file", "passed", "failed", "skipped", "seconds",
                                                           "verdict"])
    for i, (what, path, select, est) in enumerate(KERNEL_TESTS):
        if not ctx.budget.fits(est, 0.0 if i == 0 else ctx.reserve_s):
            table.add(what=what, file=path, verdict=ctx.budget.skip_reason(est, 0.0 if i == 0 else ctx.reserve_s))
            continue
        xml = ctx.work / f"kernels_{i}.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", path, f"--junitxml={xml}"]
        cmd += ["-k", select] if select else []
        with open(ctx.work / f"kernels_{i}.log", "w") as log:
            try:
                rc = subprocess.run(cmd, cwd=REPO, env=pytest_env(), stdout=log, stderr=subprocess.STDOUT,
                                    timeout=max(ctx.budget.left(), 10.0)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        counts = junit_counts(xml) if xml.is_file() else {}
        ok = rc == 0 and counts.get("passed", 0) > 0
        table.add(what=what, file=path, **counts, verdict="pass" if ok else f"FAIL: pytest {rc} (kernels_{i}.log)")
        ctx.publish(table)
    return table


def junit_counts(xml_path) -> dict:
    """passed / failed / skipped / seconds of a pytest --junitxml report."""
    suite = ET.parse(xml_path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped,
            "seconds": round(float(suite.get("time", 0.0)), 1)}


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
    with open(ctx.work / "training.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=pytest_env(), stdout=log, stderr=subprocess.STDOUT,
                                timeout=max(ctx.budget.left(), 10.0)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    summary = json.loads((out / "train_summary.json").read_text()) if (out / "train_summary.json").is_file() else {}
    steps = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()] \
        if (out / "train_log.jsonl").is_file() else []
    timed = [r for r in steps if "loss" in r and "elapsed_s" in r]
    rate = round(len(timed) / (timed[-1]["elapsed_s"] - timed[0]["elapsed_s"]), 2) if len(timed) > 2 and \
        timed[-1]["elapsed_s"] > timed[0]["elapsed_s"] else None
    table.add(target="SmolLM2-135M shape, seeded" if ctx.cuda else "tiny llama", sequences=summary.get("sequences"),
              steps=summary.get("steps") or (timed[-1]["step"] if timed else None), **{"steps/s": rate},
              loss=(summary.get("final") or {}).get("loss"), seconds=summary.get("train_time_s"),
              verdict="pass" if rc == 0 and summary else f"FAIL: train exited {rc} (training.log)")
    table.notes.append("synthetic prompts on a random target: the training path and its speed, not a drafter to ship")
    return table


STAGES = (
    Stage(1, "kernels", "CUDA ops and FlashInfer draft attention vs references",
          "our kernels and the draft attention are exact on this GPU: the e2e stages' results can be trusted",
          stage_kernels, min_s={"cuda": 70.0}, full_s={"cuda": 180.0}),
    Stage(2, "identity", "SGLang Engine on the GPU: controller, chain, tree vs plain, graphs on and off",
          "ours is lossless under CUDA graphs on GPU: the precondition for serving and for stage 3's numbers",
          stage_identity, min_s={"cuda": 60.0, "cpu": 70.0}, full_s={"cuda": 90.0, "cpu": 90.0}),
    Stage(3, "throughput", "ours vs builtin vs none at simulated tau 2 / 4 / 6, c = 1 / 8 / 32",
          "where ours stands against the builtin at equal acceptance; which verify widths run eagerly",
          stage_throughput, min_s={"cuda": 160.0, "cpu": 120.0}, full_s={"cuda": 440.0, "cpu": 120.0}),
    Stage(4, "experimental", "DFlash2, fp8 draft KV, draft window, GDN hybrid, Gemma 4-style draft vs plain",
          "an identical run lifts that feature's --speculative-dflash-experimental gate (boot/draft_checks.py)",
          stage_experimental, min_s={"cuda": 60.0, "cpu": 70.0}, full_s={"cuda": 90.0, "cpu": 90.0}),
    Stage(5, "training", "a short drafter training run on the device",
          "the training path runs on CUDA and how many steps/s a real run gets",
          stage_training, min_s={"cuda": 100.0, "cpu": 20.0}, full_s={"cuda": 100.0, "cpu": 20.0}),
)


def select(numbers: str) -> list[Stage]:
    """The stages named by a comma list of numbers ('1,2,4'), in the order given."""
    by_number = {s.number: s for s in STAGES}
    try:
        chosen = [by_number[int(n)] for n in numbers.split(",") if n.strip()]
    except (KeyError, ValueError):
        raise SystemExit(f"--stages {numbers!r}: expected numbers among {sorted(by_number)}") from None
    return chosen
