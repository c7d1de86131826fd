#!/usr/bin/env python3
"""Reduced draft vocabulary vs K: coverage, draft-pass cost and held-out tau estimate.

    python scripts/bench_draft_vocab.py --cache work_tmp/cpu_run/cache --val-cache work_tmp/cpu_run/cache/val \
        --ks 0,4096,8192,16384,32768 --threads 1

For every K (0: the full vocabulary) the map is the K most frequent response tokens of --cache (the
target-regenerated training responses, as `dflash-sglang train --draft-vocab K` builds it). Reported per K:
- coverage: the share of the held-out (--val-cache) response tokens inside the map (a token outside is never drafted);
- draft pass: the reference decoder's drafter pass (`ReferenceDecoder._draft`: block embedding, the drafter layers
  over the cached context, the head) per --batch-sizes, median of --repeats, after prefilling eval prompts; and the
  head (logits) alone;
- tau_est: the drafter's teacher-forced top-1 accuracy by block position on the held-out sequences (the numbers
  `train --val-samples` logs, misses outside the map included) -> 1 + sum_k prod_{j<=k} acc_j. The drafter is
  --draft as it is (trained on the full vocabulary): the map only removes candidates from its argmax.
fp32, no autocast. Last stdout line: JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_sglang.testbed import DRAFT_ASSET  # noqa: E402


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, oneDNN primitive cache)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=Path, default=DRAFT_ASSET)
    ap.add_argument("--target", type=Path, default=None, help="HF target dir (default: the SmolLM2 testbed target)")
    ap.add_argument("--cache", type=Path, required=True, help="training feature cache: the maps' token counts")
    ap.add_argument("--val-cache", type=Path, required=True, help="held-out feature cache: coverage and tau_est")
    ap.add_argument("--ks", default="0,4096,8192,16384,32768", help="draft vocabulary sizes (0: full)")
    ap.add_argument("--batch-sizes", default="1,8", help="requests per draft pass")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-tau", action="store_true", help="skip the teacher-forced tau estimate (the slow part)")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from dflash_sglang.core.draft.checkpoint import load_drafter
    from dflash_sglang.core.draft.token_map import build_token_map, token_counts
    from dflash_sglang.core.reference import ReferenceDecoder
    from dflash_sglang.core.step.accept import SamplingParams
    from dflash_sglang.testbed.data import eval_prompts
    from dflash_sglang.testbed.target import load_target
    from dflash_sglang.train.shards import load_cache
    from dflash_sglang.train.trainer import FrozenTarget, TrainConfig, Trainer
    from dflash_sglang.train.warm_start import load_init_weights

    target, tok = load_target(args.target)
    drafter = load_drafter(args.draft, dtype=torch.float32)
    cfg, vocab = drafter.cfg, drafter.cfg.vocab_size
    train_counts = token_counts((s.tokens[s.prompt_len:] for s in load_cache(args.cache)), vocab)
    val = load_cache(args.val_cache, cfg.target_layer_ids)
    val_counts = token_counts((s.tokens[s.prompt_len:] for s in val), vocab)
    bss = [int(b) for b in args.batch_sizes.split(",")]
    prompts = [p.ids for p in eval_prompts(tok, max(bss))]
    batches = {}
    with torch.no_grad():
        base = ReferenceDecoder(target, drafter)
        for bs in bss:
            batches[bs], _ = base._prefill(prompts[:bs], SamplingParams.full(bs), None, capture=True)
    rows = []
    for k in (int(x) for x in args.ks.split(",")):
        token_map = build_token_map(train_counts, k) if k else None
        drafter.token_map = token_map
        dec = ReferenceDecoder(target, drafter)
        row = {"k": k or vocab, "coverage": round(float(val_counts[token_map].sum() / val_counts.sum()), 4)
               if k else 1.0}
        with torch.no_grad():
            for bs in bss:
                batch = batches[bs]
                row[f"draft_ms_bs{bs}"] = round(_median_ms(lambda: dec._draft(batch, cfg.block_size), args.repeats), 2)
                hidden = torch.randn(bs, cfg.block_size - 1, cfg.hidden_size)
                head = _median_ms(lambda: drafter.logits(hidden, dec.draft_head), args.repeats)
                row[f"head_ms_bs{bs}"] = round(head, 2)
        if not args.no_tau:
            with tempfile.TemporaryDirectory() as out:
                trainer = Trainer(cfg, TrainConfig(bf16=False), FrozenTarget.from_model(target), val, Path(out),
                                  val_data=val, token_map=token_map)
                load_init_weights(trainer.model, args.draft)
                res = trainer.validate()
            row.update(tau_est=res["tau_est"], acc=res["acc"][1:6])
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(json.dumps({"script": "bench_draft_vocab", "draft": str(args.draft), "cache": str(args.cache),
                      "val_cache": str(args.val_cache), "threads": torch.get_num_threads(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
