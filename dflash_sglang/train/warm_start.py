"""Where a drafter's training starts: the target's own top decoder layers (`dflash-sglang train --init target`), or
an earlier draft checkpoint of the same shape (`--init DIR`: continue training it, e.g. on more data).

A random drafter spends its first thousands of steps learning what the target already knows. When the drafter
has the target's hidden size and head layout, its layer i can start as a copy of target layer `d + 1 + i`,
where d is the deepest fused target layer id: then, with `fc` selecting that deepest feature and `hidden_norm`
equal to the copied layer's input norm, the first draft layer's context K/V are exactly what the target's
layer d + 1 computes for those tokens. Llama-family targets have no q/k norms, so the drafter's q_norm/k_norm
(which normalise every head to unit RMS) are fitted per channel on real features to keep the copied
attention logits at their original scale. Only a starting point: every weight is trained afterwards.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from pathlib import Path

from ..core.draft.checkpoint import CONFIG_FILE, expected_shapes, read_state_dict
from ..core.draft.config import CheckpointError, DraftConfig
from ..core.draft.drafter import DFlashDrafter

log = logging.getLogger(__name__)

# What a checkpoint must share with the drafter a run trains to be its starting point (config.json fields).
_INIT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "mask_token_id", "target_layer_ids", "block_size", "rope_theta",
                "layer_types")

# Drafter parameter suffix -> target (HF Llama/Qwen decoder layer) parameter suffix.
_LAYER_PARAMS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


def source_layers(num_target_layers: int, deepest_feature: int, n: int) -> list[int]:
    """Target layers to copy: the n after the deepest fused feature, shifted down to fit below the top."""
    first = min(deepest_feature + 1, num_target_layers - n)
    if first < 0:
        raise ValueError(f"cannot copy {n} draft layers from a {num_target_layers}-layer target")
    return list(range(first, first + n))


def _fit_head_norm(x: Tensor, head_dim: int, eps: float) -> Tensor:
    """Per-channel weight w minimising |w * x/rms(x) - x|^2 over heads and rows. x [N, heads * head_dim]."""
    x = x.float().reshape(-1, head_dim)
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * xn).sum(0) / xn.pow(2).sum(0).clamp_min(1e-12)


@torch.no_grad()
def warm_start_from_target(model: DFlashDrafter, target: nn.Module, feature_sample: Tensor) -> list[int]:
    """Copy target layers into `model` in place; returns the copied target layer indices.

    feature_sample [N, n_feat * H] concatenated cached target features (rows of real text), used to fit the
    q/k norms. Raises ValueError when the target's layer shapes differ from the drafter's.
    """
    cfg = model.cfg
    hidden = cfg.hidden_size
    layers = target.model.layers
    deepest = max(cfg.target_layer_ids)
    src = source_layers(len(layers), deepest, cfg.num_hidden_layers)
    target_state = target.state_dict()
    for i, j in enumerate(src):
        for name in _LAYER_PARAMS:
            dst = model.get_parameter(f"layers.{i}.{name}")
            w = target_state.get(f"model.layers.{j}.{name}")
            if w is None or w.shape != dst.shape:
                raise ValueError(f"--init target: target layer {j} {name} has shape "
                                 f"{None if w is None else tuple(w.shape)}, the drafter needs {tuple(dst.shape)}")
            dst.copy_(w.float())
    # fc selects the deepest feature (the column block of the largest layer id), hidden_norm is the first copied
    # layer's input norm: context K/V = k_proj(input_layernorm(h_deepest)), as in the target.
    order = sorted(range(len(cfg.target_layer_ids)), key=lambda k: cfg.target_layer_ids[k])
    col = order[-1] * hidden
    model.fc.weight.zero_()
    model.fc.weight[:, col : col + hidden].copy_(torch.eye(hidden))
    model.hidden_norm.weight.copy_(model.layers[0].input_layernorm.weight)
    final = target_state.get("model.norm.weight")
    if final is not None and final.shape == model.norm.weight.shape:
        model.norm.weight.copy_(final.float())
    ctx = model.fuse(feature_sample.float())
    for layer, j in zip(model.layers, src):
        attn = layer.self_attn
        for name, proj in (("q_norm", attn.q_proj), ("k_norm", attn.k_proj)):
            norm = getattr(attn, name)
            w = target_state.get(f"model.layers.{j}.self_attn.{name}.weight")  # Qwen3-style targets have them
            norm.weight.copy_(w.float() if w is not None and w.shape == norm.weight.shape
                              else _fit_head_norm(proj(ctx), cfg.head_dim, cfg.rms_norm_eps))
    log.info("warm start: draft layers <- target layers %s, fc <- feature of layer %d", src, deepest)
    return src


def check_init_checkpoint(init_dir: Path, cfg: DraftConfig) -> None:
    """`--init DIR`: refuse, before any data is prepared, a checkpoint that is not the drafter `cfg` describes
    (CheckpointError naming the file and field)."""
    source = init_dir / CONFIG_FILE
    if not source.is_file():
        raise CheckpointError(f"--init {init_dir}: expected 'target', 'random' or a draft checkpoint directory "
                              f"(no {CONFIG_FILE} there)")
    loaded = DraftConfig.load(init_dir)
    for name in _INIT_FIELDS:
        have, want = getattr(loaded, name), getattr(cfg, name)
        if have != want:
            raise CheckpointError(f"{source}: field '{name}'={have!r} but this run trains {want!r} (--init continues "
                                  f"a checkpoint of the drafter being trained; match the flags or pick another)")


def load_init_weights(model: DFlashDrafter, init_dir: Path) -> None:
    """Every drafter weight from the checkpoint at init_dir (safetensors, strict names and shapes)."""
    tensors = read_state_dict(init_dir, expected_shapes(model.cfg))
    dtype = next(model.parameters()).dtype
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    log.info("drafter weights from %s", init_dir)
