"""Which draft pool rows hold a request's context K/V: one per target KV slot, or a bounded ring per request.

`SlotRows` (the default, and a draft window's layout wherever the ring cannot serve): pool row i is target KV slot i.
A committed token's draft K/V go to its target slot and the drafter reads them through SGLang's `req_to_token`, so
radix-cache hits, PD transfer, HiCache and trees need no bookkeeping of their own; the pool grows with the target's
token capacity. Under `--speculative-draft-window-size W` a pass reads only the slots of the last W positions
(core/draft/drafter.py `context_window`): the rows stay, only the reads are bounded.

`WindowRows` (`--speculative-draft-window-size W` with the radix cache off): the drafter reads only the last W context
positions, so each request-pool slot r owns a ring of R = W + N - 1 rows and position p lives at row
r*R + p % R (N: the most verify rows a step commits). Why R: a decode step writes every verify row (positions
L .. L+n-1, n <= N, rejected ones included), overwriting positions p - R; the next step, at a committed length
L' >= L+1, reads L'-W .. L'-1, and L+n-1-R < L+1-W holds for R >= W + n - 1. A position is rewritten by the step that
commits it before any pass reads it, and a pass at length L reads only positions this request committed (< L), so a
ring reused by a new request is never read stale. The pool costs req_slots x R rows, whatever the context length; a
cached prefix's rows are not kept (the next request in the slot overwrites them), hence the radix cache off.

Both give the same things (`ContextRows`): the pass's key lengths and key rows (`key_lens` on the host, `key_rows` on
the device: one kernel, `ops.draft_kv_indices`, in its slot-row or ring-aware form, so the draft graphs capture
either), the eager pass's layout from them (`layout`), and the rows a prefill's and a decode step's commits write
(`prefill`, `decode`), so the worker's step and the graphs call one interface either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from dflash_sglang import ops

from .attention import DraftLayout, host_indptrs
from .pool import new_pool


class ContextRows(Protocol):
    """Where a draft pool keeps context K/V (rows [0, rows); the block scratch rows follow)."""

    rows: int
    window: int | None  # W: the context positions a pass reads (None: all of them)

    def key_lens(self, seq_lens_cpu: Tensor) -> Tensor:
        """[bs] committed lengths (host) -> [bs] int64 context keys a pass reads (min(L, W), or L)."""
        ...

    def key_rows(self, kv_indptr: Tensor, req_pool_indices: Tensor, seq_lens: Tensor, req_to_token: Tensor,
                 scratch_base: int, block: int, out: Tensor) -> Tensor:
        """The pass's key rows into out [capacity] int32 on the device: request i's context rows (its last `key_lens`
        positions, in position order), then its block scratch rows (scratch_base + r*block + j); from kv_indptr [bs+1]
        int32 (device, over `key_lens`), req_pool_indices / seq_lens [bs] (device). `ops.draft_kv_indices`: one kernel
        on CUDA, no host read (the draft graphs capture it)."""
        ...

    def layout(self, req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor,
               block: int, scratch_base: int) -> DraftLayout:
        """The eager pass's layout: the ragged sizes from `key_lens` of the host lengths, the key rows by `key_rows`.
        seq_lens [bs] on the device, seq_lens_cpu its host mirror."""
        ...

    def prefill(self, positions: Tensor, out_cache_loc: Tensor, req_pool_indices: Tensor,
                extend_lens: list[int]) -> tuple[Tensor | None, Tensor]:
        """An extend batch's commit: positions / out_cache_loc [T] of its tokens (request after request, extend_lens
        each), req_pool_indices [bs] -> (indices [M] int64 of the tokens to write, None: all T; their pool rows [M])."""
        ...

    def decode(self, positions: Tensor, slots: Tensor, req_pool_indices: Tensor) -> Tensor:
        """A decode step's commit: positions / slots [bs, n] of every verify row, req_pool_indices [bs] -> pool rows
        [bs*n] int64."""
        ...

    def describe(self) -> str:
        """The layout in words, for the start-up line."""
        ...


class _Layout:
    """`ContextRows.layout` from the rows' own `key_lens` and `key_rows` (one body for both layouts)."""

    def layout(self, req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor,
               block: int, scratch_base: int) -> DraftLayout:
        device = req_pool_indices.device
        qo_indptr, kv_indptr = host_indptrs(self.key_lens(seq_lens_cpu), block)
        out = torch.empty(int(kv_indptr[-1]), dtype=torch.int32, device=device)
        self.key_rows(kv_indptr.to(device, non_blocking=True), req_pool_indices, seq_lens.to(device), req_to_token,
                      scratch_base, block, out)
        return DraftLayout(qo_indptr, kv_indptr, out)


@dataclass(frozen=True)
class SlotRows(_Layout):
    """One pool row per target KV slot (rows = the target pool's slots, padding slot included); a pass reads the
    slots of the last `window` positions (None: the whole context)."""

    rows: int
    window: int | None = None

    def __post_init__(self) -> None:
        assert self.window is None or self.window >= 1, self

    def key_lens(self, seq_lens_cpu: Tensor) -> Tensor:
        lens = seq_lens_cpu.to(torch.int64)
        return lens if self.window is None else lens.clamp(max=self.window)

    def key_rows(self, kv_indptr: Tensor, req_pool_indices: Tensor, seq_lens: Tensor, req_to_token: Tensor,
                 scratch_base: int, block: int, out: Tensor) -> Tensor:
        """The slots of the context positions through req_to_token; under a window each request's keys start at
        position L - min(L, W) (seq_lens read on the device)."""
        return ops.draft_kv_indices(kv_indptr, req_pool_indices, req_to_token, scratch_base, block, out=out,
                                    seq_lens=None if self.window is None else seq_lens)

    def prefill(self, positions: Tensor, out_cache_loc: Tensor, req_pool_indices: Tensor,
                extend_lens: list[int]) -> tuple[Tensor | None, Tensor]:
        # every token: a later request's radix hit may end anywhere in this prompt and read the W positions before it
        return None, out_cache_loc

    def decode(self, positions: Tensor, slots: Tensor, req_pool_indices: Tensor) -> Tensor:
        return slots.reshape(-1)

    def describe(self) -> str:
        if self.window is None:
            return "context rows at the target KV slots"
        return f"draft window {self.window} over context rows at the target KV slots"


@dataclass(frozen=True)
class WindowRows(_Layout):
    """A ring of `ring` rows per request-pool slot for the last `window` context positions (module docstring)."""

    window: int  # W: context positions a pass reads (--speculative-draft-window-size)
    ring: int  # R >= W + N - 1 rows per request-pool slot (`ring_size`)
    req_slots: int  # request-pool slots the rings serve (SGLang's req_to_token rows)

    def __post_init__(self) -> None:
        assert 1 <= self.window < self.ring and self.req_slots >= 1, self

    @property
    def rows(self) -> int:
        return self.req_slots * self.ring

    def ring_rows(self, req_pool_indices: Tensor, positions: Tensor) -> Tensor:
        """Request-pool slots and positions (broadcastable, device) -> int64 pool rows r*R + p % R."""
        return req_pool_indices.to(torch.int64) * self.ring + positions.to(torch.int64).remainder(self.ring)

    def key_lens(self, seq_lens_cpu: Tensor) -> Tensor:
        """[bs] committed lengths (host) -> [bs] int64 context rows a pass reads: min(L, W)."""
        return seq_lens_cpu.to(torch.int64).clamp(max=self.window)

    def key_rows(self, kv_indptr: Tensor, req_pool_indices: Tensor, seq_lens: Tensor, req_to_token: Tensor,
                 scratch_base: int, block: int, out: Tensor) -> Tensor:
        """Request i at committed length L reads the ring rows r*R + p % R of positions L-k .. L-1 (k = min(L, W)):
        the ring-aware form of the same kernel (no table read; seq_lens on the device)."""
        return ops.draft_kv_indices(kv_indptr, req_pool_indices, None, scratch_base, block, out=out,
                                    seq_lens=seq_lens, ring=self.ring)

    def prefill(self, positions: Tensor, out_cache_loc: Tensor, req_pool_indices: Tensor,
                extend_lens: list[int]) -> tuple[Tensor | None, Tensor]:
        """Only each request's last R extended tokens are written: earlier ones would land on the same ring rows
        (a scatter with repeated indices keeps an unspecified one), and no later pass reads them."""
        device = positions.device
        lens = torch.tensor(extend_lens, dtype=torch.int64)
        starts = torch.cumsum(lens, 0) - lens
        kept = lens.clamp(max=self.ring)
        owner = torch.repeat_interleave(torch.arange(lens.numel()), kept)
        index = (starts + lens - kept)[owner] + torch.arange(int(kept.sum())) - (torch.cumsum(kept, 0) - kept)[owner]
        slot = req_pool_indices.to(torch.int64)[owner.to(device)]
        if int(kept.sum()) == positions.numel():
            return None, self.ring_rows(slot, positions)
        index = index.to(device)
        return index, self.ring_rows(slot, positions[index])

    def decode(self, positions: Tensor, slots: Tensor, req_pool_indices: Tensor) -> Tensor:
        assert positions.shape[1] <= self.ring - self.window + 1, "a step verifies at most N rows (R >= W + N - 1)"
        return self.ring_rows(req_pool_indices.to(positions.device)[:, None], positions).reshape(-1)

    def describe(self) -> str:
        return f"draft window {self.window} in a ring of {self.ring} rows per request slot"


def ring_size(window: int, max_nodes: int) -> int:
    """R for window W and at most N = max_nodes (>= 2) verify rows a step commits (module docstring)."""
    assert max_nodes >= 2, max_nodes
    return window + max_nodes - 1


@dataclass(frozen=True)
class WindowPool:
    """A draft window's rings and the pool holding them, allocated when the worker is built (before SGLang sizes its
    KV pools, so that its measurement counts them: adapter/draft/memory.py)."""

    rows: WindowRows
    pool: object  # adapter/draft/model.py DraftKVPool: req_slots x R ring rows, then the block scratch

    @classmethod
    def allocate(cls, settings, weights, dtype: torch.dtype, device) -> WindowPool | None:
        """settings: the resolved DFlashSettings (None unless --speculative-draft-window-size is served by the ring);
        weights: the drafter. Request slots: --max-running-requests + 1, the req_to_token rows SGLang allocates for it
        (the resolution declares a cap with the ring)."""
        if settings.draft_window is None or settings.draft_memory.ring == 0:
            return None
        assert settings.max_running_requests is not None, "declared with the ring (adapter/boot/resolve.py)"
        req_slots = settings.max_running_requests + 1
        rows = WindowRows(settings.draft_window, settings.draft_memory.ring, req_slots)
        pool = new_pool(weights.cfg, rows.rows, req_slots, settings.block_size, dtype, device, settings.draft_kv_dtype)
        return cls(rows, pool)

    def serving(self, req_slots: int) -> tuple[WindowRows, object]:
        """(context rows, pool) for SGLang's request pool of req_slots rows; a table larger than the rings were
        allocated for is an error at start-up (it would index past them)."""
        if req_slots > self.rows.req_slots:
            raise RuntimeError(f"--speculative-draft-window-size: SGLang allocated {req_slots} request slots, the "
                               f"draft window's rings were allocated for {self.rows.req_slots} (--max-running-requests "
                               f"+ 1); set --max-running-requests")
        return self.rows, self.pool
