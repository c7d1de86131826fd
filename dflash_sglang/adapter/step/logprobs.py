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


def predicting_rows(accept_nodes: Tensor | None, bs: int, n: int, m: int, device) -> Tensor:
    """[bs, m] int64: the verify row (0..n-1) whose logits predicted each of the first m committed token slots.

    accept_nodes [bs, D+1] (a tree's accepted path, root first, then -1) or None (a chain: row j predicts token j).
    Slots past the committed tokens get row 0 (their values are never read).
    """
    if accept_nodes is None:
        rows = torch.arange(m, device=device).clamp_max(n - 1).expand(bs, m)
    else:
        rows = accept_nodes[:, :m].clamp_min(0)
        if rows.shape[1] < m:
            rows = torch.cat([rows, rows.new_zeros(bs, m - rows.shape[1])], dim=1)
    return rows.contiguous()


def step_logprobs(logits: Tensor, rows: Tensor, sampling_info) -> Tensor:
    """logits [bs, n, V] (as sampled from), rows [bs, m] (`predicting_rows`) -> the log-probability distributions
    [bs, m, V] float32 of each committed token slot."""
    from sglang.srt.layers.sampler import SGLANG_RETURN_ORIGINAL_LOGPROB

    gathered = logits.gather(1, rows[:, :, None].expand(-1, -1, logits.shape[-1])).float()
    if not (sampling_info.is_all_greedy or SGLANG_RETURN_ORIGINAL_LOGPROB):
        gathered = gathered / sampling_info.temperatures.reshape(-1, 1, 1).float()
    logprobs = torch.log_softmax(gathered, dim=-1)
    return logprobs.clamp_(min=torch.finfo(logprobs.dtype).min)


def attach_logprobs(batch, logits_output, logits: Tensor, tokens: Tensor, accept_nodes: Tensor | None) -> None:
    """Write the step's logprobs into SGLang's LogitsProcessorOutput the way its result processor reads them.

    logits [bs, n, V], tokens [bs, N] int64 (committed tokens, then -1: the result rows), accept_nodes as in
    `predicting_rows`. A step commits at most n tokens per request (a chain's rows, a tree path's nodes), so only
    m = min(n, N) distributions per request are computed: a plain step under the goodput controller (n = 1, N = the
    block) costs one log_softmax per request, as plain decoding's, not N. Slots past m are never read by the
    scheduler: their logprob is 0 and their top / asked-id lists empty.
    """
    from sglang.srt.layers.logprob_processor import get_token_ids_logprobs, get_top_logprobs

    bs, n, vocab = logits.shape
    max_nodes = tokens.shape[1]  # N: the result row stride
    m = min(n, max_nodes)
    logprobs = step_logprobs(logits, predicting_rows(accept_nodes, bs, n, m, logits.device), batch.sampling_info)
    picked = logprobs.gather(2, tokens[:, :m].clamp_min(0)[:, :, None]).squeeze(2)  # [bs, m]
    logits_output.next_token_logprobs = torch.nn.functional.pad(picked, (0, max_nodes - m))
    flat = logprobs.view(bs * m, vocab)
    if batch.top_logprobs_nums and any(k > 0 for k in batch.top_logprobs_nums):
        vals, idxs = get_top_logprobs(flat, [k for k in batch.top_logprobs_nums for _ in range(m)],
                                      no_copy_to_cpu=True)
        logits_output.next_token_top_logprobs_val = _strided(vals, bs, m, max_nodes, flat)
        logits_output.next_token_top_logprobs_idx = _strided(idxs, bs, m, max_nodes, flat, torch.int64)
    if batch.token_ids_logprobs and any(ids is not None for ids in batch.token_ids_logprobs):
        vals, idxs = get_token_ids_logprobs(flat, [t for t in batch.token_ids_logprobs for _ in range(m)],
                                            no_copy_to_cpu=True)
        logits_output.next_token_token_ids_logprobs_val = _strided(vals, bs, m, max_nodes, flat)
        logits_output.next_token_token_ids_logprobs_idx = _strided(idxs, bs, m, max_nodes, None)


def _strided(rows: list, bs: int, m: int, max_nodes: int, like: Tensor | None, dtype=None) -> list:
    """Per-slot entries of bs requests x m slots -> bs x N (N = max_nodes, the row stride: flat index i * N + j, as the
    scheduler reads them), the unread slots past m empty: an empty tensor (SGLang calls .tolist() on every entry) or
    list."""
    if m == max_nodes:
        return rows
    empty = [] if like is None else like.new_empty((0,), dtype=dtype)
    out = []
    for i in range(bs):
        out += rows[i * m:(i + 1) * m]
        out += [empty] * (max_nodes - m)
    return out
