"""Torch stand-ins for the SGLang helpers that the speculative path launches as Triton kernels.

SGLang 0.5.17 runs speculative decoding on CPU only with its `sgl_kernel` CPU build
(SGLANG_USE_CPU_ENGINE=1), which is not on PyPI. A plain `--device cpu` server still takes the GPU
branch of a few helpers on the DFLASH path; the plugin hooks them (AROUND) so that CPU tensors go
through the plain-torch versions here and everything else reaches SGLang's own code unchanged.
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
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = request i's run of out_cache_loc (runs concatenated)."""
    lengths = (end_offset - start_offset).tolist()
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


def kv_copy_warmup_hook(original, pool):
    """SGLang enables its KV-copy kernel for every speculative algorithm and warms it up with a Triton
    launch. DFLASH never moves KV (`move_kv_cache`), so on CPU the warm-up is skipped."""
    if _torch_path(pool.device):
        pool._kv_copy_config = None
        return None
    return original(pool)
