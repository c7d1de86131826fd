"""SGLang 0.5.23's DP attention on CPU, for the tests only (never shipped; a GPU runs SGLang as it is).

Plain `--attn-dp-size 2 --tp 2` does not run on SGLang's CPU path (`device="cpu"` without SGLANG_USE_CPU_ENGINE, the
torch_native backend) in four places, each a CUDA-only form beside which SGLang has its own CPU form, picked by a
module-level `_is_cpu`: `forward_batch_info` (pinned memory for the gathered row counts; the padded rows' seq-len fill
value, which TorchNativeAttnBackend does not define), `dp_attention.memcpy_func` (a Triton copy), and `parallel_state`
(the `sglang::reg_all_gather_into_tensor` custom op, registered for CUDA only). `patch()` selects SGLang's CPU forms
there, in every process of an Engine (tests/test_sglang_e2e.py `apply_cpu_patches`, when DP_ATTENTION_ENV is set in
the job's environment: in the Engine's child forked from the zygote, whose processes inherit it, and in spawned
schedulers, which import that module). With it a plain DP-attention Engine on the tiny Qwen3 pair gives HF greedy's
tokens, the reference our DFLASH Engines are held to.
"""
from __future__ import annotations

DP_ATTENTION_ENV = "DFLASH_TEST_CPU_DP_ATTENTION"


def patch() -> None:
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor import forward_batch_info

    forward_batch_info._is_cpu = True
    parallel_state._is_cpu = True
    dp_attention.memcpy_func = dp_attention.memcpy_cpu
    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        # a padded (absent) request's seq len: 1, as SGLang's CUDA backends fill theirs
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1
