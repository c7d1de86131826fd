"""Log-probabilities of the tokens a decode step commits, from the target's verify logits.

What SGLang's plain sampler returns for a decode step, per committed token: log_softmax of the (bias-adjusted)
logits, divided by each request's temperature unless the whole batch is greedy (`layers/sampler.py`; with
`SGLANG_RETURN_ORIGINAL_LOGPROB` the unscaled ones), plus the top-k and the requested token ids of that distribution.
A verify row's logits are exactly the logits plain decoding computes at that position (same prefix), so the
committed token j of a request gets the logits of the verify row that predicted it: row j of a chain, the j-th node
of a tree's accepted path (its root predicts the first). The scheduler reads them per request in rows of the result
stride N (`next_token_logprobs` [bs, N], top lists flat with index i * N + j), as for its own speculative workers.
"""
from __future__ import annotations

import torch
from torch import Tensor


def predicting_rows(accept_nodes: Tensor | None, bs: int, n: int, stride: int, device) -> Tensor:
    """[bs, stride] int64: the verify row (0..n-1) whose logits predicted each committed token slot.

    accept_nodes [bs, D+1] (a tree's accepted path, root first, then -1) or None (a chain: row j predicts token j).
    Slots past the committed tokens get row 0 (their values are never read).
    """
    if accept_nodes is None:
        rows = torch.arange(stride, device=device).clamp_max(n - 1).expand(bs, stride)
    else:
        rows = accept_nodes[:, :stride].clamp_min(0)
        if rows.shape[1] < stride:
            rows = torch.cat([rows, rows.new_zeros(bs, stride - rows.shape[1])], dim=1)
    return rows.contiguous()


def step_logprobs(logits: Tensor, rows: Tensor, sampling_info) -> Tensor:
    """logits [bs, n, V] (as sampled from), rows [bs, N] (`predicting_rows`) -> the log-probability distributions
    [bs, N, V] float32 of each committed token slot."""
    from sglang.srt.layers.sampler import SGLANG_RETURN_ORIGINAL_LOGPROB

    gathered = logits.gather(1, rows[:, :, None].expand(-1, -1, logits.shape[-1])).float()
    if not (sampling_info.is_all_greedy or SGLANG_RETURN_ORIGINAL_LOGPROB):
        gathered = gathered / sampling_info.temperatures.reshape(-1, 1, 1).float()
    logprobs = torch.log_softmax(gathered, dim=-1)
    return logprobs.clamp_(min=torch.finfo(logprobs.dtype).min)


def attach_logprobs(batch, logits_output, logits: Tensor, tokens: Tensor, accept_nodes: Tensor | None) -> None:
    """Write the step's logprobs into SGLang's LogitsProcessorOutput the way its result processor reads them.

    logits [bs, n, V], tokens [bs, N] int64 (committed tokens, then -1: the result rows), accept_nodes as in
    `predicting_rows`.
    """
    from sglang.srt.layers.logprob_processor import get_token_ids_logprobs, get_top_logprobs

    bs, n, vocab = logits.shape
    stride = tokens.shape[1]
    logprobs = step_logprobs(logits, predicting_rows(accept_nodes, bs, n, stride, logits.device), batch.sampling_info)
    logits_output.next_token_logprobs = logprobs.gather(2, tokens.clamp_min(0)[:, :, None]).squeeze(2)
    flat = logprobs.view(bs * stride, vocab)
    if batch.top_logprobs_nums and any(k > 0 for k in batch.top_logprobs_nums):
        nums = [k for k in batch.top_logprobs_nums for _ in range(stride)]
        logits_output.next_token_top_logprobs_val, logits_output.next_token_top_logprobs_idx = get_top_logprobs(
            flat, nums, no_copy_to_cpu=True)
    if batch.token_ids_logprobs and any(ids is not None for ids in batch.token_ids_logprobs):
        ids = [t for t in batch.token_ids_logprobs for _ in range(stride)]
        logits_output.next_token_token_ids_logprobs_val, logits_output.next_token_token_ids_logprobs_idx = (
            get_token_ids_logprobs(flat, ids, no_copy_to_cpu=True))
