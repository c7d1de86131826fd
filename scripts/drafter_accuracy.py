#!/usr/bin/env python3
"""Teacher-forced top-1 accuracy of a drafter by block position, on train- or eval-split prompts.

    python scripts/drafter_accuracy.py --split train --num-prompts 16          # the shipped drafter's own prompts
    python scripts/drafter_accuracy.py --split eval --num-prompts 16

What: the target greedily regenerates the responses of --num-prompts prompts of --split (starting at --first in the
split's fixed order; the shipped drafter trained on the first 6144 train prompts), then the drafter drafts a block
at every response position (up to 256 per sequence) and we count, per block position k, how often its top-1 is
the target's token: exactly the held-out numbers `dflash-sglang train --val-samples` logs (Trainer.validate).
Why: a training run's own per-step accuracy is measured on sequences it has seen for several epochs; comparing
train and eval prompts here tells memorisation from what the drafter generalises. fp32, no autocast.
Last stdout line: JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_sglang.core.draft.config import DraftConfig  # noqa: E402
from dflash_sglang.testbed import DRAFT_ASSET  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=Path, default=DRAFT_ASSET)
    ap.add_argument("--target", type=Path, default=None, help="HF target dir (default: the SmolLM2 testbed target)")
    ap.add_argument("--split", choices=("train", "eval"), default="eval")
    ap.add_argument("--first", type=int, default=0, help="skip this many prompts of the split")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8, help="prompts regenerated together")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from dflash_sglang.testbed.data import load_split, make_prompts
    from dflash_sglang.testbed.target import load_target
    from dflash_sglang.train.prepare import generate_with_features
    from dflash_sglang.train.trainer import FrozenTarget, TrainConfig, Trainer
    from dflash_sglang.train.warm_start import load_init_weights

    cfg = DraftConfig.load(args.draft)
    target, tok = load_target(args.target)
    prompts = make_prompts(load_split(args.split), tok, args.first + args.num_prompts)[args.first :]
    seqs = []
    for i in range(0, len(prompts), args.batch_size):
        batch = [p.ids for p in prompts[i : i + args.batch_size]]
        seqs += generate_with_features(target, batch, cfg.target_layer_ids, args.max_new_tokens, tok.eos_token_id)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, TrainConfig(bf16=False), FrozenTarget.from_model(target), seqs, Path(out),
                          val_data=seqs)
        load_init_weights(trainer.model, args.draft)
        val = trainer.validate()
    print(f"{args.draft.name}: {args.split} prompts {args.first}..{args.first + len(prompts) - 1}, "
          f"{val['labels']} labelled rows, held-out loss {val['loss']:.3f}, tau_est {val['tau_est']:.3f}")
    print("position " + " ".join(f"{k:>5d}" for k in range(1, cfg.block_size)))
    print("top-1    " + " ".join(f"{a:5.3f}" for a in val["acc"][1:]))
    print(json.dumps({"script": "drafter_accuracy", "draft": str(args.draft), "split": args.split,
                      "first": args.first, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, **val}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
