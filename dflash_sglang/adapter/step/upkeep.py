"""The drafter's upkeep of plain steps, deferred: a plain step's draft K/V written when the drafter next needs them.

A plain step (one verify row, no drafter pass; what the goodput controller runs wherever drafting does not pay)
still produces the target features the drafter will read as context K/V at its next pass. Writing them at every step
(fc + hidden_norm, then each draft layer's k/v projections, norm and RoPE, and the pool scatter: dozens of small ops)
is upkeep a plain decoding step does not pay. So a plain step only keeps its features, positions and pool rows, and
the next step that needs the pool writes them all in one commit (`take`):
- before a drafted step's pass reads the pool;
- before a step over other requests than the pending ones' (a request finished or joined: its slots may be freed
  and given to new tokens, whose rows must be written after the old ones), before a prefill (a prompt may reuse a
  finished request's cached prefix and slots) and before an idle step;
- when the pending steps reach `max_steps` or `max_bytes` (the features of a large batch are large).
The values written are the same per token as one commit per step (every op of a commit is per token), so acceptance
after the catch-up is what it would have been; greedy and sampled outputs are lossless either way (the verify decides).

Not deferred where something outside the worker reads the pool between steps: HiCache backs up a finished request's
draft rows asynchronously and a PD decode server backs up a retracted request's rows (`enabled` False there: every
step commits, as before). A draft window's ring (R rows per request, position p at row p % R of its ring) defers at
most R steps (`upkeep_steps`): one request's pending rows are then distinct, and one scatter writes what R commits
in order would (more would write one row twice in one scatter, in no defined order)."""
from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

MAX_STEPS = 16  # plain steps kept pending at most (each is one commit's fixed cost saved)
MAX_BYTES = 64 << 20  # pending features at most (bs x F per step: a large batch flushes sooner)
DEFER_ENV = "DFLASH_DEFER_PLAIN_UPKEEP"


def upkeep_steps(ring: int | None) -> int:
    """Plain steps kept pending at most: `MAX_STEPS`, and no more than a draft window's ring rows per request."""
    return MAX_STEPS if ring is None else min(MAX_STEPS, ring)


@dataclass
class PlainUpkeep:
    """Pending plain steps of one decode batch (`key`: its requests, in order) and when they must be written."""

    enabled: bool
    max_steps: int = MAX_STEPS
    max_bytes: int = MAX_BYTES
    _pending: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)  # (features [bs, F], positions
    # [bs] int64, pool rows [bs] int64) per plain step
    _key: Hashable | None = None
    _bytes: int = 0

    @property
    def steps(self) -> int:
        return len(self._pending)

    def due(self, key: Hashable, drafted: bool) -> bool:
        """Whether the pending steps must be written before this decode step (a drafted one, or another batch)."""
        return bool(self._pending) and (drafted or key != self._key)

    def defer(self, key: Hashable, features: Tensor, positions: Tensor, rows: Tensor, copy: bool = False) -> bool:
        """Keep a plain step's features [bs, F], positions [bs] and pool rows [bs] of the batch `key` (copy: the
        features live in a buffer the next step overwrites, a replayed CUDA graph's output). Returns whether the
        pending steps reached a cap and must be written now."""
        assert self.enabled and (not self._pending or key == self._key), "written before another batch's steps"
        self._pending.append((features.clone() if copy else features, positions, rows))
        self._key = key
        self._bytes += features.numel() * features.element_size()
        return len(self._pending) >= self.max_steps or self._bytes >= self.max_bytes

    def take(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """The pending steps as one commit's (features [T, F], positions [T], rows [T]), step after step (T = the
        pending steps' rows), or None; nothing is pending afterwards."""
        if not self._pending:
            return None
        features, positions, rows = (torch.cat(parts) for parts in zip(*self._pending))
        self._pending, self._key, self._bytes = [], None, 0
        return features, positions, rows


class DraftCommit:
    """Every step's draft K/V written at once: a commit graph's replay where one was captured, else eagerly."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.graphs = None  # the draft graphs, set by the worker's init_cuda_graphs where they run

    def before(self, key: Hashable, drafted: bool) -> None:
        """Before a decode step over the requests `key` (drafted: it runs a drafter pass)."""

    def catch_up(self) -> None:
        """Before a prefill or an idle step: the pending rows written."""

    def step(self, key: Hashable, rows: tuple[Tensor, Tensor, Tensor], bs: int, nodes: int, copy: bool) -> None:
        """A decode step's verify rows (features [bs*n, F], positions [bs*n], pool rows [bs*n]; n = nodes) written.
        copy: the features live in a replayed verify graph's output buffer."""
        if self.graphs is None or not self.graphs.commit(*rows, bs=bs, nodes=nodes):
            self.drafter.commit(*rows)


class DeferredPlainCommit(DraftCommit):
    """Plain steps' rows kept pending and written in one commit when the drafter next needs them."""

    def __init__(self, drafter, max_steps: int) -> None:
        super().__init__(drafter)
        self.pending = PlainUpkeep(enabled=True, max_steps=max_steps)

    def before(self, key: Hashable, drafted: bool) -> None:
        if self.pending.due(key, drafted):
            self.catch_up()  # before the drafter reads the pool, or another batch writes its rows

    def catch_up(self) -> None:
        pending = self.pending.take()
        if pending is not None:
            self.drafter.commit(*pending)

    def step(self, key: Hashable, rows: tuple[Tensor, Tensor, Tensor], bs: int, nodes: int, copy: bool) -> None:
        if nodes > 1:
            super().step(key, rows, bs, nodes, copy)
        elif self.pending.defer(key, *rows, copy=copy):
            self.catch_up()


def draft_commit(drafter, settings, server_args, ring: int | None) -> DraftCommit:
    """The worker's policy, picked once: deferred unless HiCache or a PD decode server's retraction backup reads the
    pool between steps, or `DEFER_ENV` is 0 (a switch for before/after timings, not a serving setting); a window's
    ring (`ring` rows per request) defers at most that many steps."""
    if (os.environ.get(DEFER_ENV, "1").strip() == "0" or getattr(server_args, "enable_hierarchical_cache", False)
            or settings.disaggregation == "decode"):
        return DraftCommit(drafter)
    return DeferredPlainCommit(drafter, upkeep_steps(ring))
