"""PD disaggregation (SGLang >= 0.5.23: prefill and decode servers behind sglang-router): our draft KV pool is
registered with the KV transfer engine beside the target's, so a request decodes on the decode server from the draft
K/V our prefill server wrote at its prompt's slots.

What SGLang does with it (0.5.23, `disaggregation/`): both servers read `spec_worker.primary_draft_kv_pool` once
(`Scheduler.init_disaggregation`) and append its `get_contiguous_buf_infos()` entries to the target's (`prefill.py`
`_init_kv_manager`, `decode.py`); a transfer copies page g of entry i at `ptrs[i] + g * item_lens[i]`, g the target's
page index of the request's slots, so the entries must be one buffer per layer for K and then V whose row r is target
KV slot r, which our pool is (adapter/draft/model.py `DraftKVPool`). The prefill server's first token travels as the
bonus (`MetadataBuffers.output_ids`); the decode server builds the relayed state from it through
`SpeculativeAlgorithm.build_disagg_draft_input` (`speculative/dflash_disaggregation.py`: the `DFlashDraftInputV2` of
bonus and committed length that our worker relays between steps anyway), and its first decode step drafts at once.
Both servers must run our DFLASH with the same draft and TP size (the entry lists are matched entry by entry). A
prefill server without a draft pool (plain, or SGLang's builtin with another layout) sends the target's K/V only, and
SGLang accepts that silently ("decode has draft KV while prefill is deployed without speculative decoding",
`disaggregation/common/conn.py`): the decode server would draft from rows nobody wrote, its acceptance would collapse
(output still lossless). So the decode server checks every transferred request (`PeerCheck`): the first draft layer's K
rows of the slots it pre-allocates for a transfer are set to NaN (`pre_alloc_hook`), a transfer with draft K/V
overwrites them all, and when the request joins the decode batch (`build_draft_input_hook`) rows still NaN are zeroed
and reported as an error in the log, naming the cause and the fix.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..draft.pool import DraftKVPool

logger = logging.getLogger(__name__)

PRE_ALLOC = "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc"
BUILD_DRAFT_INPUT = "sglang.srt.speculative.dflash_disaggregation.build_dflash_disagg_draft_input"


@dataclass(frozen=True)
class TransferredDraftPool:
    """The face of our draft pool the transfer engine reads (as SGLang's `MHATokenToKVPool` exposes its own)."""

    pool: DraftKVPool
    page_size: int  # the target pool's: transfers go page by page at the target's page indices

    @property
    def layer_num(self) -> int:
        return self.pool.k.shape[0]

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """(data pointers, byte lengths, bytes per page) of 2 x layer_num entries: K of every layer, then V."""
        buffers = [self.pool.k[i] for i in range(self.layer_num)] + [self.pool.v[i] for i in range(self.layer_num)]
        page = self.page_size * buffers[0][0].numel() * buffers[0].element_size()
        return [b.data_ptr() for b in buffers], [b.nbytes for b in buffers], [page] * len(buffers)

    def mark_unsent(self, slots: Tensor) -> None:
        """Decode side, slots [n] int64 just pre-allocated for a transfer: their first draft layer's K rows become NaN
        (as stored) until the transfer writes them."""
        nan = torch.full((1, *self.pool.k.shape[2:]), float("nan"), dtype=self.pool.dtype, device=self.pool.k.device)
        self.pool.k[0, slots] = self.pool.store(nan, nan)[0]

    def unsent(self, slots: Tensor, valid: Tensor) -> Tensor:
        """slots [bs, S] int64 of requests' context rows, valid [bs, S] bool -> [bs] bool: a request with a row the
        transfer did not write. Those rows are zeroed (finite drafts, rejected by the verify)."""
        k = self.pool.load(self.pool.k[0, slots], self.pool.v[0, slots])[0]  # [bs, S, kvh, d]
        nan = k.isnan().flatten(2).any(-1) & valid
        rows = slots[nan]
        if rows.numel():
            self.pool.k[0, rows] = torch.zeros((), dtype=self.pool.k.dtype, device=self.pool.k.device)
        return nan.any(-1)


@dataclass
class PeerCheck:
    """The decode server's check that its prefill peers sent draft K/V (module docstring)."""

    pool: TransferredDraftPool
    checked: int = 0  # transferred requests checked
    unsent: int = 0  # ... of which arrived without draft K/V
    reported: int = field(default=0, repr=False)

    def check(self, batch) -> None:
        """batch: the decode side's prebuilt batch of transferred requests (seq_lens = their transferred lengths).
        Health checks are not transfers (SGLang gives them a fake bootstrap host and no KV): not checked."""
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

        transferred = [getattr(r, "bootstrap_host", None) != FAKE_BOOTSTRAP_HOST for r in batch.reqs]
        lens_cpu = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
        longest = max((int(n) for n, t in zip(lens_cpu.tolist(), transferred) if t), default=0)
        if longest == 0:
            return
        lens = batch.seq_lens * torch.tensor(transferred, device=batch.seq_lens.device)
        cols = torch.arange(longest, device=lens.device)
        slots = batch.req_to_token_pool.req_to_token[batch.req_pool_indices][:, :longest].to(torch.int64)
        valid = cols[None, :] < lens[:, None]
        missing = self.pool.unsent(slots.masked_fill(~valid, 0), valid).tolist()  # (one host sync per arrivals batch)
        self.checked += sum(transferred)
        if not any(missing):
            return
        self.unsent += sum(missing)
        if self.reported == 0 or self.unsent >= 2 * self.reported:  # the first, then at each doubling
            self.reported = self.unsent
            rids = [r.rid for r, m in zip(batch.reqs, missing) if m]
            logger.error(
                "DFLASH (dflash-sglang) PD: %d of %d transferred requests arrived without draft K/V (now: %s): their "
                "prefill server runs no DFLASH draft pool of the same layout (plain, SGLang's builtin DFLASH, or "
                "another draft). Outputs stay exact, but their drafts are rejected: run every prefill server with "
                "dflash-sglang and the same --speculative-algorithm DFLASH --speculative-draft-model-path and TP size",
                self.unsent, self.checked, ", ".join(map(str, rids[:4])))


_check: PeerCheck | None = None  # this decode server's (one worker per process)


def watch_transfers(pool: TransferredDraftPool) -> None:
    """Decode side: check the transfers into this pool (the worker calls this when SGLang reads its pool)."""
    global _check
    _check = PeerCheck(pool)


def pre_alloc_hook(original, queue, req, *args, **kwargs):
    """AROUND `DecodePreallocQueue._pre_alloc`: the new slots of a transfer into our pool are marked unsent."""
    loc = original(queue, req, *args, **kwargs)
    pool = getattr(queue, "draft_token_to_kv_pool", None)
    if isinstance(pool, TransferredDraftPool) and isinstance(loc, Tensor) and loc.numel():
        pool.mark_unsent(loc.to(torch.int64))
    return loc


def build_draft_input_hook(original, batch, *args, **kwargs):
    """AROUND `build_dflash_disagg_draft_input`: transferred requests joining the decode batch are checked."""
    if _check is not None and len(batch.reqs):
        _check.check(batch)
    return original(batch, *args, **kwargs)


def pd_hooks() -> tuple[tuple[str, object], ...]:
    """(upstream symbol, AROUND hook) pairs of the check, where this SGLang has a DFLASH PD path."""
    from ..versions import pd_disaggregation_supported

    if not pd_disaggregation_supported():
        return ()
    return (PRE_ALLOC, pre_alloc_hook), (BUILD_DRAFT_INPUT, build_draft_input_hook)
