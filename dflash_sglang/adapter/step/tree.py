"""A tree verify on SGLang's tables: its attention mask for the target's backends, its accepted path's slots,
its result rows.

A tree verify runs N node rows per request at positions `seq_len + depth`, their KV written at
`req_to_token[req, seq_len + node]`, so each request's keys are the columns `0 .. seq_len + N - 1` of its
req_to_token row: the committed prefix, then the nodes in node order. Node i may attend to the whole prefix
and to its ancestors and itself: `allow[i] = [True x seq_len | tree_mask[i]]`.

- GPU (FlashInfer / Triton): `flat_custom_mask` builds the verify input's `custom_mask` in the layout SGLang
  0.5.17 reads for TARGET_VERIFY (`DFlashVerifyInput.generate_attn_arg_prefill` for FlashInfer, the
  `mask_indptr` of triton_backend.py): per request the [N, seq_len + N] allow matrix row-major, requests
  concatenated, True = attend.
- CPU: SGLang's TorchNativeAttnBackend has no custom-mask support (and its extend attention pads each request's
  query to the whole prefix), so `TreeMaskAttention` stands in for it during every verify forward, chains
  included (sliding-window layers of a chain are left to SGLang's). RadixAttention calls
  `get_attn_backend().forward(...)` of the active ForwardContext: it writes the K/V like the wrapped backend, then
  runs SDPA per request over the verify rows only, with the mask.

After the acceptance `compact_path_slots` permutes the request's req_to_token entries inside `[seq_len, seq_len +
N)` so that the accepted path's slots sit at `seq_len + 0 .. accept_len` in order: the committed KV is then exactly
what a chain would have left, and the other slots stay reserved past the committed length, where the next step
overwrites them. A permutation inside the reserved window keeps slot ownership as SGLang tracks it.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from dflash_sglang.core.step.tree_verify import TreeAcceptResult


def allow_matrix(prefix_len: int, tree_mask: Tensor) -> Tensor:
    """[N, prefix_len + N] bool for one request: the prefix, then its tree_mask [N, N] (True = attend)."""
    n = tree_mask.shape[0]
    prefix = torch.ones(n, prefix_len, dtype=torch.bool, device=tree_mask.device)
    return torch.cat([prefix, tree_mask.to(torch.bool)], dim=1)


def flat_custom_mask(prefix_lens: Tensor, tree_mask: Tensor, prefix_sum: int) -> Tensor:
    """SGLang's flattened TARGET_VERIFY custom mask, built on the device without a host sync.

    prefix_lens [bs] int (committed tokens), tree_mask [bs, N, N] bool, prefix_sum = sum(prefix_lens) known on
    the host (it sizes the output). Returns [N * prefix_sum + bs * N * N] bool: request b's `allow_matrix`
    flattened row-major at offset N * (prefix_lens[:b].sum() + b * N).
    """
    bs, n, _ = tree_mask.shape
    prefix = prefix_lens.to(torch.int64)
    row_len = prefix + n
    start = torch.cumsum(n * row_len, 0) - n * row_len
    r = torch.arange(n, device=tree_mask.device)
    # index of (request b, row i, tree column j) in the flat mask; every other entry is a prefix column
    idx = start[:, None, None] + r[None, :, None] * row_len[:, None, None] + prefix[:, None, None] + r[None, None, :]
    mask = torch.ones(n * prefix_sum + bs * n * n, dtype=torch.bool, device=tree_mask.device)
    mask[idx.reshape(-1)] = tree_mask.reshape(-1).to(torch.bool)
    return mask


def tree_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_slots: list[Tensor], tree_mask: Tensor, scaling: float
) -> Tensor:
    """Attention of the node rows over prefix + nodes, per request.

    q [bs * N, Hq, d] (request-major node rows); k_cache [S, Hk, d], v_cache [S, Hk, dv]; kv_slots: per request
    [prefix_len + N] int64 KV slots (prefix, then the nodes in node order); tree_mask [bs, N, N] bool.
    Returns [bs * N, Hq, dv].
    """
    bs, n, _ = tree_mask.shape
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for b, slots in enumerate(kv_slots):
        rows = slice(b * n, (b + 1) * n)
        keys = k_cache[slots].transpose(0, 1).to(q.dtype)  # [Hk, S, d]
        values = v_cache[slots].transpose(0, 1).to(q.dtype)
        # one row attends to everything: no mask, the same call as SGLang's torch_native decode attention
        allow = allow_matrix(slots.numel() - n, tree_mask[b]) if n > 1 else None
        o = scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], keys[None], values[None], attn_mask=allow, scale=scaling,
            enable_gqa=q.shape[1] != k_cache.shape[1],
        )
        out[rows] = o[0].transpose(0, 1)
    return out


class TreeMaskAttention:
    """Stands in for SGLang's TorchNativeAttnBackend during one tree verify forward.

    `inner` is the model runner's TorchNativeAttnBackend (its pools and per-forward state are used as they
    are); `tree_mask` [bs, N, N] bool is the verify's ancestor mask; `prefix_lens` [bs] the committed lengths.
    Every other attribute is the inner backend's.
    """

    def __init__(self, inner, tree_mask: Tensor, prefix_lens: Tensor, chain: bool = False) -> None:
        assert chain or not getattr(inner, "use_sliding_window_kv_pool", False), "tree verify: no sliding-window KV"
        self.inner = inner
        self.chain = chain  # tree_mask is causal: SGLang's own attention is a correct (slower) fallback
        self.tree_mask = tree_mask
        self.prefix_lens = prefix_lens.tolist()  # CPU path only: per-request loops need host ints anyway
        self._kv_slots: list[Tensor] | None = None  # per request [prefix + N] KV slots, set by the first layer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        window = layer.sliding_window_size is not None and layer.sliding_window_size > -1
        if self.chain and (window or getattr(self.inner, "use_sliding_window_kv_pool", False)):
            return self.inner.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        assert not layer.is_cross_attention, "tree verify: decoder self-attention only"
        assert layer.sliding_window_size is None or layer.sliding_window_size < 0, "tree verify: no sliding window"
        pool = self.inner.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, self.inner.swa_out_cache_loc), k, v)
        n = self.tree_mask.shape[1]
        if self._kv_slots is None:  # the same for every layer of this forward: gathered once
            req_to_token = self.inner.req_to_token_pool.req_to_token
            self._kv_slots = [
                req_to_token[int(row), : prefix + n].to(torch.int64)
                for row, prefix in zip(forward_batch.req_pool_indices.tolist(), self.prefix_lens)
            ]
        kv_slots = self._kv_slots
        out = tree_attention(
            q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim), pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id), kv_slots, self.tree_mask, layer.scaling,
        )
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)


def fit_rows(out_tokens: Tensor, max_nodes: int) -> Tensor:
    """out_tokens [bs, D+1] (accepted tokens, bonus, then -1) -> [bs, N] (N = max_nodes), cropped or -1 padded.

    SGLang reads row i of next_token_ids with stride `speculative_num_draft_tokens` (N) up to accept_lens[i],
    and a path never commits more than N tokens, so cropping drops only -1 padding.
    """
    have = out_tokens.shape[1]
    if have >= max_nodes:
        return out_tokens[:, :max_nodes]
    return torch.cat([out_tokens, out_tokens.new_full((out_tokens.shape[0], max_nodes - have), -1)], dim=1)


def compact_path_slots(
    req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor, result: TreeAcceptResult
) -> None:
    """Permute req_to_token[req, seq_len : seq_len + N] in place: the accepted path's slots first, in path
    order, then the other nodes' slots in node order.

    req_to_token [R, W] int32 (SGLang's table), req_pool_indices [bs], seq_lens [bs] committed lengths before
    the step, result.commit_loc [bs, D+1] / free_loc [bs, N-1] (-1 padded, from the tree verify). Pure device
    ops (no host sync), so it runs on the overlap forward stream like the rest of the step.
    """
    assert result.commit_loc is not None and result.free_loc is not None, "verify the tree with out_cache_loc"
    nodes = result.free_loc.shape[1] + 1
    ordered = torch.cat([result.commit_loc, result.free_loc], dim=1)
    # Each row holds exactly N valid slots (accept_len + 1 kept, N - 1 - accept_len freed); a stable sort on
    # "is padding" moves them to the front in order.
    first = (ordered < 0).to(torch.int32).argsort(dim=1, stable=True)[:, :nodes]
    rows = req_pool_indices.to(torch.int64)[:, None]
    cols = seq_lens.to(torch.int64)[:, None] + torch.arange(nodes, device=seq_lens.device)
    req_to_token[rows, cols] = ordered.gather(1, first).to(req_to_token.dtype)
