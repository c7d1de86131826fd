"""Output-dependent logit penalties at every verify row, exactly as plain decoding would apply them.

Plain decoding (SGLang's `sampling/penaltylib`, the same on 0.5.17 and 0.5.23) penalizes the next token's logits
from the request's output so far (the prompt does not count):
- frequency: minus `frequency_penalty` per earlier occurrence of the token (accumulated by float32 addition, one
  occurrence at a time, in output order);
- presence: minus `presence_penalty` once the token occurred;
- min_new_tokens: -inf on the stop tokens (EOS, the request's stop_token_ids) while the output is shorter than
  `min_new_tokens`;
- repetition (multiplicative): a token that occurred has its logit multiplied by `repetition_penalty` if negative,
  divided by it otherwise.
The additive ones are summed first, `logits + (-(frequency + presence) + mask)`, then the scaling is applied: the
arithmetic of SGLang's default (overlap) scheduler, which accumulates both per batch before the forward. (Its
non-overlap path applies the penalizers one by one in the iteration order of a set of classes, which changes from
one process to the next; docs/request-options.md, "Request options".) Then grammar and logit bias.

A verify row is a point in the output that plain decoding would reach one token at a time: row j of a step sees
the committed output plus the drafted tokens on its path (a chain: drafts 0..j-1; a tree: node j's ancestors). So
each row gets its own accumulated state (`OutputPenalties.along_paths`), built by the same one-token-at-a-time
additions as plain decoding, which keeps the floats bit-identical: greedy output is token-identical to plain
decoding with penalties, and sampling draws from the target's penalized distribution at every row.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Penalties:
    """Per-request settings; neutral values switch a penalty off.

    frequency, presence [bs] float32 (0 = off), repetition [bs] float32 (1 = off), min_new_tokens [bs] int64
    (0 = off), stop_ids [bs, S] int64 padded with -1 (the tokens min_new_tokens holds back).
    """

    frequency: Tensor
    presence: Tensor
    repetition: Tensor
    min_new_tokens: Tensor
    stop_ids: Tensor

    @classmethod
    def full(cls, bs: int, frequency: float = 0.0, presence: float = 0.0, repetition: float = 1.0,
             min_new_tokens: int = 0, stop_ids: tuple[int, ...] = (), device=None) -> Penalties:
        if repetition <= 0 or min_new_tokens < 0:
            raise ValueError(f"invalid penalties: repetition={repetition} (> 0) min_new_tokens={min_new_tokens} (>= 0)")
        stops = torch.tensor([list(stop_ids)] * bs, dtype=torch.int64, device=device).view(bs, len(stop_ids))
        def each(value: float) -> Tensor:
            return torch.full((bs,), float(value), device=device)

        return cls(each(frequency), each(presence), each(repetition),
                   torch.full((bs,), int(min_new_tokens), dtype=torch.int64, device=device), stops)

    @classmethod
    def stack(cls, rows: list[Penalties]) -> Penalties:
        """One batch from per-request rows (each [1]-sized), stop ids re-padded to the longest."""
        width = max(r.stop_ids.shape[1] for r in rows)
        stops = [torch.nn.functional.pad(r.stop_ids, (0, width - r.stop_ids.shape[1]), value=-1) for r in rows]
        return cls(*(torch.cat([getattr(r, f) for r in rows]) for f in ("frequency", "presence", "repetition",
                                                                       "min_new_tokens")), torch.cat(stops))

    def select(self, rows: Tensor) -> Penalties:
        return Penalties(self.frequency[rows], self.presence[rows], self.repetition[rows], self.min_new_tokens[rows],
                         self.stop_ids[rows])


@dataclass
class OutputPenalties:
    """What the penalizers have accumulated over each request's output: [..., V] float32 each (leading dims [bs], or
    [bs, n] at a step's n verify rows), and the output length [...] int64."""

    frequency: Tensor  # frequency_penalty summed per occurrence
    presence: Tensor  # presence_penalty where the token occurred, else 0
    repetition: Tensor  # repetition_penalty where the token occurred, else 1
    length: Tensor  # output tokens so far

    @classmethod
    def empty(cls, bs: int, vocab: int, device=None) -> OutputPenalties:
        zeros = torch.zeros(bs, vocab, device=device)
        return cls(zeros, zeros.clone(), torch.ones(bs, vocab, device=device),
                   torch.zeros(bs, dtype=torch.int64, device=device))

    def add(self, penalties: Penalties, tokens: Tensor, on: Tensor | None = None) -> None:
        """Append one output token per request, in place: tokens [bs] int64; on [bs] bool (None: every row) leaves
        the other rows as they are."""
        idx = tokens.clamp_min(0)[:, None]
        keep = torch.ones_like(tokens, dtype=torch.bool) if on is None else on
        freq = torch.where(keep, penalties.frequency, 0.0)[:, None]
        self.frequency.scatter_add_(1, idx, freq)  # + 0.0 leaves a skipped row's value bit-identical
        seen = self.presence.gather(1, idx)
        self.presence.scatter_(1, idx, torch.where(keep[:, None], penalties.presence[:, None], seen))
        rep = self.repetition.gather(1, idx)
        self.repetition.scatter_(1, idx, torch.where(keep[:, None], penalties.repetition[:, None], rep))
        self.length += keep.long()

    def extend(self, penalties: Penalties, tokens: Tensor, counts: Tensor) -> None:
        """Append the first counts[i] tokens of tokens [bs, W] int64 (one at a time, in order) to request i."""
        for j in range(tokens.shape[1]):
            self.add(penalties, tokens[:, j], j < counts)

    def select(self, rows: Tensor) -> OutputPenalties:
        return OutputPenalties(self.frequency[rows], self.presence[rows], self.repetition[rows], self.length[rows])

    def along_paths(self, penalties: Penalties, ids: Tensor, parent: Tensor | None) -> OutputPenalties:
        """The state at each verify row: ids [bs, n] int64 (row 0: the root, already in this state), parent
        [bs, n] int64 (-1 for the root; None: a chain, parent j - 1). Row j adds ids[j] to its parent row's state,
        so it holds the output plus the drafted tokens from the root to row j. -> [bs, n, V] (length [bs, n])."""
        bs, n = ids.shape
        rows = torch.arange(bs, device=ids.device)
        out = OutputPenalties(*(x.unsqueeze(1).repeat(1, n, *([1] * (x.dim() - 1)))
                                for x in (self.frequency, self.presence, self.repetition, self.length)))
        for j in range(1, n):
            p = parent[:, j] if parent is not None else torch.full((bs,), j - 1, device=ids.device)
            row = OutputPenalties(out.frequency[rows, p], out.presence[rows, p], out.repetition[rows, p],
                                  out.length[rows, p])  # (advanced indexing: copies)
            row.add(penalties, ids[:, j])
            out.frequency[:, j], out.presence[:, j], out.repetition[:, j] = row.frequency, row.presence, row.repetition
            out.length[:, j] = row.length
        return out


def scale_logits(logits: Tensor, scaling: Tensor) -> None:
    """The repetition penalty in place: negative logits times the scale, the others divided by it."""
    logits[:] = torch.where(logits < 0, logits * scaling, logits / scaling)


def apply_penalties(logits: Tensor, state: OutputPenalties, penalties: Penalties,
                    scale: Callable[[Tensor, Tensor], None] = scale_logits) -> None:
    """Penalize logits [bs, n, V] in place (n verify rows, or n = 1) from state [bs, n, V] (`along_paths`) as
    SGLang's default (overlap) scheduler does: the additive penalties summed into one tensor, `-(frequency +
    presence)` plus the min_new_tokens mask, added, then the repetition scaling. scale: the scaling op (SGLang's own
    `apply_scaling_penalties` in the worker, so its compiled arithmetic is the one used)."""
    bs, n, vocab = logits.shape
    additive = -(state.frequency + state.presence)  # bit-identical to SGLang's (0 - frequency) - presence
    if bool(penalties.min_new_tokens.gt(0).any()):
        held = state.length < penalties.min_new_tokens[:, None]  # [bs, n]
        stops = torch.zeros(bs, vocab + 1, device=logits.device)
        idx = torch.where(penalties.stop_ids >= 0, penalties.stop_ids, vocab)
        stops.scatter_add_(1, idx, torch.full(idx.shape, float("-inf"), device=logits.device))
        additive = additive + torch.where(held[:, :, None], stops[:, None, :vocab], 0.0)
    logits.add_(additive)
    scale(logits.view(bs * n, vocab), state.repetition.reshape(bs * n, vocab))
