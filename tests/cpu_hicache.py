"""SGLang 0.5.23's HiCache on CPU, for the tests only (never shipped; a GPU runs SGLang as it is).

Plain `--enable-hierarchical-cache` does not run on SGLang's CPU path (`device="cpu"`, torch_native attention) in two
places, both in the host pools (`sglang/srt/mem_cache/pool_host/`), and SGLang has no CPU form of either:
- `common.py` `ALLOC_MEMORY_FUNCS` (line 453) has no "cpu" entry, so a host pool whose device is the CPU is allocated by
  `alloc_with_host_register` (line 330), which pins it with `cudaHostRegister` (`_cuda_host_register`,
  `torch.cuda.cudart()`, line 147): "Torch not compiled with CUDA enabled" when the tree cache is built;
- `mha.py` binds the host <-> device copy ops (`sgl_kernel.kvcacheio`, CUDA kernels) only `if _is_cuda or _is_hip`
  (line 60), so the first transfer of `--hicache-io-backend direct --hicache-mem-layout layer_first` (the one layout
  whose copies are plain row gathers, `transfer_kv_direct`) raises NameError.
`patch()` puts a plain (unpinned) allocation and a torch row copy in those two places, in every process of an Engine
(tests/test_sglang_e2e.py `apply_cpu_patches`, when HICACHE_ENV is set in the job's environment: in the Engine's child
forked from the zygote, whose processes inherit it, and in spawned schedulers, which import that module). Everything
else HiCache does (the radix tree's host tier, write-through backups, loads per transfer stage, the draft sidecar of
adapter/scale/hicache.py) is SGLang's own code. With it a plain HiCache Engine gives the tokens a plain Engine without
HiCache gives, on prompts whose prefixes come back from host memory.
"""
from __future__ import annotations

HICACHE_ENV = "DFLASH_TEST_CPU_HICACHE"
# The Engine settings the stand-ins cover (SGLang's defaults, `kernel` / `layer_first`, call CUDA kernels)
CPU_HICACHE = {"enable_hierarchical_cache": True, "hicache_io_backend": "direct", "hicache_mem_layout": "layer_first"}


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size: int) -> None:
    """`sgl_kernel.kvcacheio.transfer_kv_direct` on the CPU: each layer's rows src[src_indices] -> dst[dst_indices]
    (layers [rows, heads, dim]; indices [n] int64 token slots, whole pages of `page_size`)."""
    assert src_indices.numel() == dst_indices.numel() and src_indices.numel() % page_size == 0
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    """`alloc_with_host_register` without the CUDA host registration (there is no device to pin for)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def patch() -> None:
    from sglang.srt.mem_cache.pool_host import common, mha

    common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned
    mha.transfer_kv_direct = transfer_kv_direct
