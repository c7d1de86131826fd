"""Eager op count of one drafter pass and one draft-KV commit of our SGLang worker (adapter/model.py).

What: the aten ops PyTorch dispatches for `PagedDrafter.draft` (block B, context --context tokens per request)
and for `PagedDrafter.commit` of bs*B verify rows, at each --batch-sizes value, with the drafter of --draft
(default: the shipped SmolLM2 drafter), on the CPU with the torch attention backend.
Why: our draft step is not CUDA-graph captured, so each op is an eager launch costing host time every decode
step (roughly 5-10 us each from Python on a GPU host), while the builtin DFLASH replays one graph. The count is
the size of that overhead and what a captured draft step removes. View ops (transpose, slice, ...) are counted
too: they cost dispatch time but no kernel. With the FlashInfer backend, each layer's attention is one run()
instead of the reference's per-request loop, so the counts at bs > 1 overstate the GPU path.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash_sglang.adapter.model import PagedDrafter  # noqa: E402  (imports no sglang)
from dflash_sglang.core.config import DraftConfig  # noqa: E402

DEFAULT_DRAFT = Path(__file__).resolve().parents[1] / "dflash_sglang/assets/smollm2_135m_dflash"


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count(draft: Path, bs: int, context: int) -> tuple[OpCounter, OpCounter]:
    """(ops of one draft pass, ops of one commit of bs*B rows) for `bs` requests with `context` committed tokens."""
    cfg = DraftConfig.load(draft)
    block = cfg.block_size
    width = context + block
    drafter = PagedDrafter.load(draft, bs * width, bs, block, torch.float32, "cpu", dummy=True)
    req_to_token = torch.arange(bs * width, dtype=torch.int32).view(bs, width)
    seq_lens, features = torch.full((bs,), context), cfg.hidden_size * len(cfg.target_layer_ids)
    drafter.commit(torch.randn(bs * context, features), torch.arange(context).repeat(bs),
                   req_to_token[:, :context].reshape(-1).long())
    positions = seq_lens[:, None] + torch.arange(block)
    with OpCounter() as draft_ops:
        drafter.draft(torch.randn(bs, block, cfg.hidden_size), positions, req_to_token, torch.arange(bs), seq_lens,
                      seq_lens.clone())
    with OpCounter() as commit_ops:
        drafter.commit(torch.randn(bs * block, features), positions.reshape(-1),
                       req_to_token[:, context:].reshape(-1).long())
    return draft_ops, commit_ops


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=100)
    args = ap.parse_args(argv)
    print(f"drafter {args.draft} (dummy weights of its config), context {args.context}, torch attention backend")
    print(f"{'bs':>4} {'draft ops':>10} {'commit ops':>11}  most frequent in the draft pass")
    rows = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        draft_ops, commit_ops = count(args.draft, bs, args.context)
        rows.append({"bs": bs, "draft_ops": sum(draft_ops.ops.values()), "commit_ops": sum(commit_ops.ops.values())})
        top = ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in draft_ops.ops.most_common(4))
        print(f"{bs:>4} {rows[-1]['draft_ops']:>10} {rows[-1]['commit_ops']:>11}  {top}")
    print(json.dumps({"script": "count_draft_ops", "draft": str(args.draft), "context": args.context, "rows": rows}))


if __name__ == "__main__":
    main()
