"""Seeded A/B of drafter training recipes: same starting drafter, same cache, same batches; only the recipe differs.

Each arm is one `dflash-sglang train --skip-prepare` run on the same feature cache (CACHE/shard_*, held-out
CACHE/val), seed, batch size, anchors and step count, so every arm sees the same sequences and anchors at every step
(trainer.py draws both from (seed, step)). The held-out numbers (tau_est, CE loss, KL to the target, top-1 by
block position) are logged at step 0 and every --val-every steps in ARM/train_log.jsonl; --report prints the table.

  # the cache once: regenerated responses + target features + final hidden states, prompts the drafter never saw
  dflash-sglang train --out OUT/prep --cache-dir CACHE --skip-samples 6144 --num-samples 640 --val-samples 48 \\
      --max-new-tokens 128 --block-size 16 --num-layers 2 --num-features 5 \\
      --init dflash_sglang/assets/smollm2_135m_dflash --prepare-only --threads 1
  python scripts/train_ab.py --cache CACHE --out OUT --steps 80 --val-every 16   # arms A and B in parallel
  python scripts/train_ab.py --out OUT --report                                  # markdown table + JSON

On a CPU each arm runs on one thread at nice 19 (--threads; --no-parallel runs the arms one after the other).
On a GPU (docs/gpu_session.md) pass --device cuda --threads 0 and a larger --steps / --batch-size.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's dflash_sglang, whatever is installed

# The recipes. A: cross-entropy on the target's token with the paper's decay and a warm-up to 6e-4, the
# `dflash-sglang train` recipe before issue 38. B: the current defaults (logit distillation mixed with CE, the
# acceptance-following decay, from a draft checkpoint a cosine from a low lr without warm-up). C: A's loss with
# B's schedule, to tell the loss's share from the schedule's.
ARMS = {
    "A": ["--distill-weight", "0", "--gamma", "7", "--lr", "6e-4", "--warmup-ratio", "0.04"],
    "B": [],
    "C": ["--distill-weight", "0", "--gamma", "7"],
}
DESCRIPTIONS = {
    "A": "CE, gamma 7, warm-up 4% to lr 6e-4, cosine (before issue 38)",
    "B": "0.5 CE + 0.5 KL(target || draft), gamma 1.25, cosine from lr 2e-4, no warm-up (the defaults)",
    "C": "CE, gamma 7, cosine from lr 2e-4, no warm-up (A's loss, B's schedule)",
}


def arm_command(args, arm: str) -> list[str]:
    """The `dflash-sglang train` command of one arm (--val-samples 1: any value > 0 loads CACHE/val)."""
    cmd = [sys.executable, "-m", "dflash_sglang", "train", "--out", str(args.out / arm), "--cache-dir",
           str(args.cache), "--skip-prepare", "--val-samples", "1", "--init", str(args.init),
           "--draft-vocab", str(args.draft_vocab), "--block-size", "16", "--num-layers", "2", "--num-features", "5",
           "--batch-size", str(args.batch_size), "--num-anchors", str(args.num_anchors), "--max-steps",
           str(args.steps), "--save-every", str(args.val_every), "--val-every", str(args.val_every), "--seed",
           str(args.seed)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.device:
        cmd += ["--device", args.device]
    return cmd + ARMS[arm]


def run_arms(args) -> int:
    from dflash_sglang.train.shards import list_shards

    # (`train --skip-prepare` would build a cache where it finds none: refuse here instead)
    if not list_shards(args.cache) or not list_shards(args.cache / "val"):
        raise SystemExit(f"--cache {args.cache}: needs shard_*.safetensors and val/shard_*.safetensors (build it with "
                         f"`dflash-sglang train --prepare-only --val-samples N`, see the docstring)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    procs = []
    for arm in args.arms:
        (args.out / arm).mkdir(parents=True, exist_ok=True)
        cmd = arm_command(args, arm)
        print("arm", arm, ":", " ".join(cmd), flush=True)
        log = (args.out / arm / "stdout.log").open("a")
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                             preexec_fn=(lambda: os.nice(args.nice)) if args.nice else None)
        procs.append((arm, p))
        if not args.parallel:
            p.wait()
    rcs = {arm: p.wait() for arm, p in procs}
    print("exit codes:", rcs, flush=True)
    return max(rcs.values(), default=0)


def held_out(run_dir: Path) -> dict[int, dict]:
    """step -> the held-out record of a run's train_log.jsonl (the last one written for that step)."""
    path = run_dir / "train_log.jsonl"
    if not path.exists():
        return {}
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {r["step"]: r["val"] for r in records if "val" in r and "loss" not in r}


def report(out: Path, arms: list[str]) -> dict:
    curves = {arm: held_out(out / arm) for arm in arms}
    steps = sorted(set().union(*(c.keys() for c in curves.values())))
    lines = ["| step | " + " | ".join(f"{a}: tau_est | {a}: top-1 k=1/2/3 | {a}: CE / KL" for a in arms) + " |",
             "|---|" + "---|---|---|" * len(arms)]
    for s in steps:
        cells = []
        for a in arms:
            v = curves[a].get(s)
            if v is None:
                cells += ["", "", ""]
                continue
            acc = " / ".join(f"{x:.3f}" for x in v["acc"][1:4])
            cells += [f"{v['tau_est']:.4f}", acc, f"{v['loss']:.3f} / {v.get('kl', float('nan')):.3f}"]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    print("\n".join(f"- {a}: {DESCRIPTIONS.get(a, ' '.join(ARMS.get(a, [])))}" for a in arms))
    print("(tau_est and top-1 compare across arms; CE / KL are weighted by each arm's own gamma, so they compare "
          "along an arm's rows only)")
    print("\n".join(lines))
    summary = {a: {"steps": sorted(c), "tau_est": [c[s]["tau_est"] for s in sorted(c)]} for a, c in curves.items()}
    print(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="one run directory per arm goes here")
    p.add_argument("--cache", type=Path, help="feature cache with shard_*.safetensors and val/")
    p.add_argument("--arms", default="A,B", help=f"comma-separated, of {sorted(ARMS)}")
    p.add_argument("--init", type=Path, default=Path("dflash_sglang/assets/smollm2_135m_dflash"))
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--val-every", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-anchors", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per arm (0: torch's default)")
    p.add_argument("--nice", type=int, default=19)
    p.add_argument("--device", default=None)
    p.add_argument("--no-parallel", dest="parallel", action="store_false", help="one arm after the other")
    p.add_argument("--report", action="store_true", help="print the held-out table of the arms in --out and exit")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        p.error(f"--arms: unknown {unknown}; known {sorted(ARMS)}")
    if args.report:
        report(args.out, args.arms)
        return 0
    if args.cache is None:
        p.error("--cache is required to run the arms")
    rc = run_arms(args)
    report(args.out, args.arms)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
