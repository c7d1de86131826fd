"""HiCache (`--enable-hierarchical-cache`, SGLang >= 0.5.23): our draft KV pool offloaded to host memory and loaded
back with the target's, at the same slot ids, so a prefix that comes back from host drafts as well as it did before.

What SGLang does (0.5.23): the scheduler asks the spec worker for its HiCache draft plan right after the KV pools are
allocated (`BaseSpecWorker.init_hicache_draft_plan`; also on a PD decode server whose retraction backup is the host
pool, SGLang's default there). A `SIDECAR` plan names one draft device pool; `kv_cache_builder.
maybe_register_hicache_draft` -> `hybrid_pool_assembler.build_full_draft_pools` gives it a host pool of its own
(`MHATokenToKVPoolHost`, built from the pool's `get_device_pool_infos()[0].buffer_info`, one host slot per target
host slot) whose transfers take the target's host and device indices (`indices_from_pool=KV`): every backup and load
of a target page copies the same slots of every draft layer, draft layer i in transfer stage i (the target's attention
waits for stage i before its layer i; our layers are at most the target's, so a decode step's drafter runs after every
stage it reads has landed). SGLang's own plan (`_build_hicache_draft_plan`) reads a draft `ModelRunner`, which our
drafter does not have: `draft_plan` builds the same SIDECAR plan over `HiCacheDraftPool`.

Which rows: the draft pool (adapter/draft/model.py `DraftKVPool`) keeps one context row per target KV slot (rows [0,
target size + page size), the target's padding slot included) and then the block scratch rows of every request-pool
slot. Only the context rows are offloaded: the scratch rows belong to no slot, are rewritten by every draft pass, and
are not part of any prefix. A draft window served by its ring (adapter/draft/context_rows.py: context rows in
per-request rings, not at slot ids) would have nothing at the target's slot ids to offload: with HiCache (or PD) the
resolution serves a window over the slot rows, which offload as without one. An fp8 draft pool is described in bytes
(uint8 rows, as SGLang's own fp8 pools store theirs): the transfers copy rows, never values.
"""
from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from ..draft.context_rows import SlotRows
from ..draft.model import PagedDrafter
from ..draft.pool import DraftKVPool
from ..settings import UnsupportedFlagError
from ..versions import SGLANG_VERSION, hicache_draft_served


def offloads_to_host() -> bool:
    """Whether this scheduler's KV goes to host memory and back: HiCache, or a PD decode server's host-pool
    retraction backup (the conditions of SGLang's own `_build_hicache_draft_plan`)."""
    from sglang.srt.runtime_context import get_disagg, get_memory

    return bool(get_memory().enable_hierarchical_cache
                or get_disagg().disaggregation_decode_retraction_backup == "host_pool")


def target_rows(target_pool) -> int:
    """Rows of a pool indexed by the target's KV slot ids: every slot, the padding slot 0 included."""
    return int(target_pool.size) + int(target_pool.page_size)


class HiCacheDraftPool(MHATokenToKVPool):
    """Our draft pool's context rows as SGLang's HiCache reads a draft KV pool: per layer K and V buffers
    [target size + page size, kv_heads, head_dim] (views of `DraftKVPool.k[i]` / `.v[i]`, the scratch rows left out)
    with their device pointer tables, `size` = the target's. An `MHATokenToKVPool` (SGLang picks the MHA host pool by
    that class) whose buffers are ours: SGLang's constructor, which allocates buffers, is not run; nothing but HiCache's
    host assembly reads this object."""

    def __init__(self, pool: DraftKVPool, target_pool) -> None:
        """pool: the draft pool, its rows [0, rows) one per target KV slot (`SlotRows`); target_pool: SGLang's."""
        rows = target_rows(target_pool)
        assert pool.rows >= rows, (pool.rows, rows)
        layers, _, heads, head_dim = pool.k.shape
        # fp8 rows as bytes (SGLang's own fp8 pools store uint8: index copies of fp8 tensors are not everywhere)
        as_stored = (lambda t: t.view(torch.uint8)) if pool.k.element_size() == 1 else (lambda t: t)
        self.k_buffer = [as_stored(pool.k[i, :rows]) for i in range(layers)]
        self.v_buffer = [as_stored(pool.v[i, :rows]) for i in range(layers)]
        device = pool.k.device
        self.k_data_ptrs = torch.tensor([b.data_ptr() for b in self.k_buffer], dtype=torch.uint64, device=device)
        self.v_data_ptrs = torch.tensor([b.data_ptr() for b in self.v_buffer], dtype=torch.uint64, device=device)
        self.size, self.page_size = int(target_pool.size), int(target_pool.page_size)
        self.dtype, self.store_dtype, self.device = pool.dtype, self.k_buffer[0].dtype, device
        self.layer_num, self.start_layer, self.end_layer = layers, 0, layers - 1
        self.head_num, self.head_dim, self.v_head_dim = heads, head_dim, head_dim
        self.row_dim = self.v_row_dim = heads * head_dim
        self.model_layer_ids = tuple(range(layers))
        self.kv_cache_layout = "nhd"
        self.k_scale_buffer = self.v_scale_buffer = None
        self.post_capture_active = False
        self.host_capacity_tokens = None  # (one host slot per target host slot: SGLang's sidecar default)
        self.layer_transfer_counter = None
        self.mem_usage = 2 * sum(b.nbytes for b in self.k_buffer) / 2**30

    def get_kv_size_bytes(self) -> tuple[int, int]:
        return sum(b.nbytes for b in self.k_buffer), sum(b.nbytes for b in self.v_buffer)

    def get_device_pool_infos(self):
        """One `DevicePoolInfo` (`PoolName.DRAFT`'s buffers, indexed by the target's KV slots)."""
        from sglang.srt.mem_cache.device_pool_info import DevicePoolInfo, KVBufferLayout, KVBuffers, MHABufferInfo
        from sglang.srt.mem_cache.hicache_storage import PoolName

        buffers = KVBuffers(k=tuple(self.k_buffer), v=tuple(self.v_buffer), k_data_ptrs=self.k_data_ptrs,
                            v_data_ptrs=self.v_data_ptrs, layout=KVBufferLayout.NHD)
        info = MHABufferInfo(buffers=buffers, page_size=self.page_size, head_num=self.head_num,
                             head_dim=self.head_dim, v_head_dim=self.v_head_dim, dtype=self.store_dtype,
                             device=self.device)
        return (DevicePoolInfo(pool_name=PoolName.DRAFT, indices_from_pool=PoolName.KV,
                               layer_ids=self.model_layer_ids, buffer_info=info),)


def draft_plan(drafter: PagedDrafter | None, target_pool):
    """The worker's HiCache draft plan (SGLang's `HiCacheDraftPlan`): SIDECAR over our pool's context rows when this
    scheduler offloads KV to host, else none. Raises UnsupportedFlagError for a draft pool that cannot follow."""
    from sglang.srt.speculative.base_spec_worker import HiCacheDraftMode, HiCacheDraftPlan

    if drafter is None or not offloads_to_host():
        return HiCacheDraftPlan()
    if not hicache_draft_served():  # (--enable-hierarchical-cache is refused at start-up there: a decode server's
        # host-pool retraction backup, resolved once the pools exist)
        raise UnsupportedFlagError(f"--disaggregation-decode-retraction-backup host_pool: SGLang {SGLANG_VERSION} "
                                   "cannot back up a DFLASH draft KV pool to its host pool (0.5.23 can); pass "
                                   "--disaggregation-decode-retraction-backup cpu_tensor")
    if not isinstance(drafter.context_rows, SlotRows) or drafter.context_rows.rows < target_rows(target_pool):
        # (the resolution serves a window over the slot rows wherever KV goes to host: adapter/boot/draft_checks.py)
        raise UnsupportedFlagError("--enable-hierarchical-cache with --speculative-draft-window-size: the window's "
                                   "ring keeps no rows at the target's KV slots for HiCache to offload")
    layers, stages = drafter.pool.k.shape[0], int(target_pool.layer_num)  # (a stage per target layer of this rank)
    if layers > stages:  # (SGLang raises the same, less plainly, at host assembly)
        raise UnsupportedFlagError(f"--enable-hierarchical-cache: the draft has {layers} layers, more than the "
                                   f"target's {stages} HiCache transfer stages")
    return HiCacheDraftPlan(mode=HiCacheDraftMode.SIDECAR,
                            device_pools=(HiCacheDraftPool(drafter.pool, target_pool),))
