"""PD disaggregation (SGLang >= 0.5.23: prefill and decode servers behind sglang-router): our draft KV pool is
registered with the KV transfer engine beside the target's, so a request decodes on the decode server from the draft
K/V our prefill server wrote at its prompt's slots.

What SGLang does with it (0.5.23, `disaggregation/`): both servers read `spec_worker.primary_draft_kv_pool` once
(`Scheduler.init_disaggregation`) and append its `get_contiguous_buf_infos()` entries to the target's (`prefill.py`
`_init_kv_manager`, `decode.py`); a transfer copies page g of entry i at `ptrs[i] + g * item_lens[i]`, g the target's
page index of the request's slots, so the entries must be one buffer per layer for K and then V whose row r is target
KV slot r, which our pool is (adapter/model.py `DraftKVPool`). The prefill server's first token travels as the bonus
(`MetadataBuffers.output_ids`); the decode server builds the relayed state from it through
`SpeculativeAlgorithm.build_disagg_draft_input` (`speculative/dflash_disaggregation.py`: the `DFlashDraftInputV2` of
bonus and committed length that our worker relays between steps anyway), and its first decode step drafts at once.
Both servers must run our DFLASH with the same draft and TP size (the entry lists are matched entry by entry): a
plain prefill server would send no draft K/V, and acceptance on the decode server would collapse (output still
lossless).
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import DraftKVPool


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
