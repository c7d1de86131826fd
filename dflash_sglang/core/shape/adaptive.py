"""Adaptive speculation shape: how many verify tokens each request gets, chosen from the running batch size.

At low concurrency decoding is memory-bound and a verify of 64 tokens costs about what a verify of 1 costs,
so a large tree (more accepted tokens per target pass) is free. At high concurrency the verify becomes
compute-bound and every extra token is paid for, so short chains win. The default table below encodes
that; deployments override it (the server flag `--speculative-dflash-adaptive-table`, `dflash-sglang generate
--adaptive-table`, or `AdaptivePolicy.parse`) after measuring.

Table syntax: comma-separated `MAX_BS:NODESxTOPK` rows, ascending by MAX_BS; the last MAX_BS may be `inf`.
`NODES` counts verify tokens per request including the root (the bonus token): a chain of block B is
`Bx1`. `1x1` means no drafting at all (plain decoding) for that batch size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..step.tree import max_tree_nodes

# Chosen for Hopper-class GPUs with small (<= 8B) targets, where a verify stays memory-bound up to roughly
# 256-512 tokens per step; re-derive with scripts/ when the hardware or model changes.
DEFAULT_TABLE = "1:64x4,4:32x2,8:16x2,32:16x1,64:8x1,inf:4x1"


@dataclass(frozen=True)
class SpecShape:
    nodes: int  # verify tokens per request, root included (chain: the block size)
    topk: int  # candidates per draft position (1 = chain)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def at_most(self, nodes: int) -> SpecShape:
        """This shape with at most `nodes` verify tokens (>= 1); a tree cut below 3 nodes is a chain."""
        assert nodes >= 1, nodes
        return self if nodes >= self.nodes else _shape(nodes, self.topk)


@dataclass(frozen=True)
class AdaptivePolicy:
    rows: tuple[tuple[float, SpecShape], ...]  # (max batch size, shape), ascending
    token_budget: int | None = None  # max verify tokens per step over the whole batch
    max_depth: int | None = None  # drafter block size - 1: deeper trees are impossible

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("adaptive table is empty")
        limits = [r[0] for r in self.rows]
        if limits != sorted(limits) or not math.isinf(limits[-1]):
            raise ValueError(f"adaptive table rows must ascend by batch size and end with 'inf': {limits}")
        for _, s in self.rows:
            if s.nodes < 1 or s.topk < 1 or (s.topk > 1 and s.nodes < 3):
                raise ValueError(f"bad adaptive shape {s.nodes}x{s.topk}")

    @classmethod
    def parse(cls, table: str, token_budget: int | None = None, max_depth: int | None = None) -> AdaptivePolicy:
        rows = []
        for item in table.split(","):
            try:
                bs, shape = item.strip().split(":")
                nodes, topk = shape.lower().split("x")
                rows.append((float(bs), SpecShape(int(nodes), int(topk))))
            except ValueError:
                raise ValueError(f"cannot parse row {item!r} (expected MAX_BS:NODESxTOPK)") from None
        return cls(tuple(rows), token_budget, max_depth)

    def row_shapes(self) -> tuple[SpecShape, ...]:
        """Each row's shape after the max_depth cap. Every `choose` result is one of these or has fewer nodes
        (the token budget only removes nodes), so their maxima bound a server's per-step reservation."""
        return tuple(self._depth_capped(s) for _, s in self.rows)

    def choose(self, batch_size: int) -> SpecShape:
        """The shape for a step with `batch_size` running requests; batch_size * nodes <= token_budget."""
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        shape = self._depth_capped(next(s for limit, s in self.rows if batch_size <= limit))
        nodes = shape.nodes
        if self.token_budget is not None:
            if batch_size > self.token_budget:
                raise ValueError(
                    f"token budget {self.token_budget} is smaller than the batch ({batch_size} requests need at "
                    f"least one verify token each); raise the budget or lower --max-running-requests"
                )
            nodes = min(nodes, self.token_budget // batch_size)
        return _shape(nodes, shape.topk)

    def _depth_capped(self, shape: SpecShape) -> SpecShape:
        if self.max_depth is None:
            return shape
        # a drafter block of B drafts at most B-1 levels
        limit = self.max_depth + 1 if shape.is_chain else max_tree_nodes(self.max_depth, shape.topk)
        return _shape(min(shape.nodes, limit), shape.topk)


def _shape(nodes: int, topk: int) -> SpecShape:
    return SpecShape(nodes, topk if nodes >= 3 else 1)  # a 2-node tree is a chain of one draft
