"""The DFlash drafter inside SGLang: core weights over a paged draft KV pool.

The draft keeps one K/V row per target KV slot, under the target's slot ids (SGLang's allocator and
`req_to_token` table are shared), so radix-cache prefix hits, chunked prefill and request aborts need
no bookkeeping of their own: a slot's draft row is written whenever the slot's target KV is committed
and is dead when the slot is freed. Under a draft window (`--speculative-draft-window-size W`) a pass reads the
last W positions' rows, and with the radix cache off the context rows are instead a bounded ring per request slot
(adapter/draft/context_rows.py `SlotRows` / `WindowRows`, `context_rows`).

- `commit` turns target features of committed tokens into every layer's context K/V (fc + hidden_norm,
  then each layer's k_proj/k_norm/RoPE and v_proj, i.e. `DFlashDrafter.context_kv`) and writes them at
  the tokens' slots.
- `draft` runs one block pass whose keys/values are [the request's committed context rows | the block
  rows]: the block's K/V go to per-request scratch rows past the target's slots and each layer is one
  ragged paged prefill over the pool (adapter/draft/attention.py: FlashInfer on CUDA, torch on CPU),
  non-causal, causal or sliding-window as the layer's kind says (one plan per kind per step). A drafter
  with a kind the backend cannot express (FlashInfer: a bidirectional window narrower than the block)
  takes the dense path instead: context rows gathered through `req_to_token` into padded tensors and the
  core drafter's masked attention, eager.

The weights come from the z-lab checkpoint through `dflash_sglang.core.draft.checkpoint.load_drafter`, with
the same parameter names, so what SGLang serves is exactly what the reference decoder runs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from dflash_sglang.core.draft.checkpoint import load_drafter
from dflash_sglang.core.draft.config import DraftConfig, LayerKind
from dflash_sglang.core.draft.drafter import Attend, DFlashDrafter
from dflash_sglang.core.step.block import build_block_inputs

from .attention import PagedAttention, select_backend
from .context_rows import ContextRows, SlotRows
from .pool import DraftKVPool, new_pool, pool_rows


@torch.no_grad()
def random_drafter(cfg: DraftConfig, device, dtype: torch.dtype) -> DFlashDrafter:
    """A drafter of cfg's shapes with small random weights (SGLang's dummy loader draws U(-1e-3, 1e-3)); norm
    weights stay at their init of ones, so activations stay finite at any depth."""
    with torch.device(device):
        model = DFlashDrafter(cfg).to(dtype)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            p.uniform_(-1e-3, 1e-3)
    return model.eval()


def load_draft_weights(draft_dir: str | Path, dtype: torch.dtype, device, dummy: bool = False) -> DFlashDrafter:
    """The drafter's weights from the checkpoint (dummy: random ones of its config's shapes), on `device` in `dtype`.
    The worker loads them when it is built, before SGLang measures the memory its KV pool may take, so that the
    measurement counts them (a DFlash2 draft's selector codebooks included: 2 x V x r)."""
    if dummy:
        return random_drafter(DraftConfig.load(draft_dir), device, dtype)
    return load_drafter(draft_dir, device=device, dtype=dtype).eval()


def weight_bytes(drafter: DFlashDrafter) -> tuple[int, int]:
    """(all the drafter's parameter bytes, those of a DFlash2 selector's two [V, r] codebooks; 0 without one)."""
    total = sum(p.numel() * p.element_size() for p in drafter.parameters())
    selector = drafter.candidate_selector
    books = 0 if selector is None else sum(t.numel() * t.element_size() for t in (
        selector.predecessor_codebook, selector.successor_codebook))
    return total, books


@dataclass(frozen=True)
class TargetHead:
    """What the drafter borrows from the target: its token embedding and its LM head."""

    embed: Callable[[Tensor], Tensor]  # [bs, B] int64 ids -> [bs, B, H] (the target's embed_tokens)
    lm_head_weight: Tensor  # [V, H] (the draft's vocabulary rows of the target lm_head)
    mask_token_id: int
    embed_scale: float = 1.0  # the draft config's input_embedding_scale


class PagedDrafter:
    """A `DFlashDrafter` whose context K/V live in a `DraftKVPool`.

    Pool rows [0, scratch_base) hold context K/V where `context_rows` says (adapter/draft/context_rows.py: the target's
    KV slots, or a ring per request under a draft window); rows scratch_base + r*B .. + B-1 are the block
    scratch of request-pool slot r (B = block size), written by every paged drafter pass. `pad_slot` (when the
    pool has one more scratch block than request slots) owns the scratch of the padded requests of a CUDA-graph
    replay (adapter/draft/graphs.py), so they never write a real request's rows.
    """

    def __init__(self, drafter: DFlashDrafter, pool: DraftKVPool, scratch_base: int, block: int,
                 pad_slot: int | None = None, attention: str = "auto", context_rows: ContextRows | None = None) -> None:
        self.drafter = drafter
        # where the context K/V live (None: one row per target KV slot, the rows below scratch_base)
        self.context_rows = context_rows if context_rows is not None else SlotRows(scratch_base)
        assert self.context_rows.rows <= scratch_base, "the scratch rows follow the context rows"
        self.cfg = drafter.cfg
        self.pool = pool
        # The core drafter reads its K/V as the pool stores them (its dense path and its definition,
        # core/draft/draft_kv.py); its context K/V come back quantized-and-read, which the pool stores again unchanged
        # (scales of 1).
        assert pool.kv_format is None or (pool.kv_format.k_scale == pool.kv_format.v_scale == 1.0), "unit scales"
        drafter.kv_format = pool.kv_format
        self.scratch_base, self.block, self.pad_slot = scratch_base, block, pad_slot
        assert pad_slot is None or scratch_base + (pad_slot + 1) * block <= pool.rows, "the padding scratch fits"
        self._offsets = torch.arange(block, device=pool.k.device)
        cfg = self.cfg
        self.kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]  # what each layer's queries see
        # None: the dense path (a layer kind the backend cannot express)
        self.attention: PagedAttention | None = select_backend(
            pool.k.device, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, pool.dtype, attention,
            pool.kv_format, kinds=tuple(dict.fromkeys(self.kinds)), block=block)
        if self.attention is None and not isinstance(self.context_rows, SlotRows):
            # (the dense path gathers context rows through req_to_token, by target slot)
            raise ValueError(f"--speculative-draft-window-size: the drafter runs the dense attention path "
                             f"({self.backend_name}), which reads the pool by target KV slot; serve it without "
                             f"a window")

    @classmethod
    def load(cls, draft_dir: str | Path, slots: int, req_slots: int, block: int, dtype: torch.dtype, device,
             dummy: bool = False, attention: str = "auto", kv_dtype: str | None = None,
             weights: DFlashDrafter | None = None, context_rows: ContextRows | None = None,
             pool: DraftKVPool | None = None) -> PagedDrafter:
        """slots: target KV slots (pool rows mirrored), req_slots: request-pool slots (block scratch owners; one
        more scratch block is the padding slot). context_rows: where context K/V live (None: `SlotRows(slots)`; a
        draft window's rings instead); pool: allocated already (`new_pool` on context_rows.rows, before SGLang's KV
        sizing), None: allocated here. dummy: random weights of the checkpoint's config
        (`--speculative-draft-load-format dummy`), no weight files read, for capacity planning with simulated
        acceptance. attention: the paged backend ("auto", "flashinfer" or "torch", see `select_backend`). kv_dtype:
        the draft KV dtype's SGLang name (None / "auto": the model dtype; "fp8_e4m3", ...: core/draft/draft_kv.py).
        weights: the drafter, loaded already (`load_draft_weights`; None: loaded here)."""
        drafter = weights if weights is not None else load_draft_weights(draft_dir, dtype, device, dummy)
        rows = context_rows if context_rows is not None else SlotRows(slots)
        if pool is None:
            pool = new_pool(drafter.cfg, rows.rows, req_slots, block, dtype, device, kv_dtype)
        assert pool.rows >= pool_rows(rows.rows, req_slots, block), "the scratch of every request slot fits"
        return cls(drafter, pool, rows.rows, block, pad_slot=req_slots, attention=attention, context_rows=rows)

    @property
    def backend_name(self) -> str:
        """The draft attention path, for the start-up line: the paged backend and its layer kinds, or the dense path
        and why."""
        narrowing = sorted({_kind_name(k) for k in self.kinds if k.narrows})
        kinds = f" ({', '.join(narrowing)} layers)" if narrowing else ""
        if self.attention is not None:
            return f"paged {self.attention.name}{kinds}"
        return (f"dense{kinds}: the paged backend cannot limit a query's keys to the right, which a bidirectional "
                f"window narrower than the block {self.block} does")

    @property
    def dtype(self) -> torch.dtype:
        return self.drafter.fc.weight.dtype

    @torch.inference_mode()
    def commit(self, target_hidden: Tensor, positions: Tensor, slots: Tensor) -> None:
        """Write the context K/V of committed tokens (no host sync: CUDA-graph capturable).

        target_hidden [N, n_features * H]  target layer outputs at the draft's layer ids, concatenated
        positions     [N] int64            absolute positions of the tokens
        slots         [N] int64            their pool rows (`context_rows`: the target KV slots, or ring rows)
        """
        if slots.numel() == 0:
            return
        ctx = self.drafter.fuse(target_hidden.to(self.dtype))[None]
        self.pool.write(self.drafter.context_kv(ctx, positions.to(torch.int64)[None]), slots.to(torch.int64))

    @torch.inference_mode()
    def commit_extend(self, target_hidden: Tensor, positions: Tensor, out_cache_loc: Tensor, req_pool_indices: Tensor,
                      extend_lens: list[int]) -> None:
        """An extend batch's context K/V: target_hidden [T, n_features * H], positions / out_cache_loc [T] int64 of its
        tokens (request after request, extend_lens each), req_pool_indices [bs]; written where `context_rows` keeps
        them (a window keeps each request's last R)."""
        index, rows = self.context_rows.prefill(positions, out_cache_loc, req_pool_indices, extend_lens)
        if index is not None:
            target_hidden, positions = target_hidden[index], positions[index]
        self.commit(target_hidden, positions, rows)

    def scratch_rows(self, req_pool_indices: Tensor, block: int | None = None) -> Tensor:
        """[bs] request-pool slots -> [bs*b] int64 pool rows of their block scratch (where each pass writes the
        block's own K/V), b = `block` <= B (default B). A shorter pass packs its rows at stride b: scratch rows live
        for one pass only, so any disjoint packing will do."""
        b = self.block if block is None else block
        assert 1 <= b <= self.block, (b, self.block)
        rows = self.scratch_base + req_pool_indices.to(torch.int64)[:, None] * b + self._offsets[:b]
        return rows.reshape(-1)

    @torch.inference_mode()
    def block_logits(self, head: TargetHead, bonus: Tensor, seq_lens: Tensor, req_pool_indices: Tensor,
                     attention, out: Tensor | None = None, states: Tensor | None = None) -> Tensor:
        """One paged drafter pass over planned attention -> draft logits [bs, B-1, V] for block positions 1..B-1
        (into `out` when given; `states` [bs, B-1, H], when given, receives the final-normed drafter states there:
        what a DFlash2 selector scores).

        bonus [bs] int64, seq_lens [bs] int64 (device), req_pool_indices [bs]; `attention` was planned on this
        batch's layout (`draft`'s, or the graph runner's padded one). No host sync and no data-dependent shape: this
        is the body adapter/draft/graphs.py captures.
        """
        embeds, positions = self.embed_block(head, bonus, seq_lens)
        hidden = self._run_block(embeds, positions, self.scratch_rows(req_pool_indices), attention)
        if states is not None:
            states.copy_(hidden[:, 1:])
        return self.head_logits(hidden, head.lm_head_weight, out=out)

    def embed_block(self, head: TargetHead, bonus: Tensor, seq_lens: Tensor,
                    block: int | None = None) -> tuple[Tensor, Tensor]:
        """[bonus, MASK x (b-1)] at seq_len.. -> embeddings [bs, b, H] (times the embedding scale), positions
        [bs, b] int64; b = `block` <= B (default B)."""
        block = build_block_inputs(bonus, seq_lens, self.block if block is None else block, head.mask_token_id)
        embeds = head.embed(block.input_ids)
        if head.embed_scale != 1.0:
            embeds = embeds * head.embed_scale
        return embeds, block.positions

    @torch.inference_mode()
    def draft(self, block_embeds: Tensor, positions: Tensor, req_to_token: Tensor, req_pool_indices: Tensor,
              seq_lens: Tensor, seq_lens_cpu: Tensor | None = None) -> Tensor:
        """One drafter pass per request, from block embeddings.

        block_embeds     [bs, b, H]  target embeddings of [bonus, MASK...] (times input_embedding_scale), b <= B
        positions        [bs, b] int64  absolute positions of the block rows (seq_len + j)
        req_to_token     SGLang's [pool_reqs, max_ctx] slot table; req_pool_indices [bs]
        seq_lens         [bs] committed tokens per request (the context is slots 0..seq_len-1)
        seq_lens_cpu     [bs] the same on the host when the scheduler has it (SGLang's exact mirror), else None
        returns          [bs, b, H] final-normed drafter states
        """
        b = block_embeds.shape[1]
        assert b <= self.block, "at most the block size the scratch rows were sized for"
        if seq_lens_cpu is None:
            seq_lens_cpu = seq_lens.to("cpu", torch.int64)  # a host sync: the ragged sizes plan the pass
        if self.attention is None:
            return self._draft_dense(block_embeds, positions, req_to_token, req_pool_indices, seq_lens_cpu)
        # eager: the layout's length (the sum of the context lengths) is data dependent
        self.attention.plan(self.context_rows.layout(req_to_token, req_pool_indices, seq_lens, seq_lens_cpu, b,
                                                     self.scratch_base))
        return self._run_block(block_embeds, positions, self.scratch_rows(req_pool_indices, b), self.attention)

    def _run_block(self, block_embeds: Tensor, positions: Tensor, block_rows: Tensor, attention) -> Tensor:
        """The layer stack over the paged pool: block_embeds [bs, B, H], positions [bs, B] int64, block_rows [bs*B]
        int64 scratch rows receiving the block's K/V, `attention` planned on the layout -> [bs, B, H]."""
        bs, b, hidden = block_embeds.shape
        attends = [self._paged_attend(i, block_rows, attention) for i in range(self.cfg.num_hidden_layers)]
        # The whole batch as one sequence of bs*B rows: the layout says which keys each row sees.
        out = self.drafter.run_layers(block_embeds.to(self.dtype).reshape(1, bs * b, hidden),
                                      positions.reshape(1, bs * b), attends, block=b)  # (DFlash2's convolutions)
        return out.view(bs, b, hidden)

    def _paged_attend(self, layer: int, block_rows: Tensor, attention) -> Attend:
        k_pool, v_pool, kind = self.pool.k[layer], self.pool.v[layer], self.kinds[layer]

        def attend(q: Tensor, k_blk: Tensor, v_blk: Tensor) -> Tensor:
            # q [1, h, T, d], k_blk / v_blk [1, kvh, T, d] -> [1, h, T, d]; the block's rows stored as the context's
            k_pool[block_rows], v_pool[block_rows] = self.pool.store(k_blk[0].transpose(0, 1), v_blk[0].transpose(0, 1))
            return attention.run(q[0].transpose(0, 1), k_pool, v_pool, kind).transpose(0, 1)[None]

        return attend

    def _draft_dense(self, block_embeds: Tensor, positions: Tensor, req_to_token: Tensor, req_pool_indices: Tensor,
                     seq_lens_cpu: Tensor) -> Tensor:
        """Each request's context rows (its last `key_lens` positions: the whole context, or a draft window's) gathered
        through req_to_token into [bs, S] padded tensors, the core drafter's masked attention (any layer type; memory
        grows with bs x the longest context read)."""
        device = block_embeds.device
        lens = self.context_rows.key_lens(seq_lens_cpu)
        width = int(lens.max()) if lens.numel() else 0
        cols = torch.arange(width)
        ctx_valid = cols[None, :] < lens[:, None]
        # [bs, S] absolute positions (what RoPE'd keys and layer masks compare); padding rows read the request's first
        ctx_pos = torch.where(ctx_valid, (seq_lens_cpu.to(torch.int64) - lens)[:, None] + cols, 0).to(device)
        ctx_slots = req_to_token[req_pool_indices.to(torch.int64)[:, None], ctx_pos].to(torch.int64)
        ctx_kv = self.pool.gather(ctx_slots)
        return self.drafter(block_embeds.to(self.dtype), positions, ctx_kv, ctx_pos, ctx_valid=ctx_valid.to(device))

    def head_logits(self, hidden: Tensor, lm_head_weight: Tensor, out: Tensor | None = None) -> Tensor:
        """hidden [bs, B, H] -> draft logits [bs, B-1, V] for block positions 1..B-1 (lm_head dtype), written into
        `out` [bs, B-1, V] when given.

        Proposals taken from them are point masses (the chain's argmax, the tree's top-k nodes), which keeps
        rejection sampling lossless for any target sampling settings.
        """
        return self.drafter.logits(hidden[:, 1:].to(lm_head_weight.dtype), lm_head_weight, out=out)


def _kind_name(kind: LayerKind) -> str:
    """"causal", "sliding-window 2048", "causal sliding-window 512", ... (a narrowing kind, for the start-up line)."""
    window = f"sliding-window {kind.window}" if kind.window is not None else ""
    return " ".join(w for w in ("causal" if kind.causal else "", window) if w)


class DraftPass(Protocol):
    """A decode step's draft pass: `EagerDraftPass` (any drafter) and `DraftGraphs` (a graph replay, None when no
    captured size fits) take the same arguments.

    bonus [bs] int64, seq_lens [bs] (device), seq_lens_cpu [bs] its host mirror (None: a host sync),
    req_pool_indices [bs] -> draft logits [bs, D, V] for block positions 1..D (V: this rank's draft rows), D = B-1,
    or, with `block` = b < B, the pass over [bonus, MASK x (b-1)] and D = b-1 where the pass is eager (a short chain
    drafts with a block of its own length, core/speculate.py `draft_block`; a graph replay keeps the whole block).
    """

    def __call__(self, bonus: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor | None,
                 req_pool_indices: Tensor, block: int | None = None) -> Tensor | None: ...


@dataclass(frozen=True)
class EagerDraftPass:
    """The draft pass run eagerly with the step's own planning (the dense path too)."""

    drafter: PagedDrafter
    head: TargetHead
    req_to_token: Tensor  # SGLang's [pool_reqs, max_ctx] slot table

    @torch.inference_mode()
    def __call__(self, bonus: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor | None,
                 req_pool_indices: Tensor, block: int | None = None) -> Tensor:
        return self.with_hidden(bonus, seq_lens, seq_lens_cpu, req_pool_indices, block)[1]

    @torch.inference_mode()
    def with_hidden(self, bonus: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor | None, req_pool_indices: Tensor,
                    block: int | None = None) -> tuple[Tensor, Tensor]:
        """The same pass -> (final-normed drafter states [bs, D, H], draft logits [bs, D, V]) at block positions 1..D:
        what a DFlash2 drafter's candidate selector scores (core/draft/selector.py)."""
        embeds, block_pos = self.drafter.embed_block(self.head, bonus, seq_lens, block)
        hidden = self.drafter.draft(embeds, block_pos, self.req_to_token, req_pool_indices, seq_lens, seq_lens_cpu)
        return hidden[:, 1:], self.drafter.head_logits(hidden, self.head.lm_head_weight)
