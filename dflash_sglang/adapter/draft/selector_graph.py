"""A DFlash2 draft's candidate selector inside the draft graphs (adapter/draft/graphs.py): the selection that follows
the drafter pass, replayed with it.

One process (TP 1): the graph of a batch size runs the pass, then the selector's candidates (core/draft/selector.py
`CandidateSelector.candidates`, the same call as the eager path's) and the chain's walk over every block position,
greedy and sampled alike (a row walks greedily where its temperature is 0, so one graph serves any mix), into static
buffers. What the step then asks of the scores reads those buffers: a chain's first n-1 drafts and their q, a tree's
children (core/step/tree.py `grow_tree`, run after the replay on the static candidates: its node count and top-k change
from step to step), the committed tokens' ranks.

Inputs only the host has are copied in before the replay: each request's temperature (zeros where every request is
greedy, known from SGLang's requests without reading the device) and the walk's uniforms [bs, B-1], drawn outside the
graph from the worker's walk generator exactly as the eager path draws them (only when some request samples, so the
generator advances alike on both paths and on every TP rank).

Tensor parallelism: the candidates are merged over the ranks' vocab shards by a collective (adapter/scale/tp.py), which
the graph does not hold; there the graph ends with the pass's states and logits, and the candidates and walk follow its
replay (on the device, no host sync), as the DFlash v1 merge does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_sglang.core.draft.selector import Candidates, CandidateSelector, SelectorScores, TopLogits, walk_uniforms


@dataclass
class SelectorStatics:
    """One batch size's leading slices of the shared buffers (`size` requests, D = B-1 positions, k candidates)."""

    temperature: Tensor  # [size] float32 input, 0 = greedy (padded requests: 0)
    uniforms: Tensor  # [size, D] float32 input (read only by sampling rows)
    states: Tensor  # [size, D, H] output of the pass: the drafter's final-normed states at block positions 1..D
    tokens: Tensor  # [size, D, k] int64 output: the candidates (in-graph selection only, as the rest below)
    unary: Tensor  # [size, D, k] float32
    projected: Tensor  # [size, D, r] float32: W h_t
    successors: Tensor  # [size, D, k, r] float32: S[candidate]
    walk: Tensor  # [size, D] int64: the chain's walk
    walk_q: Tensor  # [size, D, k] float32: what each walked token was drawn from


class GraphedSelector:
    """The static buffers of every batch size and the body a draft graph runs after the pass."""

    def __init__(self, selector: CandidateSelector, top_logits: TopLogits, in_graph: bool, max_size: int, depth: int,
                 hidden_size: int, states_dtype: torch.dtype, device) -> None:
        """top_logits: the candidates over the whole draft vocabulary (adapter/scale/tp.py `DraftVocab.top_logits`, as
        the eager path takes them); in_graph: the selection is captured with the pass (one TP rank: `top_logits` holds
        no collective); depth: D = B-1 block positions."""
        self.selector, self.top_logits, self.in_graph = selector, top_logits, in_graph
        k, r = selector.top_k, selector.hidden_projection.out_features
        f32, i64 = {"dtype": torch.float32, "device": device}, {"dtype": torch.int64, "device": device}
        sel = max_size if in_graph else 0  # the selection's outputs exist only where the graph writes them
        self._buffers = SelectorStatics(
            torch.zeros(max_size, **f32), torch.zeros(max_size, depth, **f32),
            torch.zeros(max_size, depth, hidden_size, dtype=states_dtype, device=device),
            torch.zeros(sel, depth, k, **i64), torch.zeros(sel, depth, k, **f32), torch.zeros(sel, depth, r, **f32),
            torch.zeros(sel, depth, k, r, **f32), torch.zeros(sel, depth, **i64), torch.zeros(sel, depth, k, **f32),
        )

    def statics(self, size: int) -> SelectorStatics:
        b = self._buffers
        return SelectorStatics(*(getattr(b, f)[:size] for f in b.__dataclass_fields__))

    def nbytes(self) -> int:
        b = self._buffers
        return sum(getattr(b, f).nbytes for f in b.__dataclass_fields__)

    def load(self, s: SelectorStatics, temperature: Tensor | None, any_sampled: bool,
             generator: torch.Generator | None, bs: int) -> Tensor | None:
        """Before a replay of bs requests: temperature [bs] (None: every request greedy) into the statics (padded
        requests greedy); where the walk is in the graph and some request samples, its uniforms [bs, D] drawn now (as
        the eager path draws them) and copied in. Returns the uniforms (None: none drawn)."""
        if not self.in_graph:  # (the walk follows the replay and draws its own)
            return None
        if temperature is None:
            s.temperature.zero_()
        else:
            s.temperature[:bs].copy_(temperature)
            s.temperature[bs:].zero_()
        u = walk_uniforms(bs, s.uniforms.shape[1], any_sampled, generator, s.uniforms.device)
        if u is not None:
            s.uniforms[:bs].copy_(u)
        return u

    @torch.inference_mode()
    def body(self, s: SelectorStatics, logits: Tensor, anchor: Tensor) -> None:
        """Inside the graph, after the pass wrote s.states: logits [size, D, V] (this rank's rows), anchor [size] int64
        the bonus tokens -> the selection's statics. No host sync, no data-dependent shape."""
        if not self.in_graph:
            return
        c = self.selector.candidates(s.states, logits, top_logits=self.top_logits)
        for out, value in ((s.tokens, c.tokens), (s.unary, c.unary), (s.projected, c.hidden),
                           (s.successors, c.successors)):
            out.copy_(value)
        walk, q = c.walk(anchor, s.temperature, s.uniforms)
        s.walk.copy_(walk)
        s.walk_q.copy_(q)

    def scores(self, s: SelectorStatics, bs: int, anchor: Tensor, logits: Tensor, temperature: Tensor | None,
               uniforms: Tensor | None, generator: torch.Generator | None, any_sampled: bool) -> SelectorScores:
        """After the replay: the first bs requests' scores (views of the statics, valid until the next replay).
        anchor [bs] int64, logits [bs, D, V] the replay's; temperature / uniforms as `load` took and drew them."""
        if not self.in_graph:  # the merge over ranks and the walk follow the replay
            return SelectorScores.of(self.selector, s.states[:bs], logits, anchor, temperature, generator,
                                     top_logits=self.top_logits, any_sampled=any_sampled)
        c = Candidates(s.tokens[:bs], s.unary[:bs], s.projected[:bs], s.successors[:bs],
                       self.selector.predecessor_codebook)
        return SelectorScores(c, anchor.to(torch.int64), s.temperature[:bs], uniforms,
                              walked=(s.walk[:bs], s.walk_q[:bs]))
