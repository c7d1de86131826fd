"""Tensor parallelism (`--tp-size N`) in our worker: layout and the two collectives a decode step adds.

Layout: the drafter is replicated on every rank (a few hundred MB at most for published drafts, against a target
that needs TP), with its draft KV pool per rank, and runs the same pass on every rank; the target's embedding
(all-reduced inside SGLang's VocabParallelEmbedding) and its vocab-parallel lm_head are borrowed as on one rank.
So the draft pass's logits on rank r cover only r's vocabulary shard, and the step adds:

1. the proposal merge (core/step/vocab_parallel.py): per draft position each rank's k best candidates and its
   log-sum-exp are all-gathered (k + 1 numbers instead of the shard's logits) and merged to the exact full-vocabulary
   argmax (a chain) or top-k with log-probabilities (a tree, `top_logprobs`); a DFlash2 selector's candidates are the
   merged top-k logits (k numbers, `top_logits`), which every rank then scores alike: the selector (hidden_projection,
   the [V, r] codebooks) is part of the replicated drafter, so every rank walks the same chain and grows the same tree
   (a sampled walk's uniforms from a generator seeded alike on every rank, adapter/step/startup.py);
2. the accept decision broadcast from TP rank 0, so every rank commits the same tokens and KV slots whatever the
   floating-point details of its sampler (the target's verify logits are all-gathered by SGLang and identical).

The draft pass's CUDA graph covers the local logits; the merge runs after its replay. Under DP attention "every rank"
means the ranks sharing a batch (the attention-TP group; adapter/scale/dp_attention.py), never other groups' ranks.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from dflash_sglang.core.step.vocab_parallel import (
    VocabShard,
    local_candidates,
    local_ranks,
    local_top,
    merge_candidates,
    merge_top,
)


class DraftVocab:
    """This rank's rows of the target lm_head for the draft vocabulary, and the merge over ranks."""

    def __init__(self, lm_head, draft_vocab: int, token_map: Tensor | None = None) -> None:
        """lm_head: the target's (Parallel)LMHead or tied VocabParallelEmbedding; draft_vocab: the draft's vocab size
        (its ids are the target's first draft_vocab ids); token_map [K] int64: a reduced draft vocabulary (the draft
        proposes only those ids, core/draft/token_map.py), None: all draft_vocab ids."""
        from ..versions import attention_tp_group

        self.group = attention_tp_group()  # the ranks sharing this batch (under DP attention: its group's, tp.py)
        indices = getattr(lm_head, "shard_indices", None)
        start, stop = 0, draft_vocab
        if self.group.world_size > 1 and indices is not None:
            start, stop = int(indices.org_vocab_start_index), min(int(indices.org_vocab_end_index), draft_vocab)
        weight = lm_head.weight
        if token_map is None:
            self.shard = VocabShard(start, max(stop - start, 0))
            self.weight: Tensor = weight[: max(self.shard.size, 1)]  # [rows, H]: at least one (no zero-row matmul)
            return
        ids = token_map.to(weight.device)
        ids = ids[(ids >= start) & (ids < stop)]
        self.shard = VocabShard(start, ids.numel(), ids)
        self.weight = weight[ids - start] if ids.numel() else weight[:1]  # [K_local, H]

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def top_logprobs(self, logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Local draft logits [bs, D, rows] -> (token ids [bs, D, k] int64, log-probs [bs, D, k] float32) over the
        whole vocabulary (k = 1: the argmax)."""
        return merge_candidates(*self._over_ranks(local_candidates(logits, self.shard, k)), k)

    def top_logits(self, logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Local draft logits [bs, D, rows] -> (token ids [bs, D, k] int64, logits [bs, D, k] float32): the k best over
        the whole draft vocabulary, ties to the lowest id (a DFlash2 selector's candidates, core/draft/selector.py
        `TopLogits`)."""
        return merge_top(*self._over_ranks(local_top(logits, self.shard, k)), k)

    def _over_ranks(self, parts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """This rank's [...] tensors -> every rank's, [R, ...] in rank order."""
        if self.world_size == 1:
            return tuple(t[None] for t in parts)
        return tuple(self._gather(t) for t in parts)

    def argmax(self, logits: Tensor) -> Tensor:
        """Local draft logits [bs, D, rows] -> the drafts [bs, D] int64."""
        return self.top_logprobs(logits, 1)[0][..., 0]

    def scores(self, logits: Tensor) -> RankScores:
        """Local draft logits [bs, D, rows] as core's DraftScores (core/speculate.py) over the whole vocabulary."""
        return RankScores(self, logits)

    def _gather(self, t: Tensor) -> Tensor:
        """[...] on each rank -> [R, ...] in rank order."""
        return self.group.all_gather(t.contiguous()[None], dim=0)

    def same_ints_on_every_rank(self, values: tuple[int, ...], device) -> tuple[int, ...]:
        """TP rank 0's values of host integers (e.g. the goodput controller's shape), on every rank."""
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=device)
        self.group.broadcast(t, src=0)
        return tuple(int(v) for v in t.tolist())

    def same_on_every_rank(self, result):
        """The accept result (a dataclass of tensors) as TP rank 0 decided it, on every rank."""
        if self.world_size == 1:
            return result
        fields = {}
        for f in dataclasses.fields(result):
            value = getattr(result, f.name)
            if isinstance(value, torch.Tensor):
                value = value.contiguous()
                self.group.broadcast(value, src=0)
            fields[f.name] = value
        return dataclasses.replace(result, **fields)


@dataclasses.dataclass(frozen=True)
class RankScores:
    """One TP rank's draft logits, answering core's DraftScores by merging every rank's candidates."""

    vocab: DraftVocab
    logits: Tensor  # [bs, D, rows] this rank's rows

    @property
    def positions(self) -> int:
        """D: the draft positions these scores cover."""
        return self.logits.shape[1]

    def argmax(self, count: int) -> Tensor:
        return self.vocab.argmax(self.logits[:, :count])

    def top_logprobs(self, k: int) -> tuple[Tensor, Tensor]:
        return self.vocab.top_logprobs(self.logits, k)

    def ranks(self, tokens: Tensor) -> Tensor | None:
        # Under TP a rank would need every shard's count (two more collectives per step): not measured there, and the
        # controller prices trees from its prior, calibrated by the tree steps it runs.
        if self.vocab.world_size > 1:
            return None
        return local_ranks(self.logits[:, : tokens.shape[1]], self.vocab.shard, tokens)
