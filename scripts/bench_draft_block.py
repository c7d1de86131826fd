#!/usr/bin/env python3
"""What a drafter pass costs by block length: the layer stack over [bonus, MASK x (b-1)] and the head over its b-1
positions, at several batch sizes, with the embedded testbed pair (or --target / --draft) on this machine.

    python scripts/bench_draft_block.py --block-sizes 2,4,8,16 --batch-sizes 1,4,16 --context 300

Why: a chain of n < B rows drafts with a block of its own length (core/speculate.py `draft_block`); where the
pass's work grows with its rows (a CPU, large batches) that is cheaper than the whole block. Each request gets a
random prompt of --context tokens prefilled by the reference decoder (its captured features are the drafter's
context). Medians of --repeats timed calls after two warm-up calls; the last stdout line is JSON.

--dflash2 also times a DFlash2 draft derived from the draft (dflash_sglang/testbed/dflash2.py: the same layers inside
block convolutions, a candidate selector over the top --selector-top-k): its layers (convolutions included), head,
and the selector's walk over the block's positions (a greedy chain: the candidates' top-k, the pair terms, one argmax
per position), beside the DFlash draft's pass.
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
    p.add_argument("--dflash2", action="store_true", help="also a DFlash2 draft derived from the draft")
    p.add_argument("--selector-rank", type=int, default=256)
    p.add_argument("--selector-top-k", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("bench_draft_block"), help="--dflash2: the derived draft's folder")
    args = p.parse_args()

    import torch

    from dflash_sglang.core.reference import ReferenceDecoder
    from dflash_sglang.core.step.accept import SamplingParams
    from dflash_sglang.hf_pair import load_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.target is None:
        from dflash_sglang.testbed import default_pair

        args.target, args.draft = default_pair()
    target, _, drafter = load_pair(args.target, args.draft, "cpu")
    drafters = {"dflash": drafter}
    if args.dflash2:
        from dflash_sglang.core.draft.config import DFlash2Fields
        from dflash_sglang.testbed.dflash2 import derive_dflash2

        fields = DFlash2Fields(conv_kernel_size=2, conv_group_size=16, selector_rank=args.selector_rank,
                               selector_top_k=args.selector_top_k)
        out = derive_dflash2(args.draft, args.out / "dflash2", fields, dtype=drafter.fc.weight.dtype)
        drafters["dflash2"] = load_pair(args.target, out, "cpu")[2]

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
    for name, model in drafters.items():
        dec = ReferenceDecoder(target, model)
        gen = torch.Generator().manual_seed(0)  # (the same prompts for every draft)
        for bs in (int(x) for x in args.batch_sizes.split(",")):
            prompts = torch.randint(100, 5000, (bs, args.context), generator=gen).tolist()
            params = SamplingParams.full(bs, 0.0, 0, 1.0, 0.0, device=torch.device("cpu"))
            with torch.no_grad():
                batch, _ = dec._prefill(prompts, params, None, capture=True, pen=None)
                for b in (int(x) for x in args.block_sizes.split(",")):
                    rows.append(time_pass(dec, batch, b, name, median_ms))
                    r = rows[-1]
                    walk = f", selector walk {r['selector_ms']:7.2f} ms" if r["selector_ms"] is not None else ""
                    print(f"{name:8s} bs {bs:3d} block {b:2d}: layers {r['layers_ms']:7.2f} ms, head over {b - 1} "
                          f"positions {r['head_ms']:7.2f} ms{walk}", flush=True)
    print(json.dumps({"context": args.context, "threads": torch.get_num_threads(), "rows": rows}))
    return 0


def time_pass(dec, batch, b: int, name: str, median_ms) -> dict:
    """One draft's pass over a block of b rows at this batch: its layers, its head and (DFlash2) its selector walk."""
    import torch

    from dflash_sglang.core.draft.selector import SelectorScores
    from dflash_sglang.core.step.block import build_block_inputs

    inputs = build_block_inputs(batch.bonus, batch.seq_len, b, dec.cfg.mask_token_id)
    embeds = dec.embed(inputs.input_ids) * dec.cfg.input_embedding_scale

    def layers():
        return dec.drafter(embeds, inputs.positions, batch.ctx_kv, batch.pos, ctx_valid=batch.valid)

    hidden = layers()
    logits = dec.drafter.logits(hidden[:, 1:], dec.draft_head)
    head_ms = median_ms(lambda: dec.drafter.logits(hidden[:, 1:], dec.draft_head))
    selector, walk_ms = dec.drafter.candidate_selector, None
    if selector is not None:
        greedy = torch.zeros(len(batch.bonus))  # (all greedy, known on the host as the worker knows it)
        walk_ms = median_ms(lambda: SelectorScores.of(selector, hidden[:, 1:], logits, batch.bonus, greedy,
                                                      None, dec.token_map, any_sampled=False).walk(b - 1))
    return {"draft": name, "bs": len(batch.bonus), "block": b, "layers_ms": median_ms(layers), "head_ms": head_ms,
            "selector_ms": walk_ms}


if __name__ == "__main__":
    raise SystemExit(main())
