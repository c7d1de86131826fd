"""Host-dispatched op count of one drafter pass and one draft-KV commit of our SGLang worker, eager and with
draft graphs (adapter/draft/model.py, adapter/draft/graphs.py).

What: the aten ops PyTorch dispatches for `PagedDrafter.draft` (block B, context --context tokens per request)
and for `PagedDrafter.commit` of bs*B verify rows, at each --batch-sizes value, with the drafter of --draft
(default: the shipped SmolLM2 drafter), on the CPU with the torch attention backend; then the ops the same two
steps still dispatch eagerly when `DraftGraphs` replays them (layout, padding, copies into the static buffers),
which on a GPU come with one graph replay each (the graph's own ops are not host launches).
Why: each eager op is a host launch costing roughly 5-10 us every decode step from Python on a GPU host. The
builtin DFLASH replays its draft as one graph. View ops (transpose, slice, ...) are counted too: they cost
dispatch time but no kernel. With the FlashInfer backend, each layer's attention is one run() instead of the
reference's per-request loop, so the eager counts at bs > 1 overstate the GPU path; FlashInfer's plan adds its
host-to-device copies of the index arrays to both paths.
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
from dflash_sglang.adapter.draft.graphs import DraftGraphs  # noqa: E402
from dflash_sglang.adapter.draft.model import PagedDrafter, TargetHead  # noqa: E402
from dflash_sglang.core.draft.config import DraftConfig  # noqa: E402

DEFAULT_DRAFT = Path(__file__).resolve().parents[1] / "dflash_sglang/assets/smollm2_135m_dflash"


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count(draft: Path, bs: int, context: int) -> dict[str, OpCounter]:
    """Ops of one draft pass and one commit of bs*B rows for `bs` requests with `context` committed tokens: eager
    ("draft", "commit") and what stays eager around the graph replays ("graph_draft", "graph_commit")."""
    cfg = DraftConfig.load(draft)
    block = cfg.block_size
    width = context + block
    drafter = PagedDrafter.load(draft, 1 + bs * width, bs, block, torch.float32, "cpu", dummy=True)
    req_to_token = 1 + torch.arange(bs * width, dtype=torch.int32).view(bs, width)  # slot 0: SGLang's padding
    seq_lens, features = torch.full((bs,), context), cfg.hidden_size * len(cfg.target_layer_ids)
    drafter.commit(torch.randn(bs * context, features), torch.arange(context).repeat(bs),
                   req_to_token[:, :context].reshape(-1).long())
    positions = seq_lens[:, None] + torch.arange(block)
    counters = {name: OpCounter() for name in ("draft", "commit", "graph_draft", "graph_commit")}
    with counters["draft"]:
        drafter.draft(torch.randn(bs, block, cfg.hidden_size), positions, req_to_token, torch.arange(bs), seq_lens,
                      seq_lens.clone())
    commit_rows = (torch.randn(bs * block, features), positions.reshape(-1),
                   req_to_token[:, context:].reshape(-1).long())
    with counters["commit"]:
        drafter.commit(*commit_rows)
    head = TargetHead(torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size),
                      cfg.mask_token_id)
    graphs = DraftGraphs(drafter, head, req_to_token, [bs], [block], features, torch.float32, capture=False)
    args = (torch.zeros(bs, dtype=torch.int64), seq_lens, seq_lens.clone(), torch.arange(bs))
    graphs(*args)  # a first replay sets the static output
    graphs._replay = lambda *a, **k: None  # count only what runs around the replays
    with counters["graph_draft"]:
        graphs(*args)
    with counters["graph_commit"]:
        graphs.commit(*commit_rows, bs=bs, nodes=block)
    return counters


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--context", type=int, default=100)
    args = ap.parse_args(argv)
    print(f"drafter {args.draft} (dummy weights of its config), context {args.context}, torch attention backend")
    print(f"{'bs':>4} {'draft ops':>10} {'commit ops':>11} {'with graphs':>12} {'':>7}  "
          "most frequent in the draft pass")
    print(f"{'':>4} {'(eager)':>10} {'(eager)':>11} {'draft':>12} {'commit':>7}")
    rows = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        counters = count(args.draft, bs, args.context)
        c = {name: sum(counter.ops.values()) for name, counter in counters.items()}
        rows.append({"bs": bs, "draft_ops": c["draft"], "commit_ops": c["commit"],
                     "graph_draft_ops": c["graph_draft"], "graph_commit_ops": c["graph_commit"]})
        top = ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in counters["draft"].ops.most_common(4))
        print(f"{bs:>4} {c['draft']:>10} {c['commit']:>11} {c['graph_draft']:>12} {c['graph_commit']:>7}  {top}")
    print("with graphs: ops dispatched around the replays, plus one replay each")
    print(json.dumps({"script": "count_draft_ops", "draft": str(args.draft), "context": args.context, "rows": rows}))


if __name__ == "__main__":
    main()
