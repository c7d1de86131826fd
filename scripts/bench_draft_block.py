#!/usr/bin/env python3
"""What a drafter pass costs by block length: the layer stack over [bonus, MASK x (b-1)] and the head over its b-1
positions, at several batch sizes, with the embedded testbed pair (or --target / --draft) on this machine.

    python scripts/bench_draft_block.py --block-sizes 2,4,8,16 --batch-sizes 1,4,16 --context 300

Why: a chain of n < B rows drafts with a block of its own length (core/speculate.py `draft_block`); where the
pass's work grows with its rows (a CPU, large batches) that is cheaper than the whole block. Each request gets a
random prompt of --context tokens prefilled by the reference decoder (its captured features are the drafter's
context). Medians of --repeats timed calls after two warm-up calls; the last stdout line is JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--block-sizes", default="2,4,8,16")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--context", type=int, default=300, help="prompt tokens per request")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--target", type=Path)
    p.add_argument("--draft", type=Path)
    args = p.parse_args()

    import torch

    from dflash_sglang.cli import load_pair
    from dflash_sglang.core.accept import SamplingParams
    from dflash_sglang.core.block import build_block_inputs
    from dflash_sglang.core.reference import ReferenceDecoder

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target is None:
        from dflash_sglang.testbed import default_pair

        args.target, args.draft = default_pair()
    target, _, drafter = load_pair(args.target, args.draft, "cpu")
    dec = ReferenceDecoder(target, drafter)
    gen = torch.Generator().manual_seed(0)

    def median_ms(fn) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return round(1e3 * statistics.median(times), 2)

    rows = []
    for bs in (int(x) for x in args.batch_sizes.split(",")):
        prompts = torch.randint(100, 5000, (bs, args.context), generator=gen).tolist()
        params = SamplingParams.full(bs, 0.0, 0, 1.0, 0.0, device=torch.device("cpu"))
        with torch.no_grad():
            batch, _ = dec._prefill(prompts, params, None, capture=True, pen=None)
            for b in (int(x) for x in args.block_sizes.split(",")):
                inputs = build_block_inputs(batch.bonus, batch.seq_len, b, dec.cfg.mask_token_id)
                embeds = dec.embed(inputs.input_ids) * dec.cfg.input_embedding_scale

                def layers(inputs=inputs, embeds=embeds):
                    return dec.drafter(embeds, inputs.positions, batch.ctx_kv, batch.pos, ctx_valid=batch.valid)

                hidden = layers()
                head_ms = median_ms(lambda hidden=hidden: dec.drafter.logits(hidden[:, 1:], dec.draft_head))
                rows.append({"bs": bs, "block": b, "layers_ms": median_ms(layers), "head_ms": head_ms})
                print(f"bs {bs:3d} block {b:2d}: layers {rows[-1]['layers_ms']:7.2f} ms, head over {b - 1} positions "
                      f"{head_ms:7.2f} ms", flush=True)
    print(json.dumps({"context": args.context, "threads": torch.get_num_threads(), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
