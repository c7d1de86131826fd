"""ctypes mirrors of the params structs in cuda/*.cuh, and tensor -> ABI conversion.

Field order and types must match the C structs exactly (every scalar is int64, every pointer 8 bytes);
_lib.py compares ctypes.sizeof against the library's `dflash_<op>_params_size()` before the first call.
"""
from __future__ import annotations

import ctypes
from ctypes import c_int64, c_void_p

import torch
from torch import Tensor


class IndexView(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("bytes", c_int64)]


class BlockInputsParams(ctypes.Structure):
    _fields_ = [
        ("tokens", IndexView), ("depth", IndexView), ("seq_lens", IndexView),
        ("req_pool_indices", IndexView), ("req_to_token", c_void_p), ("req_to_token_stride", c_int64),
        ("req_to_token_rows", c_int64), ("bs", c_int64), ("n", c_int64),
        ("input_ids", c_void_p), ("positions", c_void_p), ("out_cache_loc", c_void_p),
    ]


class BuildTreeParams(ctypes.Structure):
    _fields_ = [
        ("root", IndexView), ("topk_tokens", c_void_p), ("topk_logp", c_void_p),
        ("bs", c_int64), ("depth", c_int64), ("k", c_int64), ("n", c_int64),
        ("tokens", c_void_p), ("parent", c_void_p), ("node_depth", c_void_p), ("score", c_void_p),
        ("mask", c_void_p), ("retrive_index", c_void_p), ("retrive_next_token", c_void_p),
        ("retrive_next_sibling", c_void_p),
    ]


class VerifyTreeParams(ctypes.Structure):
    _fields_ = [
        ("tokens", c_void_p), ("parent", c_void_p), ("bs", c_int64), ("n", c_int64), ("max_depth", c_int64),
        ("target_argmax", IndexView), ("target_probs", c_void_p), ("coins", c_void_p), ("resample_u", c_void_p),
        ("vocab", c_int64), ("sequential_sampler", c_int64), ("out_cache_loc", IndexView),
        ("accept_len", c_void_p), ("accept_nodes", c_void_p), ("out_tokens", c_void_p), ("bonus", c_void_p),
        ("commit_loc", c_void_p), ("free_loc", c_void_p),
    ]


class DraftLayoutParams(ctypes.Structure):
    _fields_ = [
        ("kv_indptr", c_void_p), ("req_pool_indices", IndexView), ("req_to_token", c_void_p),
        ("req_to_token_stride", c_int64), ("req_to_token_rows", c_int64), ("scratch_base", c_int64),
        ("block", c_int64), ("bs", c_int64), ("capacity", c_int64), ("kv_indices", c_void_p),
        ("seq_lens", IndexView), ("ring", c_int64),
    ]


PARAMS = {"index_view": IndexView, "block_inputs": BlockInputsParams, "build_tree": BuildTreeParams,
          "verify_tree": VerifyTreeParams, "draft_layout": DraftLayoutParams}

INDEX_DTYPES = (torch.int32, torch.int64)


def ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def index_view(t: Tensor | None) -> IndexView:
    return IndexView(None, 0) if t is None else IndexView(t.data_ptr(), t.element_size())


def check_inputs(device: torch.device, **tensors: tuple[Tensor | None, tuple[torch.dtype, ...]]) -> None:
    """ValueError unless every given tensor lives on `device`, is contiguous and has an allowed dtype."""
    for name, (t, dtypes) in tensors.items():
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def check_out(name: str, t: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """Destination buffers are written in place, so they must match exactly (no silent reallocation)."""
    if tuple(t.shape) != shape or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name} must be [{', '.join(map(str, shape))}] {str(dtype).removeprefix('torch.')} "
                         f"contiguous on {device}, got {list(t.shape)} {t.dtype} on {t.device}")
