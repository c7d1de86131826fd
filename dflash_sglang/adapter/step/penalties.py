"""Penalties and min_new_tokens served exactly: SGLang's requests mapped onto core/step/penalties.py at every verify
row.

SGLang's own penalizer state cannot serve a speculative step: its spec path does not feed the scheduler's penalizer
the committed tokens (the builtin DFLASH adds one penalty, from the tokens before the block, to every verify row).
So the worker keeps its own state per request, on the device: what the penalizers would have accumulated over the
request's output (the newest token, the step's root, included), built from `req.output_ids` when the request joins
the decode batch and extended by every step's committed tokens on the device (no host sync, exact under the overlap
scheduler too, where `output_ids` lags a step). A request that leaves the batch (finished, retracted) drops its state;
one that comes back rebuilds it. Requests without any penalty cost nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflash_sglang.core.step.penalties import OutputPenalties, Penalties, apply_penalties

from ..versions import min_new_tokens_stop_ids


def _settings(req: Any) -> tuple[float, float, float, int]:
    p = req.sampling_params
    return (float(p.frequency_penalty or 0.0), float(p.presence_penalty or 0.0),
            float(1.0 if p.repetition_penalty is None else p.repetition_penalty), int(p.min_new_tokens or 0))


def penalized(req: Any) -> bool:
    """Whether the request has any penalty on (checked for every request every step: kept to attribute reads)."""
    p = req.sampling_params
    return bool(p.frequency_penalty or p.presence_penalty or p.min_new_tokens
                or p.repetition_penalty not in (None, 1.0))


@dataclass
class _Tracked:
    penalties: Penalties  # [1]
    state: OutputPenalties  # [1, V]: the output so far, the step's root token included


@dataclass(frozen=True)
class PenalizedRows:
    """This step's penalized requests: their batch rows [k] and their stacked settings and states."""

    rows: Tensor  # [k] int64
    rids: list[str]
    penalties: Penalties
    state: OutputPenalties


class RequestPenalties:
    """Per-request penalty state of one worker (one TP rank: every rank computes the same)."""

    def __init__(self) -> None:
        self._tracked: dict[str, _Tracked] = {}

    def rows(self, batch: Any, bonus: Tensor, vocab: int) -> PenalizedRows | None:
        """The step's penalized requests (None: none, nothing to do), their state built first where new.

        bonus [bs] int64: the step's root tokens (the newest output token of each request)."""
        reqs = batch.reqs
        picked = [i for i, r in enumerate(reqs) if penalized(r)]
        live = {reqs[i].rid for i in picked}
        for rid in [r for r in self._tracked if r not in live]:  # finished or retracted
            del self._tracked[rid]
        if not picked:
            return None
        seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()
        for i in picked:
            req = reqs[i]
            if req.rid not in self._tracked:
                self._tracked[req.rid] = self._start(req, int(seq_lens[i]), bonus[i:i + 1], vocab)
        tracked = [self._tracked[reqs[i].rid] for i in picked]
        state = OutputPenalties(*(torch.cat([getattr(t.state, f) for t in tracked])
                                  for f in ("frequency", "presence", "repetition", "length")))
        return PenalizedRows(torch.tensor(picked, device=bonus.device), [reqs[i].rid for i in picked],
                             Penalties.stack([t.penalties for t in tracked]), state)

    @staticmethod
    def _start(req: Any, seq_len: int, bonus: Tensor, vocab: int) -> _Tracked:
        """State of a request joining the decode batch: its output before the root (host ids: the committed KV holds
        the prompt and every output token but the newest), then the root from the device."""
        f, p, r, m = _settings(req)
        pen = Penalties.full(1, f, p, r, m, stop_ids=min_new_tokens_stop_ids(req), device=bonus.device)
        state = OutputPenalties.empty(1, vocab, bonus.device)
        before = list(req.output_ids[: seq_len - len(req.origin_input_ids)])
        if before:
            ids = torch.tensor([before], dtype=torch.int64, device=bonus.device)
            state.extend(pen, ids, torch.tensor([len(before)], device=bonus.device))
        state.add(pen, bonus.to(torch.int64))
        return _Tracked(pen, state)

    def penalize(self, logits: Tensor, rows: PenalizedRows | None, ids: Tensor, parent: Tensor | None) -> None:
        """logits [bs, n, V] in place at the penalized requests' verify rows: ids [bs, n] int64 (row 0 the root),
        parent [bs, n] (None: a chain). SGLang's own scaling op applies the repetition penalty (its arithmetic).
        rows None (no request penalized): nothing to do."""
        if rows is None:
            return
        from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

        sub = logits.index_select(0, rows.rows)
        par = parent.index_select(0, rows.rows) if parent is not None else None
        apply_penalties(sub, rows.state.along_paths(rows.penalties, ids.index_select(0, rows.rows), par),
                        rows.penalties, scale=apply_scaling_penalties)
        logits.index_copy_(0, rows.rows, sub)

    def commit(self, rows: PenalizedRows | None, out_tokens: Tensor, commit_lens: Tensor) -> None:
        """Each penalized request's committed tokens (the first commit_lens[i] of out_tokens [bs, W]) join its
        state, one at a time, in order (none where rows is None)."""
        if rows is None:
            return
        state = rows.state
        state.extend(rows.penalties, out_tokens.index_select(0, rows.rows), commit_lens.index_select(0, rows.rows))
        for j, rid in enumerate(rows.rids):
            self._tracked[rid].state = state.select(slice(j, j + 1))
