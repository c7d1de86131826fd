"""Torch stand-ins for the SGLang helpers that a CPU server would otherwise run as GPU kernels.

SGLang runs speculative decoding on CPU only with its `sgl_kernel` CPU build (SGLANG_USE_CPU_ENGINE=1), which is not
on PyPI. A plain `--device cpu` server still takes the GPU branch of a few helpers on the DFLASH path, and SGLang 0.5.17
cannot allocate or apply a grammar bitmask without an accelerator; the plugin hooks them (AROUND) so that CPU tensors
go through the versions here and everything else reaches SGLang's own code unchanged.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _torch_path(device) -> bool:
    """CPU tensors without SGLang's CPU engine (whose sgl_kernel ops handle them already)."""
    from sglang.srt.utils import is_cpu

    return torch.device(device).type == "cpu" and not is_cpu()


def assign_req_to_token_pool(
    req_pool_indices: Tensor, req_to_token: Tensor, start_offset: Tensor, end_offset: Tensor, out_cache_loc: Tensor
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = request i's run of out_cache_loc, the runs concatenated
    in request order (SGLang's `assign_req_to_token_pool` Triton kernel, mem_cache/allocation.py).

    req_pool_indices / start_offset / end_offset [bs] int, out_cache_loc [>= sum(end - start)] int64. A run past the
    end of its row is refused: the kernel has no bounds check (it would write the next row's entries) and a torch
    slice would drop the slot silently (a leak SGLang's idle check turns into a dead scheduler).
    """
    lengths = (end_offset - start_offset).tolist()
    ends = end_offset.tolist()
    assert min(lengths, default=0) >= 0 and max(ends, default=0) <= req_to_token.shape[1], (
        f"KV slots assigned past the req_to_token row ({req_to_token.shape[1]} columns): ends {max(ends)}")
    runs = torch.split(out_cache_loc[: sum(lengths)], lengths)
    for row, start, run in zip(req_pool_indices.tolist(), start_offset.tolist(), runs):
        req_to_token[row, start : start + run.numel()] = run.to(req_to_token.dtype)


def assign_req_to_token_pool_hook(
    original, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size, *args, **kw
):
    if _torch_path(req_to_token.device):
        n = int(batch_size)
        return assign_req_to_token_pool(
            req_pool_indices[:n], req_to_token, start_offset[:n], end_offset[:n], out_cache_loc
        )
    return original(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size, *args, **kw)


def allocate_token_bitmask_hook(original, vocab_size: int, batch_size: int) -> Tensor:
    """The grammar bitmask [batch_size, ceil(vocab_size / 32)] int32, all tokens allowed. SGLang 0.5.17 pins it
    unconditionally, which raises without an accelerator (a CPU server's scheduler dies on its first grammar request,
    ours or plain); like 0.5.23, pin it only where pinning exists."""
    if torch.cuda.is_available():
        return original(vocab_size, batch_size)
    from sglang.srt.constrained.xgrammar_backend import bitmask_dtype, get_bitmask_shape

    return torch.full(get_bitmask_shape(batch_size, vocab_size), -1, dtype=bitmask_dtype)


def apply_vocab_mask_hook(original, grammar, logits: Tensor, vocab_mask: Tensor) -> None:
    """Mask logits [rows, V] in place with the grammar bitmask [rows, ceil(V / 32)]. SGLang 0.5.17 has no CPU branch
    (it raises "Unsupported device: cpu"); on CPU use xgrammar's CPU kernel, as 0.5.23 does."""
    if logits.device.type != "cpu":
        return original(grammar, logits, vocab_mask)
    from xgrammar import apply_token_bitmask_inplace

    apply_token_bitmask_inplace(logits, vocab_mask, backend="cpu")
    return None


def kv_copy_warmup_hook(original, pool):
    """SGLang enables its KV-copy kernel for every speculative algorithm and warms it up with a Triton
    launch. DFLASH never moves KV (`move_kv_cache`), so on CPU the warm-up is skipped."""
    if _torch_path(pool.device):
        pool._kv_copy_config = None
        return None
    return original(pool)
