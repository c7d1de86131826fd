"""build_tree_inputs / draft_kv_indices: CUDA kernel on CUDA tensors, core/step/block.py on CPU tensors. (The drafter's
block inputs stay core/step/block.py's torch ops: a few tensor ops inside the captured draft pass.)

Same contracts as core/step/block.py, plus destination-passing `out=` (a BlockInputs of preallocated [bs, n] int64
buffers, out_cache_loc included iff req_to_token is given): with it, the CUDA path allocates nothing, never
syncs with the host, and can be captured in a CUDA graph. `backend` (see _lib.resolve_backend) picks the
implementation: "auto" (kernel on CUDA tensors, reference otherwise), "reference", "cuda" or "host".
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..core.step import block as ref
from . import _abi, _lib


def build_tree_inputs(tokens: Tensor, depth: Tensor, seq_lens: Tensor, req_to_token: Tensor | None = None,
                      req_pool_indices: Tensor | None = None, *, out: ref.BlockInputs | None = None,
                      backend: str = "auto") -> ref.BlockInputs:
    """Tree verify rows (tokens, seq_len + depth, slots); argument shapes as in core/step/block.py build_tree_inputs."""
    ref.check_tree_batch(tokens, depth, seq_lens)
    backend = _lib.resolve_backend(backend, tokens.device)
    if backend == "reference":
        return _into(out, ref.build_tree_inputs(tokens, depth, seq_lens, req_to_token, req_pool_indices))
    return _launch(backend, tokens, depth, seq_lens, req_to_token, req_pool_indices, out)


def _check_outs(out: ref.BlockInputs, bs: int, n: int, with_loc: bool, device: torch.device) -> None:
    for name in ("input_ids", "positions"):
        _abi.check_out(f"out.{name}", getattr(out, name), (bs, n), torch.int64, device)
    if with_loc != (out.out_cache_loc is not None):
        raise ValueError("out.out_cache_loc must be given exactly when req_to_token is")
    if with_loc:
        _abi.check_out("out.out_cache_loc", out.out_cache_loc, (bs, n), torch.int64, device)


def _into(out: ref.BlockInputs | None, result: ref.BlockInputs) -> ref.BlockInputs:
    if out is None:
        return result
    bs, n = result.input_ids.shape
    _check_outs(out, bs, n, result.out_cache_loc is not None, result.input_ids.device)
    for name in ("input_ids", "positions", "out_cache_loc"):
        if getattr(result, name) is not None:
            getattr(out, name).copy_(getattr(result, name))
    return out


def _launch(
    backend: str,
    tokens: Tensor,
    depth: Tensor,
    seq_lens: Tensor,
    req_to_token: Tensor | None,
    req_pool_indices: Tensor | None,
    out: ref.BlockInputs | None,
) -> ref.BlockInputs:
    device, (bs, n) = seq_lens.device, tokens.shape
    idx = _abi.INDEX_DTYPES
    _abi.check_inputs(device, tokens=(tokens, idx), depth=(depth, idx), seq_lens=(seq_lens, idx),
                      req_pool_indices=(req_pool_indices, idx))
    if req_to_token is not None:
        if req_pool_indices is None or req_pool_indices.shape != (bs,):
            raise ValueError("req_pool_indices [bs] is required with req_to_token")
        if req_to_token.dim() != 2 or req_to_token.stride(1) != 1 or req_to_token.dtype != torch.int32:
            raise ValueError(f"req_to_token must be a row-major [R, W] int32 table, got {tuple(req_to_token.shape)} "
                             f"{req_to_token.dtype}")
        if req_to_token.device != device:
            raise ValueError(f"req_to_token is on {req_to_token.device}, expected {device}")
    if out is None:
        new = lambda: torch.empty(bs, n, dtype=torch.int64, device=device)  # noqa: E731
        out = ref.BlockInputs(new(), new(), None if req_to_token is None else new())
    _check_outs(out, bs, n, req_to_token is not None, device)
    params = _abi.BlockInputsParams(
        tokens=_abi.index_view(tokens), depth=_abi.index_view(depth),
        seq_lens=_abi.index_view(seq_lens), req_pool_indices=_abi.index_view(req_pool_indices),
        req_to_token=_abi.ptr(req_to_token),
        req_to_token_stride=0 if req_to_token is None else req_to_token.stride(0),
        req_to_token_rows=0 if req_to_token is None else req_to_token.shape[0],
        bs=bs, n=n,
        input_ids=_abi.ptr(out.input_ids), positions=_abi.ptr(out.positions), out_cache_loc=_abi.ptr(out.out_cache_loc),
    )
    _lib.launch(backend, "block_inputs", params, device)
    return out


def draft_kv_indices(
    kv_indptr: Tensor, req_pool_indices: Tensor, req_to_token: Tensor | None, scratch_base: int, block: int, *,
    out: Tensor, seq_lens: Tensor | None = None, ring: int = 0, backend: str = "auto",
) -> Tensor:
    """The drafter pass's key rows into `out` [capacity] int32 (see core/step/block.py draft_kv_indices). kv_indptr
    [bs+1] int32 on the device, req_pool_indices [bs] int32/int64, req_to_token [R, W] int32 row-major (None with a
    ring), seq_lens [bs] int32/int64 committed lengths (a draft window: each request's keys are its last kv_len - block
    positions) or None (the whole context from position 0), ring: R > 0 for a draft window's ring of R rows per request
    slot (seq_lens required), 0 for the slot rows. No host read and no allocation on CUDA: the draft CUDA graphs
    capture it."""
    if kv_indptr.shape != (req_pool_indices.numel() + 1,):
        raise ValueError(f"kv_indptr must be [bs+1] for {req_pool_indices.numel()} requests, "
                         f"got {tuple(kv_indptr.shape)}")
    if seq_lens is not None and seq_lens.shape != req_pool_indices.shape:
        raise ValueError(f"seq_lens must be [bs] for {req_pool_indices.numel()} requests, got {tuple(seq_lens.shape)}")
    if ring < 0 or (ring and seq_lens is None) or (not ring and req_to_token is None):
        raise ValueError(f"ring {ring}: a ring (> 0) needs seq_lens, the slot rows (0) req_to_token")
    backend = _lib.resolve_backend(backend, out.device)
    if backend == "reference":
        return ref.draft_kv_indices(kv_indptr, req_pool_indices, req_to_token, scratch_base, block, out, seq_lens,
                                    ring)
    device = out.device
    table = None if ring else req_to_token
    _abi.check_inputs(device, kv_indptr=(kv_indptr, (torch.int32,)),
                      req_pool_indices=(req_pool_indices, _abi.INDEX_DTYPES), seq_lens=(seq_lens, _abi.INDEX_DTYPES),
                      req_to_token=(table, (torch.int32,)), out=(out, (torch.int32,)))
    if table is not None and table.dim() != 2:
        raise ValueError(f"req_to_token must be [R, W], got {tuple(table.shape)}")
    params = _abi.DraftLayoutParams(
        kv_indptr=_abi.ptr(kv_indptr), req_pool_indices=_abi.index_view(req_pool_indices),
        req_to_token=_abi.ptr(table), req_to_token_stride=0 if table is None else table.stride(0),
        req_to_token_rows=0 if table is None else table.shape[0], scratch_base=scratch_base, block=block,
        bs=req_pool_indices.numel(), capacity=out.numel(), kv_indices=_abi.ptr(out),
        seq_lens=_abi.index_view(seq_lens), ring=ring,
    )
    _lib.launch(backend, "draft_layout", params, device)
    return out
