"""Reference speculative decoder: any HF causal LM target + a DFlash drafter, batched, on plain tensors.

It performs the decode step of docs/structure.md ("One decode step") on padded tensors and is the oracle that the SGLang
worker and the CUDA ops must agree with token for token.

Layout: every request's committed tokens are right-aligned in one padded time axis shared by the target
KV cache and the drafter's context K/V (they hold exactly the same tokens: every committed token whose
target KV exists has its fused feature in the drafter's context). `valid [bs, L]` marks real entries and
`pos [bs, L]` their absolute positions. A verify appends B entries per row; rejected rows are then
dropped by `_compact`, which re-right-aligns every row and trims the all-padding columns, i.e. each
request's caches are cropped to its own committed length.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .draft.checkpoint import check_fit
from .draft.config import recurrent_layers
from .draft.drafter import KV, DFlashDrafter
from .draft.features import target_layer_features
from .draft.selector import SelectorScores
from .draft.token_map import restrict_head
from .shape.adaptive import AdaptivePolicy, SpecShape
from .shape.goodput import FixedStepCost, GoodputController
from .speculate import DraftLogits, DraftScores, accept, committed_ranks, draft_block, kept_rows, propose, rank_paths
from .step.accept import AcceptResult, SamplingParams, sample_from, target_probs
from .step.block import build_block_inputs
from .step.penalties import OutputPenalties, Penalties, apply_penalties
from .step.recurrent import NodeStates, has_attention, last_row, select_rows


@dataclass
class Generation:
    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step (bonus included)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


@dataclass
class StepTimes:
    """Where the decode steps' wall time went (seconds, summed over steps): the drafter pass, the target verify
    forward, and everything else of a step (proposal, acceptance, draft context K/V, cache compaction)."""

    draft: float = 0.0
    verify: float = 0.0
    other: float = 0.0
    steps: int = 0

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.other


@dataclass
class _Batch:
    """Decode state of the requests still running. Row r is request `rid[r]`."""

    rid: Tensor  # [bs] int64
    cache: object  # HF cache whose layers hold [bs, kvh, L, d]
    valid: Tensor  # [bs, L] bool
    pos: Tensor  # [bs, L] int64
    seq_len: Tensor  # [bs] int64: committed tokens with KV (= position of `bonus`)
    bonus: Tensor  # [bs] int64: last committed token, not yet in the KV cache
    ctx_kv: list[KV] | None = None  # drafter context K/V, same time axis as the cache (less the pending columns)
    # Plain steps' target features [bs, 1, F] and positions [bs, 1], not yet drafter context K/V: the cache's last
    # len(pending) columns. A plain step needs no drafter, so its upkeep waits for the next drafted step (or a
    # change of the batch) and then runs as one pass over them all (`_catch_up`).
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)


def _gather_time(x: Tensor, idx: Tensor, dim: int) -> Tensor:
    """Gather along time axis `dim` with per-row indices idx [bs, L'] (rows are dim 0)."""
    shape = [idx.shape[0]] + [1] * (x.dim() - 1)
    shape[dim] = idx.shape[1]
    expand = list(x.shape)
    expand[dim] = idx.shape[1]
    return x.gather(dim, idx.view(shape).expand(expand))


class ReferenceDecoder:
    """Speculative generation with `target` (HF causal LM) and `drafter`, greedy or lossless sampling."""

    # A plain step (one verify row, no drafter pass) leaves the drafter's context K/V of its token pending until the
    # next drafted step or a change of the batch, which computes them all in one pass; False: every step at once (the
    # same K/V per token; kept for tests and before/after timings).
    defer_plain_upkeep = True

    def __init__(self, target, drafter: DFlashDrafter) -> None:
        check_fit(drafter.cfg, target.config)
        self.target = target
        self.drafter = drafter
        self.cfg = drafter.cfg
        self.embed = target.get_input_embeddings()
        self.lm_head_weight = target.get_output_embeddings().weight
        # A reduced draft vocabulary (drafter.token_map, from the checkpoint's token_map.safetensors) drafts over
        # its K rows of the head, taken once; the verify still uses the whole head, so decoding stays lossless.
        self.token_map = drafter.token_map
        self.draft_head = restrict_head(self.lm_head_weight, self.token_map)
        # Hybrid targets (linear-attention layers) verify one node at a time from its parent's recurrent state
        # (core/step/recurrent.py); attention-only targets verify the whole proposal in one forward.
        self.recurrent = recurrent_layers(target.config) is not None

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        block_size: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_token_id: int | list[int] | None = None,
        tree: SpecShape | None = None,
        min_p: float = 0.0,
        policy: AdaptivePolicy | None = None,
        times: StepTimes | None = None,
        controller: GoodputController | None = None,
        penalties: Penalties | None = None,
        step_cost: FixedStepCost | None = None,
    ) -> list[Generation]:
        """Speculative decoding. Per step the verify shape is, by precedence: the goodput controller's chain or tree
        (`controller.choose(running batch size)`, a chain capped to the block; n = 1 is a plain step with no drafter
        pass), else `policy.choose(running batch size)`, else `tree` (nodes x top-k from one drafter pass), else a
        chain of the block size. A chain shorter than the block drafts with a block of its own length
        (core/speculate.py `draft_block`). Every shape is lossless: greedy output is token-identical to
        `plain_generate`.

        The controller, when given, observes every step after it ran: its shape, the drafts accepted per running
        request, the drafter's ranks of the committed tokens (core/speculate.py `committed_ranks`), and its wall
        seconds from the start of its `choose` to the start of the next step's (its bookkeeping included, as a
        server's step; the last step's up to its own end), or with `step_cost` the fixed cost of its shape (its
        choices then do not follow the machine's load). One controller may serve many calls (it keeps learning, as
        in a server). `times`, when given, accumulates where the decode steps' wall time goes. `penalties` (one row
        per prompt; its stop_ids should list the EOS ids) penalize every verify row as plain decoding would at that
        point of the output (core/step/penalties.py).
        """
        block = block_size or self.cfg.block_size
        if block < 2:
            raise ValueError(f"block size must be >= 2, got {block}")
        if tree is not None and tree.nodes < 1:
            raise ValueError(f"tree needs at least one node, got {tree.nodes}")
        fixed = tree or SpecShape(block, 1)
        if fixed.is_chain and fixed.nodes > block:
            raise ValueError(f"a chain of {fixed.nodes} tokens needs block size >= {fixed.nodes}, got {block}")
        if policy is not None and policy.max_depth is None:
            policy = replace(policy, max_depth=block - 1)  # chains never outgrow one drafter block
        max_nodes = max([fixed.nodes] + ([s.nodes for _, s in policy.rows] if policy else [])
                        + ([controller.cfg.max_nodes] if controller is not None else []))
        self._check_context(prompts, max_new_tokens, max(block, max_nodes))
        gen = torch.Generator(device=self._device).manual_seed(seed)
        params = SamplingParams.full(len(prompts), temperature, top_k, top_p, min_p, device=self._device)
        outs = [Generation([]) for _ in prompts]
        pen = _Penalized.of(penalties, len(prompts), self.lm_head_weight.shape[0], self._device)
        batch, first = self._prefill(prompts, params, gen, capture=True, pen=pen)
        self._emit(outs, batch.rid, first[:, None], torch.ones_like(first), max_new_tokens, eos_token_id)
        batch = self._drop_finished(batch, outs, max_new_tokens, eos_token_id)
        last = None  # the controller's previous step: (shape, accepted drafts per request, ranks, start time)
        while batch is not None:
            start = time.perf_counter()
            if last is not None:  # the previous step ends where this one starts (as the SGLang worker times it)
                controller.observe(last[0], last[1], _seconds(last, start, step_cost), last[2])
            if controller is not None:
                shape = controller.choose(len(batch.rid)).shape
                shape = shape.at_most(block) if shape.is_chain else shape
            else:
                shape = policy.choose(len(batch.rid)) if policy is not None else fixed
            result, ranks = self._spec_step(batch, block, shape, params.select(batch.rid), gen, times, pen,
                                            with_ranks=controller is not None)
            commit = result.accept_len + 1
            if controller is not None:
                last = (shape, result.accept_len.tolist(), None if ranks is None else rank_paths(ranks.tolist()), start)
            for r, n in zip(batch.rid.tolist(), commit.tolist()):
                outs[r].accept_lengths.append(n)
            self._emit(outs, batch.rid, result.out_tokens, commit, max_new_tokens, eos_token_id)
            batch = self._drop_finished(batch, outs, max_new_tokens, eos_token_id)
        if last is not None:
            controller.observe(last[0], last[1], _seconds(last, time.perf_counter(), step_cost), last[2])
        return outs

    @torch.no_grad()
    def plain_generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        eos_token_id: int | list[int] | None = None,
        min_p: float = 0.0,
        penalties: Penalties | None = None,
    ) -> list[list[int]]:
        """Non-speculative decoding with the same batching (the baseline for lossless checks)."""
        self._check_context(prompts, max_new_tokens, 1)
        gen = torch.Generator(device=self._device).manual_seed(seed)
        params = SamplingParams.full(len(prompts), temperature, top_k, top_p, min_p, device=self._device)
        outs = [Generation([]) for _ in prompts]
        pen = _Penalized.of(penalties, len(prompts), self.lm_head_weight.shape[0], self._device)
        batch, tok = self._prefill(prompts, params, gen, capture=False, pen=pen)
        one = torch.ones_like(tok)
        while True:
            self._emit(outs, batch.rid, tok[:, None], one[: len(tok)], max_new_tokens, eos_token_id)
            batch = self._drop_finished(batch, outs, max_new_tokens, eos_token_id)
            if batch is None:
                return [o.tokens for o in outs]
            logits, _ = self._target_forward(batch, batch.bonus[:, None], batch.seq_len[:, None], capture=False)
            batch.valid = torch.cat([batch.valid, batch.valid.new_ones(len(batch.rid), 1)], dim=1)
            batch.pos = torch.cat([batch.pos, batch.seq_len[:, None]], dim=1)
            batch.seq_len = batch.seq_len + 1
            last = logits[:, -1:]
            if pen is not None:
                pen.penalize(last, batch.rid, batch.bonus[:, None], None)
            tok = self._sample(last[:, 0], params.select(batch.rid), gen)
            if pen is not None:
                pen.commit(batch.rid, tok[:, None], torch.ones_like(tok))
            batch.bonus = tok

    def _check_context(self, prompts: list[list[int]], max_new_tokens: int, block: int) -> None:
        """Reject prompts that cannot fit: a verify may write `block` positions past the last token."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = getattr(self.target.config, "max_position_embeddings", None)
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if limit is not None and len(p) + max_new_tokens + block > limit:
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} and block size {block} "
                    f"it needs {len(p) + max_new_tokens + block} positions, the target's context is {limit}"
                )

    # ------------------------------------------------------------------ steps
    @property
    def _device(self) -> torch.device:
        return self.lm_head_weight.device

    def _prefill(self, prompts: list[list[int]], params: SamplingParams, gen, capture: bool,
                 pen: _Penalized | None = None) -> tuple[_Batch, Tensor]:
        if not prompts:
            raise ValueError("no prompts")
        bs, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(bs, width, dtype=torch.long)
        valid = torch.zeros(bs, width, dtype=torch.bool)
        for r, p in enumerate(prompts):  # left padding: the newest token of every row is in the last column
            ids[r, width - len(p):] = torch.tensor(p)
            valid[r, width - len(p):] = True
        ids, valid = ids.to(self._device), valid.to(self._device)
        pos = (valid.long().cumsum(1) - 1).clamp_min(0)
        from transformers import DynamicCache  # the target is an HF model; keep import local to the HF path

        batch = _Batch(
            rid=torch.arange(bs, device=self._device),
            cache=DynamicCache(config=self.target.config),
            valid=valid[:, :0],
            pos=pos[:, :0],
            seq_len=torch.zeros(bs, dtype=torch.long, device=self._device),
            bonus=ids[:, -1],
        )
        logits, feats = self._target_forward(batch, ids, pos, capture=capture, new_valid=valid)
        batch.valid, batch.pos = valid, pos
        batch.seq_len = valid.sum(1)
        last = logits[:, -1:]
        if pen is not None:  # nothing output yet: only min_new_tokens can act
            pen.penalize(last, batch.rid, ids[:, -1:], None)
        first = self._sample(last[:, 0], params, gen)
        if pen is not None:
            pen.commit(batch.rid, first[:, None], torch.ones_like(first))
        batch.bonus = first
        if capture:
            batch.ctx_kv = self._context_kv(feats, pos)
        return batch, first

    def _spec_step(self, batch: _Batch, block: int, shape: SpecShape, params: SamplingParams, gen,
                   times: StepTimes | None = None, pen: _Penalized | None = None,
                   with_ranks: bool = False) -> tuple[AcceptResult, Tensor | None]:
        """One draft -> verify -> accept -> commit step for every running request; with_ranks: also the drafter's
        ranks of the committed tokens (core/speculate.py `committed_ranks`; None on a plain step)."""
        t0 = time.perf_counter()
        plain = shape.nodes == 1
        defer = plain and self.defer_plain_upkeep
        drafted = draft_block(shape, block)  # (a short chain drafts with a block of its own length)
        if not plain:
            self._catch_up(batch)
        scores = None if plain else self._scores(batch, drafted, params, gen)
        t1 = time.perf_counter()
        proposal = propose(batch.bonus, scores, shape)
        positions = batch.seq_len[:, None] + proposal.depth
        t2 = time.perf_counter()
        logits, feats, states = self._verify(batch, proposal, positions)
        t3 = time.perf_counter()
        if pen is not None:
            pen.penalize(logits, batch.rid, proposal.ids, proposal.tree.parent if proposal.tree is not None else None)
        result = accept(proposal, logits, None if bool(params.greedy.all()) else params, gen)
        if pen is not None:
            pen.commit(batch.rid, result.out_tokens, result.accept_len + 1)
        keep = kept_rows(proposal, result)
        if states is not None:
            states.commit(last_row(result.accept_len, result.accept_nodes if proposal.tree is not None else None))

        if defer:  # (one row, always kept: nothing to compact, and the drafter's upkeep waits)
            batch.pending.append((feats, positions))
        else:
            self._append_context(batch, feats, positions)
        batch.valid = torch.cat([batch.valid, keep], dim=1)
        batch.pos = torch.cat([batch.pos, positions], dim=1)
        batch.seq_len = batch.seq_len + result.accept_len + 1
        batch.bonus = result.bonus
        if not defer:
            # the kept rows of a tree are root + accepted path, which node order already lists parent-first,
            # so the stable compaction leaves them in sequence order
            self._compact(batch)
        if times is not None:
            times.draft += t1 - t0
            times.verify += t3 - t2
            times.other += (t2 - t1) + (time.perf_counter() - t3)
            times.steps += 1
        ranks = committed_ranks(scores, result, shape.nodes, drafted - 1) if with_ranks and scores is not None else None
        return result, ranks

    def _scores(self, batch: _Batch, block: int, params: SamplingParams, gen) -> DraftScores:
        """The drafter pass over [bonus, MASK x (block-1)]: its draft logits [bs, block-1, V] (or [bs, block-1, K] over
        the token map's ids), or for a DFlash2 drafter its selector's scores (the walk's uniforms from `gen`)."""
        inputs = build_block_inputs(batch.bonus, batch.seq_len, block, self.cfg.mask_token_id)
        dtype = self.drafter.fc.weight.dtype
        embeds = (self.embed(inputs.input_ids) * self.cfg.input_embedding_scale).to(dtype)
        hidden = self.drafter(embeds, inputs.positions, batch.ctx_kv, batch.pos, ctx_valid=batch.valid)[:, 1:]
        logits = self.drafter.logits(hidden.to(self.draft_head.dtype), self.draft_head)
        selector = self.drafter.candidate_selector
        if selector is None:
            return DraftLogits(logits, self.token_map)
        return SelectorScores.of(selector, hidden, logits, batch.bonus, params.temperature, gen, self.token_map)

    def _target_forward(
        self, batch: _Batch, ids: Tensor, positions: Tensor, capture: bool, new_valid=None, tree_mask=None
    ):
        """Append `ids` [bs, T] at `positions` to the target cache; returns logits [bs, T, V] and features.

        tree_mask [bs, T, T] bool (None: causal) restricts the new rows to their tree ancestors; it becomes a
        4D mask [bs, 1, T, L + T] that HF models take as given.
        """
        new_valid = new_valid if new_valid is not None else torch.ones_like(ids, dtype=torch.bool)
        if tree_mask is None:
            mask = torch.cat([batch.valid, new_valid], dim=1).long()
        else:
            bs, t = ids.shape
            past = batch.valid[:, None, :].expand(bs, t, batch.valid.shape[1])
            mask = torch.cat([past, tree_mask], dim=2)[:, None]
        out = self.target(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
            output_hidden_states=capture,
        )
        feats = target_layer_features(out.hidden_states, self.cfg.target_layer_ids) if capture else None
        return out.logits.float(), feats

    def _verify(self, batch: _Batch, proposal, positions: Tensor) -> tuple[Tensor, Tensor, NodeStates | None]:
        """The target's verify of `proposal` at `positions` [bs, n]: logits [bs, n, V], features [bs, n, F], and for a
        hybrid target every node's recurrent state (None otherwise)."""
        if self.recurrent:
            return self._verify_by_node(batch, proposal, positions)
        tree_mask = proposal.attention_mask() if proposal.tree is not None else None
        return (*self._target_forward(batch, proposal.ids, positions, capture=True, tree_mask=tree_mask), None)

    def _verify_by_node(self, batch: _Batch, proposal, positions: Tensor) -> tuple[Tensor, Tensor, NodeStates]:
        """A hybrid target's verify: node i [bs] of the proposal runs alone, from its parent's recurrent state (a
        chain's previous row, a tree's parent; core/step/recurrent.py), attending to the committed context and its
        ancestors. Returns logits [bs, n, V], features [bs, n, F] and every node's state, for the commit."""
        ids, n = proposal.ids, proposal.ids.shape[1]
        see = proposal.attention_mask()  # [bs, n, n] bool: ancestors and itself
        parent = proposal.tree.parent if proposal.tree is not None else torch.arange(n, device=ids.device) - 1
        parent = parent.expand(ids.shape)
        states = NodeStates.of(batch.cache, n)
        logits, feats = [], []
        for i in range(n):
            states.load(parent[:, i])
            mask = torch.cat([batch.valid, see[:, i, : i + 1]], dim=1)[:, None, None]  # [bs, 1, 1, L + i + 1]
            out = self.target(input_ids=ids[:, i: i + 1], attention_mask=mask, position_ids=positions[:, i: i + 1],
                              past_key_values=batch.cache, use_cache=True, output_hidden_states=True)
            states.record(i)
            logits.append(out.logits.float())
            feats.append(target_layer_features(out.hidden_states, self.cfg.target_layer_ids))
        return torch.cat(logits, 1), torch.cat(feats, 1), states

    def _catch_up(self, batch: _Batch) -> None:
        """The pending plain steps' drafter context K/V, in one pass over their features (the same values per token as
        one pass per step: every op of `context_kv` is per token), appended where they belong: the cache's last
        columns."""
        if not batch.pending:
            return
        feats = torch.cat([f for f, _ in batch.pending], dim=1)
        positions = torch.cat([p for _, p in batch.pending], dim=1)
        batch.pending = []
        self._append_context(batch, feats, positions)

    def _append_context(self, batch: _Batch, feats: Tensor, positions: Tensor) -> None:
        """Target features [bs, T, F] at positions [bs, T] -> drafter context K/V appended on the time axis."""
        new_kv = self._context_kv(feats, positions)
        batch.ctx_kv = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2))
                        for (k, v), (nk, nv) in zip(batch.ctx_kv, new_kv)]

    def _context_kv(self, feats: Tensor, positions: Tensor) -> list[KV]:
        dtype = self.drafter.fc.weight.dtype
        return self.drafter.context_kv(self.drafter.fuse(feats.to(dtype)), positions)

    def _sample(self, logits: Tensor, params: SamplingParams, gen) -> Tensor:
        if bool(params.greedy.all()):
            return logits.argmax(-1)
        probs = target_probs(logits[:, None], params)[:, 0]
        u = torch.rand(len(logits), generator=gen, device=self._device)
        return sample_from(probs, u)

    # ------------------------------------------------------------------ bookkeeping
    def _compact(self, batch: _Batch) -> None:
        """Right-align each row's valid entries and trim columns that are padding in every row."""
        assert not batch.pending, "the drafter's context caught up before the cache moves"
        length = batch.valid.shape[1]
        width = int(batch.valid.sum(1).max())
        # stable sort on validity puts padding first and keeps the time order of valid entries
        order = batch.valid.long().argsort(dim=1, stable=True)[:, length - width:]
        batch.valid = batch.valid.gather(1, order)
        batch.pos = batch.pos.gather(1, order)
        for layer in filter(has_attention, batch.cache.layers):  # (recurrent layers have no time axis)
            layer.keys = _gather_time(layer.keys, order, 2)
            layer.values = _gather_time(layer.values, order, 2)
        if batch.ctx_kv is not None:
            batch.ctx_kv = [(_gather_time(k, order, 2), _gather_time(v, order, 2)) for k, v in batch.ctx_kv]

    def _drop_finished(self, batch: _Batch, outs: list[Generation], max_new: int, eos) -> _Batch | None:
        done = torch.tensor([_finished(outs[r].tokens, max_new, eos) for r in batch.rid.tolist()])
        if not bool(done.any()):
            return batch
        rows = (~done).nonzero().squeeze(1).to(self._device)
        if len(rows) == 0:
            return None
        self._catch_up(batch)  # (the compaction below moves the drafter's context with the cache)
        batch.rid, batch.valid, batch.pos = batch.rid[rows], batch.valid[rows], batch.pos[rows]
        batch.seq_len, batch.bonus = batch.seq_len[rows], batch.bonus[rows]
        select_rows(batch.cache, rows)
        if batch.ctx_kv is not None:
            batch.ctx_kv = [(k[rows], v[rows]) for k, v in batch.ctx_kv]
        self._compact(batch)
        return batch

    @staticmethod
    def _emit(outs, rid: Tensor, tokens: Tensor, counts: Tensor, max_new: int, eos) -> None:
        """Append committed tokens, never past max_new_tokens or the first EOS."""
        eos_set = set([eos] if isinstance(eos, int) else eos or [])
        for r, row, n in zip(rid.tolist(), tokens.tolist(), counts.tolist()):
            out = outs[r].tokens
            for t in row[:n]:
                if _finished(out, max_new, eos_set):
                    break
                out.append(t)


@dataclass
class _Penalized:
    """The reference's penalty bookkeeping: settings and accumulated output state of every request (row = rid)."""

    penalties: Penalties
    state: OutputPenalties

    @classmethod
    def of(cls, penalties: Penalties | None, bs: int, vocab: int, device) -> _Penalized | None:
        if penalties is None:
            return None
        if penalties.frequency.shape[0] != bs:
            raise ValueError(f"penalties for {penalties.frequency.shape[0]} requests, {bs} prompts")
        return cls(penalties, OutputPenalties.empty(bs, vocab, device))

    def penalize(self, logits: Tensor, rid: Tensor, ids: Tensor, parent: Tensor | None) -> None:
        """logits [bs, n, V] at verify rows ids [bs, n] (row 0: the newest output token, already in the state; n = 1:
        a plain step) of the running requests rid [bs]."""
        pen = self.penalties.select(rid)
        apply_penalties(logits, self.state.select(rid).along_paths(pen, ids, parent), pen)

    def commit(self, rid: Tensor, tokens: Tensor, counts: Tensor) -> None:
        """The first counts[i] of tokens [bs, W] join request rid[i]'s output."""
        sub = self.state.select(rid)
        sub.extend(self.penalties.select(rid), tokens, counts)
        self.state.frequency[rid], self.state.presence[rid] = sub.frequency, sub.presence
        self.state.repetition[rid], self.state.length[rid] = sub.repetition, sub.length


def _finished(tokens: list[int], max_new: int, eos) -> bool:
    eos_set = eos if isinstance(eos, set) else set([eos] if isinstance(eos, int) else eos or [])
    return len(tokens) >= max_new or (bool(tokens) and tokens[-1] in eos_set)


def _seconds(step: tuple, end: float, step_cost: FixedStepCost | None) -> float:
    """A controller step's (shape, accepted per request, ranks, start) seconds: its wall time up to `end`, or the
    fixed cost of its shape at its batch size."""
    shape, accepted, _, start = step
    return end - start if step_cost is None else step_cost.seconds(shape, len(accepted))
