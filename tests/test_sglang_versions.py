"""The version seam's feature probes (adapter/versions.py), on whatever SGLang release is installed: each probe must
agree with what the module it names actually has or does, observed another way than the probe's own. Run on every
release of the range (scripts/check_sglang.sh VERSION, .ci/run's rotation), they show the seam picks each release's
form by what it has, never by its version string.

Importing sglang changes the process it runs in, so the checks run in a child pytest process (as the plugin
suite's do); the parent's only test starts it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang_support import REPO, in_child_env, requires_sglang

pytestmark = requires_sglang
IN_CHILD = os.environ.get("DFLASH_SGLANG_TEST_CHILD") == "1"
child_only = pytest.mark.skipif(not IN_CHILD, reason="runs in the child process of test_probes_in_a_child_process")


@pytest.mark.skipif(IN_CHILD, reason="this is the child")
def test_probes_in_a_child_process(tmp_path):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path), __file__]
    proc = subprocess.run(cmd, env={**in_child_env(), "DFLASH_SGLANG_TEST_CHILD": "1"}, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in summary and "failed" not in summary, summary


@child_only
def test_the_version_string_only_admits():
    """The installed release is in the admitted range, and the seam's switches are its probes: versions.py compares
    no version string beyond the gate."""
    from importlib.metadata import version

    from dflash_sglang.adapter import versions

    assert versions.SGLANG_VERSION == version("sglang") in versions.SUPPORTED
    assert versions.SUPPORTED == tuple(f"0.5.{n}" for n in range(17, 24))
    source = Path(versions.__file__).read_text()
    assert "SGLANG_VERSION ==" not in source and "SGLANG_VERSION !=" not in source
    assert all(callable(getattr(versions, name)) for name in versions.PROBES)


@child_only
def test_sealed_resolution_agrees_with_the_resolution_api():
    """A sealed record (`resolve_once`) comes with `declare_resolution` / `resolution_result` and without
    `ServerArgs.get_model_config`; the unsealed form is the other way round."""
    from sglang.srt.arg_groups import overrides
    from sglang.srt.server_args import ServerArgs

    from dflash_sglang.adapter.versions import sealed_resolution

    sealed = sealed_resolution()
    assert hasattr(overrides, "declare_resolution") == sealed
    assert hasattr(overrides, "resolution_result") == sealed
    assert hasattr(ServerArgs, "get_model_config") == (not sealed)


@child_only
def test_the_acc_len_sampler_is_the_one_spec_utils_has():
    """Exactly one of the two spellings exists, the probe names it, and the seam's sampler draws through it."""
    from sglang.srt.speculative import spec_utils

    from dflash_sglang.adapter.versions import public_acc_len_sampler, sample_simulated_acc_len

    public, private = (hasattr(spec_utils, n) for n in ("sample_simulated_acc_len", "_sample_simulated_acc_len"))
    assert (public, private) == (public_acc_len_sampler(), not public_acc_len_sampler())
    assert 1 <= sample_simulated_acc_len(3.0, "match-expected", 8) <= 8


def _req(max_new_tokens: int, stop_ids: list[int], eos_ids: set[int]):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
    params.normalize(None)
    req = Req("r", "", [1, 2, 3], params, eos_token_ids=eos_ids)
    req.vocab_size = 16  # set by the scheduler
    return req


@child_only
def test_stops_before_cap_agrees_with_update_finish_state():
    """One commit of 5 tokens reaching max_new_tokens 5 with a stop token (7) in the middle: the unhooked
    `Req.update_finish_state` ends it at the stop where the probe says stops come first, else by length (the form
    `finish_like_plain` is registered for)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    from dflash_sglang.adapter.versions import FINISH_STATE, finish_like_plain, stops_before_cap, version_hooks

    req = _req(5, [7], {2})
    req.output_ids = [5, 6, 7, 8, 9]
    req.update_finish_state(5)
    assert isinstance(req.finished_reason, FINISH_LENGTH) == (not stops_before_cap())
    assert version_hooks() == (() if stops_before_cap() else ((FINISH_STATE, finish_like_plain),))


@child_only
def test_min_new_tokens_stop_ids_are_what_the_penalizer_masks():
    """The ids the seam says min_new_tokens holds back for a request are exactly those SGLang's penalizer masks for
    it (its generation-config EOS 3 included where `min_new_tokens_holds_eos`)."""
    import torch
    from sglang.srt.sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer

    from dflash_sglang.adapter.versions import min_new_tokens_holds_eos, min_new_tokens_stop_ids

    vocab = 16
    req = _req(8, [7], {3})
    req.sampling_params.min_new_tokens = 2
    req.tokenizer = SimpleNamespace(additional_stop_token_ids={9}, eos_token_id=5)

    class Orchestrator:  # (held by weak reference)
        device, vocab_size = "cpu", vocab

        @staticmethod
        def reqs():
            return [req]

    orchestrator = Orchestrator()
    penalizer = BatchedMinNewTokensPenalizer(orchestrator)
    penalizer._prepare()
    masked = tuple(torch.isinf(penalizer.stop_token_penalties[0]).nonzero().flatten().tolist())
    assert masked == min_new_tokens_stop_ids(req)
    assert (3 in masked) == min_new_tokens_holds_eos()


@child_only
def test_signature_probes_agree_with_the_functions():
    """The hidden-states mode and the CPU threads binding: what the probes say matches each function's parameters,
    and the seam's hidden-states call runs with them."""
    import inspect

    from sglang.srt.model_executor import forward_batch_info
    from sglang.srt.utils import numa_utils

    from dflash_sglang.adapter.versions import cpu_bind_entry_per_rank, hidden_mode_reads_server_args

    mode_params = list(inspect.signature(forward_batch_info.get_server_return_hidden_states_mode).parameters)
    assert mode_params == (["server_args"] if hidden_mode_reads_server_args() else [])
    bind_params = list(inspect.signature(numa_utils.init_threads_binding).parameters)
    assert bind_params == (["numa_index", "world_size"] if cpu_bind_entry_per_rank() else ["tp_rank", "tp_size"])


@child_only
def test_field_and_module_probes_agree_with_the_release():
    """`attn_dp_size` is a field of a built record where the probe says so; the tracking grid and the DFLASH PD
    builder exist where their probes say (and SpeculativeAlgorithm's PD dispatch names the builder only there); the
    ForwardBatch takes coordinated DP-attention counts where our worker's DP attention is served; a HiCache draft
    sidecar's host pool is built from the pool's buffer description where our draft pool is offloaded."""
    import inspect

    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from dflash_sglang.adapter.versions import has_attn_dp_size, has_mamba_track_grid, pd_disaggregation_supported

    fields = getattr(ServerArgs, "__struct_fields__", None) or ServerArgs.__dataclass_fields__
    assert ("attn_dp_size" in fields) == has_attn_dp_size()
    assert callable(getattr(runtime_context, "mamba_track_grid", None)) == has_mamba_track_grid()
    dispatch = inspect.getsource(SpeculativeAlgorithm.build_disagg_draft_input)
    assert ("build_dflash_disagg_draft_input" in dispatch) == pd_disaggregation_supported()
    # DP attention: the ForwardBatch reads coordinated counts from the ScheduleBatch (not rescaled where set)
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from dflash_sglang.adapter.versions import attention_dp_served

    from sglang.srt.layers import dp_attention

    coordinated = "dp_spec_prefill_coordination_applied" in inspect.getsource(ForwardBatch)
    # the attention-TP group arrives with 0.5.23 (0.5.21 and 0.5.22 have the coordinated counts and get_parallel,
    # but their ParallelContext says nothing of whether attention DP is on)
    assert attention_dp_served() == (coordinated and callable(getattr(runtime_context, "get_parallel", None))
                                     and callable(getattr(dp_attention, "get_dp_tp_group", None)))
    # HiCache: a draft sidecar's MHA host pool is built from the pool's buffer description (adapter/scale/hicache.py)
    import importlib.util

    from dflash_sglang.adapter.versions import hicache_draft_served

    assembler = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
    from_info = False
    if importlib.util.find_spec(assembler) is not None:
        module = importlib.import_module(assembler)
        inputs = getattr(module, "_mha_host_inputs", None)
        from_info = (hasattr(module, "build_full_draft_pools") and inputs is not None
                     and "get_device_pool_infos()[0].buffer_info" in inspect.getsource(inputs))
    assert hicache_draft_served() == from_info


@child_only
def test_req_kv_info_agrees_with_the_request_and_its_offload():
    """Where the probe says a request keeps its req_to_token row in `req.kv`, SGLang's own retraction offload reads it
    there (else on the request); `req_pool_index` reads the row either way."""
    import inspect

    from sglang.srt.managers.schedule_batch import Req

    from dflash_sglang.adapter.versions import req_kv_info, req_pool_index

    req = _req(4, [], set())
    offload = inspect.getsource(Req.offload_kv_cache)
    assert ("self.kv.req_pool_idx" in offload) == req_kv_info()
    assert ("self.req_pool_idx" in offload) == (not req_kv_info())
    if req_kv_info():
        req.kv.req_pool_idx = 3
    else:
        req.req_pool_idx = 3
    assert req_pool_index(req) == 3


@child_only
def test_draft_kv_dtype_reading_follows_the_parser():
    """`has_draft_kv_cache_dtype` agrees with SGLang's parser (the flag a user types), and the seam reads the draft
    flag where it exists and is set, else --kv-cache-dtype."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from dflash_sglang.adapter.versions import draft_kv_cache_dtype, has_draft_kv_cache_dtype

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    has = any("--speculative-draft-kv-cache-dtype" in a.option_strings for a in parser._actions)
    assert has_draft_kv_cache_dtype() == has
    view = SimpleNamespace(kv_cache_dtype="fp8_e4m3", speculative_draft_kv_cache_dtype="bf16")
    assert draft_kv_cache_dtype(view) == (("--speculative-draft-kv-cache-dtype", "bf16") if has
                                          else ("--kv-cache-dtype", "fp8_e4m3"))
    assert draft_kv_cache_dtype(SimpleNamespace(kv_cache_dtype="fp8_e5m2", speculative_draft_kv_cache_dtype=None)) \
        == ("--kv-cache-dtype", "fp8_e5m2")
