"""PD decode retraction with `--disaggregation-decode-retraction-backup cpu_tensor`: our draft rows go to host memory
and come back with the target's KV, so a restored request drafts as if it had never been retracted.

What SGLang does (0.5.23, `mem_cache/common.py` `backup_kv_cache` / `restore_kv_cache`, from `ScheduleBatch.
retract_decode` and the decode server's resume of retracted requests): with the `cpu_tensor` backend,
`Req.offload_kv_cache` copies the target KV of the request's committed slots (req_to_token[row, :seqlen - 1]) to host
tensors, and the slots are freed; on resume `Req.load_kv_cache` loads the copy into the slots newly allocated for the
request (the same req_to_token expression, now naming the new slots). Our draft pool keeps one row per target KV slot
(adapter/draft/context_rows.py `SlotRows`, which PD always serves), so without a copy of its own a resumed request would
draft from whatever its new slots' rows held: still lossless (the verify decides), but its drafts mostly rejected until
its context is rewritten. The hooks copy the same slots' draft rows beside the target's: AROUND `Req.offload_kv_cache`
(after it: the rows to host, kept on the request) and `Req.load_kv_cache` (after it: the rows written at the new slots).
SGLang's other backend, `host_pool` (its default on a decode server where it applies), moves the draft rows with the
target's through the HiCache draft plan (adapter/scale/hicache.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..draft.pool import DraftKVPool
from ..versions import req_pool_index

OFFLOAD = "sglang.srt.managers.schedule_batch.Req.offload_kv_cache"
LOAD = "sglang.srt.managers.schedule_batch.Req.load_kv_cache"
BACKUP = "_dflash_draft_backup"  # the request's attribute holding its DraftBackup while it is retracted


@dataclass(frozen=True)
class DraftBackup:
    """A retracted request's draft rows on the host, as stored (fp8 pools: their bytes' values, unconverted)."""

    k: Tensor  # [layers, n, kv_heads, head_dim]
    v: Tensor


@dataclass(frozen=True)
class DraftRetraction:
    """The decode server's draft pool, backed up and restored with the target's KV (module docstring)."""

    pool: DraftKVPool

    def backup(self, slots: Tensor) -> DraftBackup:
        """slots [n] int of the request's committed tokens -> their draft rows on the host (a synchronous copy: SGLang
        frees the slots once the backup returns)."""
        rows = slots.to(self.pool.k.device, torch.int64)
        return DraftBackup(self.pool.k[:, rows].to("cpu"), self.pool.v[:, rows].to("cpu"))

    def restore(self, backup: DraftBackup, slots: Tensor) -> None:
        """The backed-up rows written at slots [n] int, the request's newly allocated ones, in the same order."""
        rows = slots.to(self.pool.k.device, torch.int64)
        assert backup.k.shape[1] == rows.numel(), (backup.k.shape, rows.numel())
        self.pool.k[:, rows] = backup.k.to(self.pool.k.device)
        self.pool.v[:, rows] = backup.v.to(self.pool.v.device)


_retraction: DraftRetraction | None = None  # this decode server's (one worker per process)


def watch_retractions(pool: DraftKVPool) -> None:
    """Decode side: back up and restore this pool's rows with every retracted request's KV (the worker calls this
    when it builds its pool on a PD decode server)."""
    global _retraction
    _retraction = DraftRetraction(pool)


def committed_slots(req, req_to_token_pool) -> Tensor:
    """[seqlen - 1] the request's committed KV slots, as SGLang's offload and load read them."""
    return req_to_token_pool.req_to_token[req_pool_index(req), : req.seqlen - 1]


def offload_hook(original, req, req_to_token_pool, *args, **kwargs):
    """AROUND `Req.offload_kv_cache(req_to_token_pool, token_to_kv_pool_allocator)`: the draft rows to host too."""
    out = original(req, req_to_token_pool, *args, **kwargs)
    if _retraction is not None:
        setattr(req, BACKUP, _retraction.backup(committed_slots(req, req_to_token_pool)))
    return out


def load_hook(original, req, req_to_token_pool, *args, **kwargs):
    """AROUND `Req.load_kv_cache(req_to_token_pool, token_to_kv_pool_allocator)`: the draft rows back, at the slots
    the request was given on resume."""
    out = original(req, req_to_token_pool, *args, **kwargs)
    backup = getattr(req, BACKUP, None)
    if backup is not None and _retraction is not None:
        _retraction.restore(backup, committed_slots(req, req_to_token_pool))
        setattr(req, BACKUP, None)
    return out


def retraction_hooks() -> tuple[tuple[str, object], ...]:
    """(upstream symbol, AROUND hook) pairs, where this SGLang has a DFLASH PD path (its decode server retracts)."""
    from ..versions import pd_disaggregation_supported

    if not pd_disaggregation_supported():
        return ()
    return (OFFLOAD, offload_hook), (LOAD, load_hook)
