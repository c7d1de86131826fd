"""Target verify of a draft block inside SGLang, and acceptance with the core rules.

The verify is SGLang's own TARGET_VERIFY forward (all B rows get logits; causal over the committed
prefix plus the block; features captured at the draft's layer ids), planned exactly like the builtin
DFLASH does it. SGLang's torch_native backend (the CPU path) has no TARGET_VERIFY planning: it reads the
block as an extend of B tokens on top of the prefix, so we give it those lengths.

Acceptance is `dflash_sglang.core.accept`: greedy longest-prefix match, or lossless rejection sampling of
point-mass drafts against the target's temperature/top-k/top-p(/min-p) distribution.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflash_sglang.core.accept import AcceptResult, SamplingParams, greedy_accept, rejection_accept, target_probs

if TYPE_CHECKING:
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker


def run_target_verify(
    target_worker: TpModelWorker, batch: ScheduleBatch, ids: Tensor, positions: Tensor, slots: Tensor
) -> tuple[LogitsProcessorOutput, bool]:
    """TARGET_VERIFY forward of `ids` [bs, B] at `positions` [bs, B], writing target KV to `slots` [bs, B].

    `batch.seq_lens` holds the committed lengths (the block starts there). Mutates batch.input_ids /
    spec_info / forward_mode / out_cache_loc the way SGLang's own verify does; the scheduler's forward
    isolation restores them. Returns (logits output with next_token_logits [bs*B, V] and hidden_states
    [bs*B, n_features*H], can_run_cuda_graph).
    """
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    bs, block = ids.shape
    verify_input = DFlashVerifyInput(
        draft_token=ids.reshape(-1),
        positions=positions.reshape(-1),
        draft_token_num=block,
        custom_mask=None,  # a chain: plain causal attention
        capture_hidden_mode=CaptureHiddenMode.FULL,
    )
    batch.out_cache_loc = slots.reshape(-1)
    # Host-side length bounds used for planning: committed prefix + one block (as the builtin does).
    seq_lens_cpu, seq_lens_sum = batch.seq_lens_cpu, batch.seq_lens_sum
    if seq_lens_cpu is not None:
        batch.seq_lens_cpu = seq_lens_cpu + block
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    try:
        forward_batch, _ = verify_input.prepare_for_verify(batch, target_worker)
    finally:
        batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu, seq_lens_sum
    runner = target_worker.model_runner
    if isinstance(runner.attn_backend, TorchNativeAttnBackend):
        prefix = forward_batch.seq_lens
        forward_batch.extend_prefix_lens = prefix
        forward_batch.extend_seq_lens = torch.full_like(prefix, block)
        forward_batch.seq_lens = prefix + block
    forward_batch.mark_forward_metadata_ready()
    out = target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True)
    return out.logits_output, bool(out.can_run_cuda_graph)


def sampling_params(sampling_info, bs: int) -> SamplingParams | None:
    """SGLang's per-request SamplingBatchInfo -> core SamplingParams, or None when every request is greedy.

    SGLang encodes greedy as top_k == 1 (temperature 0 is rewritten to top_k 1) and "no top-k" as a
    huge top_k.
    """
    if sampling_info is None or sampling_info.is_all_greedy:
        return None
    top_k = sampling_info.top_ks.reshape(bs).to(torch.int64)
    greedy = top_k <= 1
    vocab = sampling_info.vocab_size
    temperature = torch.where(greedy, 0.0, sampling_info.temperatures.reshape(bs).float())
    top_k = torch.where((top_k >= vocab) | greedy, 0, top_k)
    return SamplingParams(temperature, top_k, sampling_info.top_ps.reshape(bs).float())


def _apply_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the row's max, renormalise. probs [bs, B, V]."""
    floor = min_p[:, None, None] * probs.amax(-1, keepdim=True)
    kept = torch.where(probs >= floor, probs, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def accept_block(
    drafts: Tensor, logits: Tensor, params: SamplingParams | None, sampling_info=None
) -> AcceptResult:
    """drafts [bs, B-1] int64, logits [bs, B, V] (row j predicts the token after block row j).

    params None: greedy. Otherwise rejection sampling with uniforms from torch's default generator
    (seeded by SGLang's --random-seed).
    """
    if params is None:
        return greedy_accept(drafts, logits.argmax(-1))
    probs = target_probs(logits, params)
    if sampling_info is not None and getattr(sampling_info, "need_min_p_sampling", False):
        probs = _apply_min_p(probs, sampling_info.min_ps.reshape(-1).float())
    bs, n_draft = drafts.shape
    u = torch.rand(bs, n_draft + 1, device=logits.device)
    return rejection_accept(drafts, probs, u[:, :n_draft], u[:, n_draft])
