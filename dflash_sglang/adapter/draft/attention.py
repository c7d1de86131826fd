"""The drafter's attention over the paged draft KV pool: FlashInfer on CUDA, a plain-torch reference on CPU.

One drafter pass attends, for request i, to the draft K/V of its committed tokens (pool rows = the target's
KV slots, read through `req_to_token`) and to its own B block rows. The block's K/V are written to scratch
rows of the pool (`PagedDrafter.scratch_rows`, one set of B rows per request-pool slot) so that both live in
one paged cache: the pass is a single ragged paged prefill (page size 1), which is what FlashInfer's
`BatchPrefillWithPagedKVCacheWrapper` runs (`causal=False` for a DFlash layer). Both backends read the same
`DraftLayout`, so the CPU Engine tests exercise the exact indices the GPU kernel gets.

The layout is built once per decode step and shared by every draft layer (the same rows in each layer's
pool slice). Layers differ only in which of those keys their queries see (`LayerKind`: full, causal, sliding window;
core/draft/config.py): a backend plans once per step per kind the drafter has (FlashInfer: one wrapper per kind, planned
with `causal` and `window_left`; torch: each request's key range and mask per kind).

Positions: FlashInfer aligns a request's queries with the end of its keys (query j of a request with kv_len keys and
qo_len queries sits at key index kv_len - qo_len + j), and so does the torch reference. A request's keys are
consecutive positions ending with its block (context 0..L-1, block L..L+b-1), so query j is at position L + j, the
block row it is, and key index differences are position differences: what causal and window masks compare. (A
layout that kept only a recent part of the context must keep it in position order, ending with the block.)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_sglang.core.draft.config import LayerKind
from dflash_sglang.core.draft.draft_kv import DraftKVFormat

_WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended split-k workspace
FULL = LayerKind()  # a DFlash layer's: every query sees all of its request's keys


@dataclass(frozen=True)
class DraftLayout:
    """Where the queries and keys of one drafter pass live (bs requests, block B, page size 1).

    qo_indptr_cpu [bs+1] int32 (host)  request i's queries are rows i*B .. i*B+B-1 of the flattened block
    kv_indptr_cpu [bs+1] int32 (host)  request i's keys are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices    [sum(seq_lens) + bs*B] int32  pool rows: the committed context slots, then the block rows
    """

    qo_indptr_cpu: Tensor
    kv_indptr_cpu: Tensor
    kv_indices: Tensor

    @property
    def batch_size(self) -> int:
        return self.qo_indptr_cpu.numel() - 1


def host_indptrs(seq_lens_cpu: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """[bs] committed lengths (host) -> (qo_indptr, kv_indptr) [bs+1] int32 (host): request i's queries are its B
    block rows, its keys its context and block."""
    bs = seq_lens_cpu.numel()
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int64)
    torch.cumsum(seq_lens_cpu.to(torch.int64) + block, 0, out=kv_indptr[1:])
    return torch.arange(bs + 1, dtype=torch.int32) * block, kv_indptr.to(torch.int32)


@dataclass(frozen=True)
class KeyRange:
    """What one request's queries see in a layer kind: its keys from index `start` of its layout segment on, through
    `mask` [qo_len, kv_len - start] bool (True = attend; None: all of them)."""

    start: int
    mask: Tensor | None


def key_ranges(layout: DraftLayout, kind: LayerKind, device) -> list[KeyRange]:
    """Per request of the layout, the keys `kind` lets its queries see (end-aligned positions, module docstring):
    keys before the first one any query's window reaches are cut off, the rest masked by `kind.visible`. Host work on
    the layout's indptrs, once per step and kind."""
    qo, kv = layout.qo_indptr_cpu.tolist(), layout.kv_indptr_cpu.tolist()
    out = []
    for i in range(layout.batch_size):
        qo_len, kv_len = qo[i + 1] - qo[i], kv[i + 1] - kv[i]
        if not kind.narrows:
            out.append(KeyRange(0, None))
            continue
        first_q = kv_len - qo_len  # the first query's key index (its block row)
        start = 0 if kind.window is None else max(0, first_q - kind.window + 1)
        delta = torch.arange(first_q, kv_len)[:, None] - torch.arange(start, kv_len)[None, :]
        mask = kind.visible(delta)  # on the host: no device sync to find the requests that need no mask
        out.append(KeyRange(start, None if bool(mask.all()) else mask.to(device, non_blocking=True)))
    return out


def paged_attention_reference(q: Tensor, k_rows: Tensor, v_rows: Tensor, layout: DraftLayout,
                              scale: float, kv_format: DraftKVFormat | None = None,
                              ranges: Sequence[KeyRange] | None = None) -> Tensor:
    """The plain-torch definition: q [T, h, d] (T = bs*B), k_rows / v_rows [rows, kvh, d] one layer's pool (stored in
    `kv_format`'s dtype when given, read back in q's) -> out [T, h, d]; the queries of request i attend to request i's
    key rows, all of them (non-causal, `ranges` None) or those its `KeyRange` gives (a layer kind's, `key_ranges`)."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k_rows.shape[1]
    kv_indices = layout.kv_indices.to(torch.int64)
    qo, kv = layout.qo_indptr_cpu.tolist(), layout.kv_indptr_cpu.tolist()
    for i in range(layout.batch_size):
        keys = KeyRange(0, None) if ranges is None else ranges[i]
        rows = kv_indices[kv[i] + keys.start:kv[i + 1]]
        k, v = k_rows[rows], v_rows[rows]
        if kv_format is not None:
            k, v = kv_format.load(k, kv_format.k_scale, q.dtype), kv_format.load(v, kv_format.v_scale, q.dtype)
        k = k.transpose(0, 1).repeat_interleave(rep, dim=0)  # [h, K, d]
        v = v.transpose(0, 1).repeat_interleave(rep, dim=0)
        o = F.scaled_dot_product_attention(q[qo[i]:qo[i + 1]].transpose(0, 1), k, v, attn_mask=keys.mask,
                                           scale=scale)
        out[qo[i]:qo[i + 1]] = o.transpose(0, 1)
    return out


class PagedAttention(Protocol):
    """What a drafter pass asks of its paged attention backend (TorchPagedAttention, FlashInferPagedAttention)."""

    name: str  # for logs; nothing outside this module branches on it
    capturable: bool  # runs inside a CUDA graph (adapter/draft/graphs.py captures only such backends)

    def plan(self, layout: DraftLayout) -> None:
        """Take the step's layout (once per step: every layer reads the same rows; one plan per layer kind)."""
        ...

    def run(self, q: Tensor, k_rows: Tensor, v_rows: Tensor, kind: LayerKind = FULL) -> Tensor:
        """q [bs*B, h, d], one layer's pool k_rows / v_rows [rows, kvh, d] -> [bs*B, h, d] over the planned layout,
        each query seeing the keys its layer's `kind` (one the backend was built for) lets it see."""
        ...

    def for_graph(self, batch_size: int, kv_indptr_buf: Tensor, kv_indices_buf: Tensor) -> PagedAttention:
        """A backend for a graph replay of batch_size requests, reading the index buffers at fixed addresses."""
        ...


class TorchPagedAttention:
    """`paged_attention_reference` behind the backend interface (CPU, or
    `--speculative-draft-attention-backend torch_native`)."""

    name = "torch"
    capturable = False  # the reference reads the layout on the host

    def __init__(self, scale: float, kv_indices_buf: Tensor | None = None, kv_format: DraftKVFormat | None = None,
                 kinds: Sequence[LayerKind] = (FULL,)) -> None:
        self.scale = scale
        self.kv_indices_buf = kv_indices_buf  # graph mode: the key rows live here, written by the graph itself
        self.kv_format = kv_format  # the pool's storage (fp8 draft KV), None: stored as computed
        self.kinds = tuple(dict.fromkeys(kinds))
        self.layout: DraftLayout | None = None
        self.ranges: dict[LayerKind, list[KeyRange] | None] = {}

    @staticmethod
    def expresses(kind: LayerKind, block: int) -> bool:
        """Every kind: the reference masks whatever the kind says."""
        return True

    def plan(self, layout: DraftLayout) -> None:
        self.layout = layout
        device = layout.kv_indices.device
        self.ranges = {kind: key_ranges(layout, kind, device) if kind.narrows else None for kind in self.kinds}

    def for_graph(self, batch_size: int, kv_indptr_buf: Tensor, kv_indices_buf: Tensor) -> TorchPagedAttention:
        """The backend of a graph runner's static replay (never captured: the reference loops on the host). Its
        planned layouts carry no kv_indices: the replay writes them into kv_indices_buf before attending."""
        return TorchPagedAttention(self.scale, kv_indices_buf, self.kv_format, self.kinds)

    def run(self, q: Tensor, k_rows: Tensor, v_rows: Tensor, kind: LayerKind = FULL) -> Tensor:
        assert self.layout is not None, "plan() before run()"
        assert kind in self.ranges, f"a layer kind this backend was built for: {kind}"
        layout = self.layout
        if self.kv_indices_buf is not None:
            total = int(layout.kv_indptr_cpu[-1])
            layout = DraftLayout(layout.qo_indptr_cpu, layout.kv_indptr_cpu, self.kv_indices_buf[:total])
        return paged_attention_reference(q, k_rows, v_rows, layout, self.scale, self.kv_format, self.ranges[kind])


class FlashInferPagedAttention:
    """FlashInfer's ragged paged prefill, page size 1, no positional encoding (q and the pooled keys carry RoPE
    already): one wrapper per layer kind, planned non-causal or causal and with `window_left` = W - 1 for a window W
    (FlashInfer keeps key index k of query j iff k >= kv_len - qo_len + j - window_left, i.e. q_pos - k_pos < W). The
    wrappers share one split-k workspace (layers run one at a time). An fp8 pool (`kv_format`) is read by the kernel
    itself: planned with the fp8 KV data type, its k_scale / v_scale passed at run (FlashInfer folds k_scale into the
    softmax scale and v_scale into the output, the dequantization `DraftKVFormat.load` defines)."""

    name = "flashinfer"
    capturable = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 scale: float, workspace: Tensor | None = None,
                 graph: tuple[int, Tensor, Tensor] | None = None, kv_format: DraftKVFormat | None = None,
                 kinds: Sequence[LayerKind] = (FULL,)) -> None:
        """graph: (batch size, kv_indptr buffer, kv_indices buffer) for wrappers that run inside a CUDA graph
        (`for_graph`); kinds: the drafter's layer kinds, each one `expresses` (at the block size it runs)."""
        import flashinfer  # GPU-only dependency, checked at worker start-up (select_backend)

        if workspace is None:
            workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.workspace = workspace
        self.kinds = tuple(dict.fromkeys(kinds))
        self.wrappers = {}
        for kind in self.kinds:
            if graph is None:
                self.wrappers[kind] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
                continue
            # FlashInfer's graph mode: a fixed batch size, index buffers at fixed addresses that plan() refills
            # before each replay (the kinds' wrappers share kv_indptr and kv_indices: each plan copies the same
            # kv_indptr); fa2, as SGLang's own graph wrappers (its graph-mode plan keeps the kernel grid fixed for a
            # given batch size and row count).
            batch_size, kv_indptr_buf, kv_indices_buf = graph
            i32 = {"dtype": torch.int32, "device": device}
            self.wrappers[kind] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, backend="fa2",
                qo_indptr_buf=torch.zeros(batch_size + 1, **i32), paged_kv_indptr_buf=kv_indptr_buf,
                paged_kv_indices_buf=kv_indices_buf, paged_kv_last_page_len_buf=torch.ones(batch_size, **i32),
            )
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.dtype, self.device, self.scale = dtype, device, scale
        self.kv_format = kv_format
        self.kv_dtype = dtype if kv_format is None else kv_format.dtype

    @staticmethod
    def expresses(kind: LayerKind, block: int) -> bool:
        """FlashInfer limits a query's keys by position on the left only (causal, window_left); a bidirectional window
        W also hides block keys W or more positions to the right, which only exist when W < the block size."""
        return kind.causal or kind.window is None or kind.window >= block

    def for_graph(self, batch_size: int, kv_indptr_buf: Tensor, kv_indices_buf: Tensor) -> FlashInferPagedAttention:
        """A backend for a CUDA graph of `batch_size` requests, sharing this one's split-k workspace (one pass
        runs at a time). It reads kv_indptr_buf [batch_size+1] int32 (plan() fills it from the host layout) and
        kv_indices_buf [>= any layout's rows] int32, which the graph writes; planned layouts carry no kv_indices
        (plan() then copies none)."""
        return FlashInferPagedAttention(*self.shape, self.dtype, self.device, self.scale, workspace=self.workspace,
                                        graph=(batch_size, kv_indptr_buf, kv_indices_buf), kv_format=self.kv_format,
                                        kinds=self.kinds)

    def plan(self, layout: DraftLayout) -> None:
        h, kvh, d = self.shape
        # Host indptrs: plan() reads them on the host anyway (no device sync) and copies them over itself.
        last_page_len = torch.ones(layout.batch_size, dtype=torch.int32)
        for kind, wrapper in self.wrappers.items():
            wrapper.plan(
                layout.qo_indptr_cpu, layout.kv_indptr_cpu, layout.kv_indices, last_page_len,
                h, kvh, d, 1, causal=kind.causal, pos_encoding_mode="NONE", sm_scale=self.scale,
                q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                window_left=-1 if kind.window is None else kind.window - 1,
            )

    def run(self, q: Tensor, k_rows: Tensor, v_rows: Tensor, kind: LayerKind = FULL) -> Tensor:
        wrapper = self.wrappers[kind]
        # NHD paged cache: [pages, page_size=1, kvh, d], a view of the layer's pool slice.
        cache = (k_rows.unsqueeze(1), v_rows.unsqueeze(1))
        if self.kv_format is None:
            return wrapper.run(q.contiguous(), cache)
        return wrapper.run(q.contiguous(), cache, k_scale=self.kv_format.k_scale, v_scale=self.kv_format.v_scale)


def select_backend(device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   choice: str = "auto", kv_format: DraftKVFormat | None = None, kinds: Sequence[LayerKind] = (FULL,),
                   block: int = 1) -> PagedAttention | None:
    """The paged attention backend: `choice` is "flashinfer", "torch" or "auto" (FlashInfer on CUDA, torch
    elsewhere), as resolved from --speculative-draft-attention-backend at start-up (adapter/boot/draft_checks.py).
    dtype: the queries' (the drafter's compute dtype); kv_format: the pool's storage (None: dtype); kinds: the drafter's
    layer kinds, block: its block size B. None: the chosen backend cannot express one of the kinds (`expresses`), and
    the drafter takes its dense path."""
    assert choice in ("auto", "flashinfer", "torch"), choice
    scale = head_dim**-0.5
    on_cuda = torch.device(device).type == "cuda"
    if choice == "torch" or (choice == "auto" and not on_cuda):
        if not all(TorchPagedAttention.expresses(kind, block) for kind in kinds):
            return None
        return TorchPagedAttention(scale, kv_format=kv_format, kinds=kinds)
    if not on_cuda:
        raise ValueError(f"--speculative-draft-attention-backend flashinfer needs a CUDA device, the drafter runs on "
                         f"{device}")
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        raise ImportError(f"DFLASH draft attention on CUDA needs FlashInfer (pip install flashinfer-python), "
                          f"or --speculative-draft-attention-backend torch_native: {e}") from None
    if not all(FlashInferPagedAttention.expresses(kind, block) for kind in kinds):
        return None
    return FlashInferPagedAttention(num_heads, num_kv_heads, head_dim, dtype, device, scale, kv_format=kv_format,
                                    kinds=kinds)
