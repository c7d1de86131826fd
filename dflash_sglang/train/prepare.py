"""Build the feature cache: (optionally) regenerate responses with the target, and capture target features.

Regeneration matters: the drafter is evaluated on the target's own greedy continuations, so training on them
(not on the human-written ShareGPT replies) aligns the drafter with what it must predict (DFlash paper,
arXiv 2602.06036, section 4).
Greedy generation here captures the target layer outputs of every token while it decodes, so the regenerated
path needs no second feature pass: prefill yields the prompt rows and each decode step the new token's row.
Beside the fused layer features, every row also keeps the target's final hidden state (HF `hidden_states[-1]`,
after the final norm): the teacher's logits for logit distillation are then one lm_head matmul away, at the cost
of 1/n_feat more cache (objective.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..core.draft.features import target_layer_features
from .shards import Sequence_, iter_batches, list_shards, shard_path, write_shard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    """A training prompt: token ids (chat-templated) and an optional fixed response to use instead of regenerating."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...] | None = None


def _capture(hidden_states, layer_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """HF hidden_states -> (features [bs, T, F], final hidden state [bs, T, H]), float16 on the host."""
    feats = target_layer_features(hidden_states, layer_ids).to(torch.float16).cpu()
    return feats, hidden_states[-1].to(torch.float16).cpu()


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


@torch.no_grad()
def generate_with_features(
    target, prompts: Sequence[Sequence[int]], layer_ids: Sequence[int], max_new_tokens: int, eos_id: int
) -> list[Sequence_]:
    """Greedy-decode a batch of prompts, returning prompt+response tokens and their target features.

    The response ends at (and includes) the first EOS, so the drafter also learns to propose EOS.
    Features of the last generated token are never needed as context (no label follows it) and are
    taken from one final forward only if it would otherwise be missing.
    """
    from transformers import DynamicCache

    device = target.get_input_embeddings().weight.device
    ids, mask = _left_pad(prompts, eos_id)
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    cache = DynamicCache(config=target.config)
    out = target(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                 use_cache=True, output_hidden_states=True, logits_to_keep=1)
    f, h = _capture(out.hidden_states, layer_ids)
    feats, finals = [f], [h]
    bs = len(prompts)
    new_tokens: list[Tensor] = []
    done = torch.zeros(bs, dtype=torch.bool, device=device)
    next_pos = pos[:, -1] + 1
    tok = out.logits[:, -1].argmax(-1)
    for step in range(max_new_tokens):
        new_tokens.append(tok.cpu())
        done = done | (tok == eos_id)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, mask.new_ones(bs, 1)], dim=1)
        out = target(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                     past_key_values=cache, use_cache=True, output_hidden_states=True)
        f, h = _capture(out.hidden_states, layer_ids)
        feats.append(f)
        finals.append(h)
        next_pos = next_pos + 1
        tok = out.logits[:, -1].argmax(-1)
    gen = torch.stack(new_tokens, dim=1)  # [bs, G]
    all_feats = torch.cat(feats, dim=1)  # [bs, W + G - 1, F]: the last generated token has no features yet
    all_finals = torch.cat(finals, dim=1)  # [bs, W + G - 1, H]
    width = ids.shape[1]
    seqs = []
    for i, p in enumerate(prompts):
        row = gen[i].tolist()
        n = row.index(eos_id) + 1 if eos_id in row else len(row)
        rows = slice(width - len(p), width + n - 1)
        # The final token's rows are never used (no label follows it: no context, no teacher); pad with zeros.
        f, h = (torch.cat([x[i, rows], x.new_zeros(1, x.shape[2])], dim=0) for x in (all_feats, all_finals))
        tokens = torch.tensor(list(p) + row[:n], dtype=torch.long)
        seqs.append(Sequence_(tokens, len(p), f, h))
    return seqs


@torch.no_grad()
def forward_features(target, examples: Sequence[Example], layer_ids: Sequence[int], pad_id: int) -> list[Sequence_]:
    """Target features for fixed prompt+response sequences (the no-regeneration path), one batched forward."""
    rows = [list(e.prompt_ids) + list(e.response_ids or ()) for e in examples]
    device = target.get_input_embeddings().weight.device
    ids, mask = _left_pad(rows, pad_id)
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    out = target(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                 output_hidden_states=True, logits_to_keep=1)
    feats, finals = _capture(out.hidden_states, layer_ids)
    width = ids.shape[1]
    return [
        Sequence_(torch.tensor(r, dtype=torch.long), len(e.prompt_ids), feats[i, width - len(r):],
                  finals[i, width - len(r):])
        for i, (r, e) in enumerate(zip(rows, examples))
    ]


def build_cache(
    target,
    examples: Sequence[Example],
    cache_dir: Path,
    layer_ids: Sequence[int],
    *,
    regenerate: bool,
    max_new_tokens: int,
    eos_id: int,
    batch_size: int = 64,
    time_budget_s: float | None = None,
    progress: bool = True,
) -> int:
    """Fill `cache_dir` with shards of `batch_size` examples; resumes after the last complete shard.

    Examples are sorted by prompt length first so each batch pads little. `time_budget_s` stops
    regeneration early (complete shards are kept) so CPU runs can bound the data-preparation time.
    Returns the number of shards present.
    """
    from tqdm import tqdm

    cache_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].prompt_ids), i))
    batches = list(iter_batches(order, batch_size))
    # Visit the (length-homogeneous) batches in a fixed shuffled order, so a run cut short by the time budget
    # still covers short and long prompts alike.
    visit = torch.randperm(len(batches), generator=torch.Generator().manual_seed(0)).tolist()
    done = {p.name for p in list_shards(cache_dir)}
    start = time.monotonic()
    bar = tqdm(total=len(batches), desc="regenerate+features" if regenerate else "features", disable=not progress)
    for k in visit:
        idx = batches[k]
        bar.update(1)
        path = shard_path(cache_dir, k)
        if path.name in done:
            continue
        if time_budget_s is not None and time.monotonic() - start > time_budget_s:
            log.warning("data budget of %.0fs reached after %d/%d shards", time_budget_s, k, len(batches))
            break
        batch = [examples[i] for i in idx]
        if regenerate:
            seqs = generate_with_features(target, [e.prompt_ids for e in batch], layer_ids, max_new_tokens, eos_id)
        else:
            seqs = forward_features(target, batch, layer_ids, eos_id)
        write_shard(path, seqs, layer_ids, {"regenerated": regenerate, "examples": idx})
    bar.close()
    return len(list_shards(cache_dir))
