"""The DFlash drafter: Qwen3-style layers whose K/V are prefixed by projected target context features.

One forward pass drafts a whole block `[last committed token, MASK x (B-1)]`: queries come from the block,
keys/values are `[context rows | block rows]`, attention is non-causal (every block query sees every
valid context row and the whole block). The drafter has no embedding table or LM head of its own; callers
embed with the target's `embed_tokens` and project with the target's `lm_head` (see `logits`). A DFlash2 drafter
(`cfg.dflash2`) wraps each layer's attention and MLP in a convolution over the block's rows (core/draft/conv.py) and
chooses its drafts with a candidate selector (core/draft/selector.py, `candidate_selector`).

Parameter names equal the z-lab safetensors names exactly, so `load_state_dict(strict=True)` is the check.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import DraftConfig, LayerKind
from .conv import DynamicConv
from .draft_kv import DraftKVFormat
from .selector import CandidateSelector

KV = tuple[Tensor, Tensor]


class AttentionFn(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor: ...


class Attend(Protocol):
    """One layer's attention over [context | block]: the callable owns where the context K/V live.

    q [bs, h, Q, d] (q_norm + RoPE applied), k_blk / v_blk [bs, kvh, Q, d] the block rows' own K/V
    -> out [bs, h, Q, d]. The dense path (`dense_attend`) concatenates in-memory context K/V; the SGLang
    adapter attends over its paged draft pool instead.
    """

    def __call__(self, q: Tensor, k_blk: Tensor, v_blk: Tensor) -> Tensor: ...


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Reference attention. q [bs, h, Q, d], k/v [bs, kvh, K, d], mask [bs, 1|h, Q, K] bool (True = attend).

    GQA is expanded explicitly so the CPU path does not depend on SDPA's enable_gqa support.
    """
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def dense_attend(ctx: KV, mask: Tensor, attn: AttentionFn, scale: float,
                 kv_format: DraftKVFormat | None = None) -> Attend:
    """Attend over in-memory context K/V ctx [bs, kvh, S, d] then the block, under mask [bs, 1, Q, S + Q]; the block's
    K/V read through `kv_format` when given (they are stored before they are attended to, as the context's are)."""

    def attend(q: Tensor, k_blk: Tensor, v_blk: Tensor) -> Tensor:
        if kv_format is not None:
            k_blk, v_blk = kv_format.roundtrip(k_blk, v_blk)
        k = torch.cat([ctx[0], k_blk], dim=2)
        v = torch.cat([ctx[1], v_blk], dim=2)
        return attn(q, k, v, mask, scale)

    return attend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 (as the HF Qwen3/Llama norms do) so bf16 drafts match the reference.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """Neox-style RoPE from the drafter's own config (rope_theta, optional linear / llama3 scaling)."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        # A plain attribute, not a buffer: Module.to(bf16) would round it and shift angles at large positions.
        self.inv_freq = _scale_inv_freq(inv_freq, cfg.rope_scaling).float()

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions [bs, T] int64 -> cos, sin [bs, 1, T, head_dim] (angles computed in float32)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _scale_inv_freq(inv_freq: Tensor, scaling: dict | None) -> Tensor:
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = h, kvh, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kvh * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> KV:
        """x [bs, T, H] -> k, v [bs, kvh, T, d]; k gets k_norm then RoPE."""
        bs, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(bs, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bs, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        bs, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bs, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.project_kv(x, cos, sin)
        out = attend(q, k_blk, v_blk)
        return self.o_proj(out.transpose(1, 2).reshape(bs, q_len, -1))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)
        # DFlash2: each sublayer wrapped in a convolution over the block's rows; none in a DFlash draft
        self.attention_conv: DynamicConv | None = None
        self.mlp_conv: DynamicConv | None = None
        if cfg.dflash2 is not None:
            taps, group = cfg.dflash2.conv_kernel_size, cfg.dflash2.conv_group_size
            self.attention_conv = DynamicConv(cfg.hidden_size, taps, group)
            self.mlp_conv = DynamicConv(cfg.hidden_size, taps, group)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attend: Attend, block: int | None = None) -> Tensor:
        """h [N, Q, H] block rows, Q whole blocks of `block` rows (None: one; the convolutions stay within a block)."""
        block = h.shape[1] if block is None else block
        h = h + _wrapped(self.attention_conv, lambda x: self.self_attn(x, cos, sin, attend), self.input_layernorm(h),
                         block)
        return h + _wrapped(self.mlp_conv, self.mlp, self.post_attention_layernorm(h), block)


def _wrapped(conv: DynamicConv | None, sublayer, x: Tensor, block: int) -> Tensor:
    """sublayer(x), between the convolution's two halves when the layer has one (the attention's queries and block K/V
    come from the convolved rows; the context K/V never pass through it)."""
    if conv is None:
        return sublayer(x)
    x, after = conv.prepare(x, block)
    return conv.finish(sublayer(x), after, block)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DraftConfig, attention: AttentionFn = sdpa_attention) -> None:
        super().__init__()
        self.cfg = cfg
        self.attention = attention
        self.fc = nn.Linear(cfg.n_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.candidate_selector = CandidateSelector(cfg) if cfg.dflash2 is not None else None
        # [K] int64 target ids of a reduced draft vocabulary (core/draft/token_map.py), None = full vocabulary. A
        # non-persistent buffer: it follows .to(device) but stays out of state_dict (its own file on disk).
        self.register_buffer("token_map", None, persistent=False)
        # How its K/V are stored before attention reads them (core/draft/draft_kv.py): None keeps them as computed; a
        # quantized format (fp8 draft KV) makes every context and block row read back as its stored value.
        self.kv_format: DraftKVFormat | None = None
        # A sliding context window (`--speculative-draft-window-size W`): a block at positions L.. reads only the
        # context rows at positions L-W .. L-1 (and the whole block); None reads the whole context.
        self.context_window: int | None = None

    def fuse(self, target_hidden: Tensor) -> Tensor:
        """target_hidden [..., n_feat * H] (concatenated target layer outputs) -> context feature [..., H]."""
        return self.hidden_norm(self.fc(target_hidden))

    def context_kv(self, ctx: Tensor, ctx_pos: Tensor) -> list[KV]:
        """ctx [bs, S, H] fused features at absolute positions ctx_pos [bs, S] -> per layer (k, v) [bs, kvh, S, d].

        The same fused feature is injected into every layer, each through its own k/v projection.
        Context rows skip input_layernorm (they are already normalised by hidden_norm). With a `kv_format` they are
        the stored values (quantized, then read back).
        """
        cos, sin = self.rotary(ctx_pos, ctx.dtype)
        kv = [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]
        return kv if self.kv_format is None else [self.kv_format.roundtrip(k, v) for k, v in kv]

    def forward(
        self,
        block_embeds: Tensor,
        positions: Tensor,
        ctx_kv: list[KV],
        ctx_pos: Tensor,
        ctx_valid: Tensor | None = None,
        mask: Tensor | None = None,
        block: int | None = None,
    ) -> Tensor:
        """Draft one block per row (or, with `block`, Q / block blocks per row, e.g. training's flattened blocks).

        block_embeds [bs, Q, H]  target embeddings of the block ids (times input_embedding_scale)
        positions    [bs, Q] int64  absolute positions of the block rows
        ctx_kv       per layer (k, v) [bs, kvh, S, d] from `context_kv` (S may be 0)
        ctx_pos      [bs, S] int64  absolute positions of the context rows
        ctx_valid    [bs, S] bool   False for padding rows (None: all valid); with `context_window` W also False for
                                    rows before position L - W (L = positions[:, 0], the block's committed length)
        mask         [bs, Q, S + Q] bool  explicit visibility (training); None: all valid context + whole block
        block        rows per block (DFlash2's convolutions stay within one); None: Q
        returns      [bs, Q, H] final-normed hidden states (feed to `logits`)
        """
        bs, q_len, _ = block_embeds.shape
        s_len = ctx_pos.shape[1]
        assert len(ctx_kv) == len(self.layers), "one (k, v) pair per draft layer"
        if self.context_window is not None:  # the block's first position is its committed length L
            recent = ctx_pos >= positions[:, :1] - self.context_window
            ctx_valid = recent if ctx_valid is None else ctx_valid & recent
        if mask is None:
            valid = ctx_valid if ctx_valid is not None else ctx_pos.new_ones(bs, s_len, dtype=torch.bool)
            mask = torch.cat([valid, valid.new_ones(bs, q_len)], dim=1)[:, None, :].expand(bs, q_len, s_len + q_len)
        elif ctx_valid is not None:
            mask = mask & torch.cat([ctx_valid, ctx_valid.new_ones(bs, q_len)], dim=1)[:, None, :]
        key_pos = torch.cat([ctx_pos, positions], dim=1)
        layer_masks = self._layer_masks(mask, positions, key_pos)
        scale = self.cfg.head_dim**-0.5
        attends = [dense_attend(ctx_kv[i], layer_masks[i], self.attention, scale, self.kv_format)
                   for i in range(len(self.layers))]
        return self.run_layers(block_embeds, positions, attends, q_len if block is None else block)

    def run_layers(self, block_embeds: Tensor, positions: Tensor, attends: list[Attend], block: int | None = None
                   ) -> Tensor:
        """The layer stack with one `Attend` per layer: block_embeds [bs, Q, H], positions [bs, Q] int64, block: rows
        per block along Q -> [bs, Q, H] final-normed hidden states. `forward` is this with dense context K/V.

        A DFlash drafter ignores `block`; a DFlash2 drafter needs it (its convolutions must not run from one block into
        the next, so a caller laying several blocks along one row has to say where they end).
        """
        if block is None:
            if self.cfg.dflash2 is not None:
                raise ValueError("DFlash2 drafter: run_layers needs `block` (rows per block), its convolutions stay "
                                 "within one block")
            block = block_embeds.shape[1]
        cos, sin = self.rotary(positions, block_embeds.dtype)
        h = block_embeds
        for layer, attend in zip(self.layers, attends, strict=True):
            h = layer(h, cos, sin, attend, block)
        return self.norm(h)

    def _layer_masks(self, mask: Tensor, q_pos: Tensor, k_pos: Tensor) -> list[Tensor]:
        """Per-layer [bs, 1, Q, K] masks: the base mask, narrowed for causal and sliding-window layers."""
        cache: dict[LayerKind, Tensor] = {}
        out = []
        delta = q_pos[:, :, None] - k_pos[:, None, :]  # [bs, Q, K]: query position minus key position
        for i in range(len(self.layers)):
            kind = self.cfg.layer_kind(i)
            if kind not in cache:
                cache[kind] = (mask & kind.visible(delta) if kind.narrows else mask)[:, None]
            out.append(cache[kind])
        return out

    def logits(self, hidden: Tensor, lm_head_weight: Tensor, out: Tensor | None = None) -> Tensor:
        """hidden [..., H] -> draft logits [..., V] through the target's lm_head weight [V, H], times output_multiplier
        and soft-capped where the draft says so (Gemma 4 / Muse Glimmer drafts: their tree scores, sampled drafts and
        DFlash2 selector scores depend on it).

        out: a preallocated [..., V] buffer to write in place (inference only: the CUDA-graph runner shares one
        across its batch sizes); None allocates, out of place (training differentiates through this).
        """
        cap, scale = self.cfg.final_logit_softcapping, self.cfg.output_multiplier
        if out is not None:
            torch.matmul(hidden, lm_head_weight.t(), out=out)
            if scale != 1.0:
                out.mul_(scale)
            return out if cap is None else out.div_(cap).tanh_().mul_(cap)
        logits = F.linear(hidden, lm_head_weight)
        logits = logits if scale == 1.0 else logits * scale
        return logits if cap is None else torch.tanh(logits / cap) * cap
