"""Draft checkpoint configuration: z-lab DFlash and speculators DFlash formats -> one frozen `DraftConfig`.

Layer-id rule (the z-lab reference code's convention; DFlash paper, arXiv 2602.06036): id i means the output
of target decoder layer i, which is
HF `hidden_states[i + 1]` (index 0 is the embedding output). When a checkpoint gives no ids, they are
spread uniformly from layer 1 to layer L-3, so the last two layers (and HF's final-norm replacement of
the last hidden state) are never used.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
DFLASH_ARCHITECTURE, DFLASH2_ARCHITECTURE = "DFlashDraftModel", "DFlash2DraftModel"
ZLAB_ARCHITECTURES = (DFLASH_ARCHITECTURE, DFLASH2_ARCHITECTURE)
LAYER_TYPES = ("full_attention", "sliding_attention")
# The z-lab DFlash fields: in a `dflash_config` object (older drafts) or at the top level (newer ones).
# final_logit_softcapping: Gemma 4 and Muse Glimmer drafts soft-cap their logits (tanh(l / cap) * cap);
# output_multiplier: a scale of the draft logits before the cap (the authors apply it to every draft).
ZLAB_FIELDS = ("mask_token_id", "target_layer_ids", "block_size", "input_embedding_scale", "final_logit_softcapping",
               "output_multiplier")
# A DFlash2 draft's own fields (architecture DFlash2DraftModel), all required: in dflash_config or at the top level.
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Features of other drafts (Domino's feature projector; selector or convolution settings DFlash2 does not have; a
# logit scale outside the z-lab format): served as DFlash they would draft garbage, so any such key is refused by name.
UNSERVED_FIELDS = ("projector_type", "output_multiplier")
UNSERVED_KEY_PARTS = ("selector", "conv")
UNSERVED_HINT = "is a feature dflash-sglang does not serve (use SGLang's builtin DFLASH: DFLASH_SGLANG_IMPL=builtin)"


@dataclass(frozen=True)
class DFlash2Fields:
    """What a DFlash2 draft adds to DFlash: a grouped dynamic convolution around each layer's attention and MLP
    (core/draft/conv.py) and a candidate selector over the block positions' top-k draft tokens
    (core/draft/selector.py)."""

    conv_kernel_size: int  # taps of each convolution over the block positions (2 in the published drafts)
    conv_group_size: int  # channels that share one dynamic coefficient (divides hidden_size)
    selector_rank: int  # r: width of the selector's low-rank predecessor x successor pair term
    selector_top_k: int  # k: candidates per block position (the top-k draft logits)


@dataclass(frozen=True)
class LayerKind:
    """Which keys a draft layer's queries see, beyond the base visibility (all valid context rows and the whole block).

    causal: only keys at or before the query's position; window W: only keys fewer than W positions before the query
    (q_pos - k_pos < W) and, for a bidirectional layer, fewer than W after it (k_pos - q_pos < W). The drafter's dense
    masks (core/draft/drafter.py) and the paged backends (adapter/draft/attention.py) both apply `visible`.
    """

    causal: bool = False
    window: int | None = None

    @property
    def narrows(self) -> bool:
        """False for a full bidirectional layer: every base-visible key is seen."""
        return self.causal or self.window is not None

    def visible(self, delta: Any) -> Any:
        """delta [..., Q, K] int query position minus key position -> [..., Q, K] bool (True = attend; all True when
        the kind does not narrow)."""
        keep = delta >= 0 if self.causal else delta == delta  # (all True, for tensors and arrays alike)
        if self.window is not None:
            keep = keep & (delta < self.window)
            if not self.causal:
                keep = keep & (-delta < self.window)
        return keep


class CheckpointError(ValueError):
    """A draft checkpoint is malformed or does not fit its target. The message names file and field."""


def build_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """Default target layer ids: n ids spread uniformly over [1, L-3] (one id: the middle layer)."""
    if n < 1:
        raise ValueError(f"need at least one target layer, got n={n}")
    if n == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    # round-half-even (Python round) is what the published rule uses; keep it for bit-compatibility.
    return tuple(int(round(1 + i * span / (n - 1))) for i in range(n))


@dataclass(frozen=True)
class DraftConfig:
    """Everything the drafter and the decoders need from a draft checkpoint's config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 16
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # None: sliding layers causal, full layers bidirectional (z-lab rule); True/False forces all layers.
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0
    # Draft logits become tanh(l * output_multiplier / cap) * cap (Gemma 4, Muse Glimmer drafts); None: no cap.
    final_logit_softcapping: float | None = None
    output_multiplier: float = 1.0
    # DFlash2 drafts (architecture DFlash2DraftModel); None: a DFlash draft.
    dflash2: DFlash2Fields | None = None
    # "zlab" (dflash_config object), "zlab-flat" (DFlash fields at the top level) or "speculators".
    source_format: str = "zlab"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        assert len(self.layer_types) == self.num_hidden_layers, "validated in from_dict"

    @property
    def n_features(self) -> int:
        """Number of target layers whose outputs are fused (fc input is n_features * hidden_size)."""
        return len(self.target_layer_ids)

    def layer_is_causal(self, i: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def layer_kind(self, i: int) -> LayerKind:
        """Layer i's key visibility (causal, sliding window): what its attention mask narrows."""
        return LayerKind(self.layer_is_causal(i), self.layer_window(i))

    # ---------------------------------------------------------------- parsing
    @classmethod
    def load(cls, draft_dir: str | Path) -> DraftConfig:
        path = Path(draft_dir) / CONFIG_FILE
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (a DFlash draft directory needs {CONFIG_FILE})")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = CONFIG_FILE) -> DraftConfig:
        if not isinstance(d, dict):
            raise CheckpointError(f"{source}: top level must be a JSON object")
        speculators = d.get("speculators_model_type") == "dflash" or "transformer_layer_config" in d
        _refuse_unserved(d, source, allowed=() if speculators else ("output_multiplier", *DFLASH2_FIELDS))
        return _from_speculators(d, source) if speculators else _from_zlab(d, source)

    def to_dict(self) -> dict[str, Any]:
        """z-lab config.json (what SGLang's builtin DFLASH and the z-lab code read)."""
        out: dict[str, Any] = {
            "architectures": [DFLASH2_ARCHITECTURE if self.dflash2 is not None else DFLASH_ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "attention_bias": False,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
            "dtype": "bfloat16",
        }
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        dc = out["dflash_config"]
        if self.input_embedding_scale != 1.0:
            dc["input_embedding_scale"] = self.input_embedding_scale
        if self.final_logit_softcapping is not None:
            dc["final_logit_softcapping"] = self.final_logit_softcapping
        if self.output_multiplier != 1.0:
            dc["output_multiplier"] = self.output_multiplier
        if self.dflash2 is not None:
            dc.update(asdict(self.dflash2))
        return out

    def field_name(self, key: str) -> str:
        """How this config's source file spells a DFlash field (for error messages), e.g. 'mask_token_id'."""
        if self.source_format == "zlab":
            return f"dflash_config.{key}"
        if self.source_format == "speculators" and key == "target_layer_ids":
            return "aux_hidden_state_layer_ids"
        return key

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d["n_features"] = self.n_features
        return d


# -------------------------------------------------------------------- field readers
def _req(d: dict, key: str, typ: type, source: str, prefix: str = "") -> Any:
    if key not in d or d[key] is None:
        raise CheckpointError(f"{source}: missing field '{prefix}{key}'")
    return _typed(d[key], key, typ, source, prefix)


def _opt(d: dict, key: str, typ: type, source: str, default: Any, prefix: str = "") -> Any:
    if d.get(key) is None:
        return default
    return _typed(d[key], key, typ, source, prefix)


def _typed(v: Any, key: str, typ: type, source: str, prefix: str) -> Any:
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, typ) or isinstance(v, bool) and typ is not bool:
        raise CheckpointError(f"{source}: field '{prefix}{key}' must be {typ.__name__}, got {v!r}")
    if typ is int and v < 0:
        raise CheckpointError(f"{source}: field '{prefix}{key}' must be >= 0, got {v}")
    return v


def _layer_ids(v: Any, source: str, field_name: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not v or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise CheckpointError(f"{source}: field '{field_name}' must be a non-empty list of ints, got {v!r}")
    if any(i < 0 for i in v):
        raise CheckpointError(f"{source}: field '{field_name}' has a negative layer id: {v}")
    return tuple(v)


def _rope(d: dict, source: str, prefix: str = "") -> tuple[float, dict | None]:
    # Newer configs nest rope settings in rope_parameters {rope_theta, rope_type, ...}.
    params = d.get("rope_parameters")
    if isinstance(params, dict):
        theta = _opt(params, "rope_theta", float, source, 1_000_000.0, prefix + "rope_parameters.")
        kind = params.get("rope_type", "default")
        scaling = None if kind in (None, "default") else dict(params)
        return theta, scaling
    theta = _opt(d, "rope_theta", float, source, 1_000_000.0, prefix)
    scaling = d.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise CheckpointError(f"{source}: field '{prefix}rope_scaling' must be an object or null")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return theta, scaling


def _common(d: dict, source: str, prefix: str = "") -> dict[str, Any]:
    """Fields shared by both formats (the transformer-layer part of the config)."""
    n_layers = _req(d, "num_hidden_layers", int, source, prefix)
    if n_layers < 1:
        raise CheckpointError(f"{source}: field '{prefix}num_hidden_layers' must be >= 1")
    hidden = _req(d, "hidden_size", int, source, prefix)
    heads = _req(d, "num_attention_heads", int, source, prefix)
    kv_heads = _opt(d, "num_key_value_heads", int, source, heads, prefix)
    if heads == 0 or kv_heads == 0 or heads % kv_heads:
        raise CheckpointError(
            f"{source}: field '{prefix}num_key_value_heads'={kv_heads} must divide num_attention_heads={heads}"
        )
    head_dim = _opt(d, "head_dim", int, source, hidden // heads if heads else 0, prefix)
    if head_dim % 2:
        raise CheckpointError(f"{source}: field '{prefix}head_dim'={head_dim} must be even (RoPE)")
    theta, scaling = _rope(d, source, prefix)
    layer_types = tuple(d.get("layer_types") or ())
    if layer_types and (len(layer_types) != n_layers or any(t not in LAYER_TYPES for t in layer_types)):
        raise CheckpointError(
            f"{source}: field '{prefix}layer_types' must list {n_layers} of {LAYER_TYPES}, got {list(layer_types)}"
        )
    window = _opt(d, "sliding_window", int, source, None, prefix)
    if "sliding_attention" in layer_types and not window:
        raise CheckpointError(f"{source}: field '{prefix}sliding_window' is required by sliding_attention layers")
    is_causal = d.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise CheckpointError(f"{source}: field '{prefix}is_causal' must be a bool")
    if d.get("attention_bias"):
        raise CheckpointError(f"{source}: field '{prefix}attention_bias' must be false (DFlash has no biases)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: field '{prefix}hidden_act' must be 'silu', got {act!r}")
    return dict(
        hidden_size=hidden,
        intermediate_size=_req(d, "intermediate_size", int, source, prefix),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=_req(d, "vocab_size", int, source, prefix),
        rms_norm_eps=_opt(d, "rms_norm_eps", float, source, 1e-6, prefix),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_opt(d, "max_position_embeddings", int, source, 40960, prefix),
        layer_types=layer_types,
        sliding_window=window,
        is_causal=is_causal,
    )


def _finish(kw: dict[str, Any], source: str, names: dict[str, str]) -> DraftConfig:
    """Cross-field checks; `names` spells mask_token_id / block_size / target_layer_ids as the file does."""
    if kw["mask_token_id"] >= kw["vocab_size"]:
        raise CheckpointError(
            f"{source}: field '{names['mask_token_id']}'={kw['mask_token_id']} is outside the vocabulary "
            f"(vocab_size={kw['vocab_size']})"
        )
    if kw["block_size"] < 2:
        raise CheckpointError(f"{source}: field '{names['block_size']}' must be >= 2, got {kw['block_size']}")
    ntl = kw.get("num_target_layers")
    if ntl is not None and any(i >= ntl for i in kw["target_layer_ids"]):
        raise CheckpointError(
            f"{source}: field '{names['target_layer_ids']}'={list(kw['target_layer_ids'])} has ids out of range for "
            f"num_target_layers={ntl}"
        )
    return DraftConfig(**kw)


def _set_fields(d: dict) -> list[tuple[str, str]]:
    """(prefix, key) of every field set in dflash_config, then at the top level. null / false / 0 / empty mean
    "feature off" (Gemma-derived configs carry final_logit_softcapping: null), so they count as unset."""
    dc = d.get("dflash_config")
    objs = ((dc if isinstance(dc, dict) else {}, "dflash_config."), (d, ""))
    return [(prefix, key) for obj, prefix in objs for key, value in obj.items() if value]


def _refuse_unserved(d: dict, source: str, allowed: tuple[str, ...]) -> None:
    """Refuse features of drafts we do not serve (`allowed`: those this format serves), naming the first found."""
    for prefix, key in _set_fields(d):
        unserved = key in UNSERVED_FIELDS or any(part in key.lower() for part in UNSERVED_KEY_PARTS)
        if unserved and key not in allowed:
            raise CheckpointError(f"{source}: field '{prefix}{key}' {UNSERVED_HINT}")


def _zlab_place(d: dict, dc: dict | None, key: str) -> tuple[dict, str]:
    """(object, prefix) holding a z-lab DFlash field: dflash_config wins over the top level; a field in
    neither is reported where the file's format keeps it."""
    if dc is not None and dc.get(key) is not None:
        return dc, "dflash_config."
    if d.get(key) is not None or dc is None:
        return d, ""
    return dc, "dflash_config."


def _from_zlab(d: dict, source: str) -> DraftConfig:
    arch = d.get("architectures")
    if arch is not None and (not isinstance(arch, list) or len(set(arch) & set(ZLAB_ARCHITECTURES)) != 1):
        raise CheckpointError(
            f"{source}: field 'architectures'={arch!r} is not a DFlash draft (expected one of "
            f"{list(ZLAB_ARCHITECTURES)})"
        )
    dc = d.get("dflash_config")
    if dc is not None and not isinstance(dc, dict):
        raise CheckpointError(f"{source}: field 'dflash_config' must be an object, got {dc!r}")
    # block_size alone is no evidence of the flat format: nested-format files often repeat it at the top level.
    if dc is None and d.get("mask_token_id") is None and d.get("target_layer_ids") is None:
        raise CheckpointError(
            f"{source}: missing field 'dflash_config' (object with mask_token_id, target_layer_ids; newer drafts "
            f"give both at the top level)"
        )
    kw = _common(d, source)
    place = {key: _zlab_place(d, dc, key) for key in ZLAB_FIELDS}
    names = {key: prefix + key for key, (_, prefix) in place.items()}
    obj, prefix = place["mask_token_id"]
    kw["mask_token_id"] = _req(obj, "mask_token_id", int, source, prefix)
    obj, prefix = place["block_size"]
    kw["block_size"] = _opt(obj, "block_size", int, source, 16, prefix)
    kw["num_target_layers"] = _opt(d, "num_target_layers", int, source, None)
    obj, _ = place["target_layer_ids"]
    if obj.get("target_layer_ids") is not None:
        kw["target_layer_ids"] = _layer_ids(obj["target_layer_ids"], source, names["target_layer_ids"])
    elif kw["num_target_layers"] is not None:
        # The z-lab code derives one id per draft layer when the list is absent.
        kw["target_layer_ids"] = build_target_layer_ids(kw["num_target_layers"], kw["num_hidden_layers"])
    else:
        raise CheckpointError(
            f"{source}: missing field '{names['target_layer_ids']}' (and no 'num_target_layers' to derive it)"
        )
    obj, prefix = place["input_embedding_scale"]
    kw["input_embedding_scale"] = _opt(obj, "input_embedding_scale", float, source, 1.0, prefix)
    obj, prefix = place["final_logit_softcapping"]
    cap = _opt(obj, "final_logit_softcapping", float, source, None, prefix)
    if cap is not None and cap <= 0:  # (0 means off in Gemma-derived configs, as null does)
        cap = None
    kw["final_logit_softcapping"] = cap
    obj, prefix = place["output_multiplier"]
    kw["output_multiplier"] = _opt(obj, "output_multiplier", float, source, 1.0, prefix)
    if not kw["output_multiplier"] > 0:  # (a scale <= 0 would rank the draft's worst tokens first)
        raise CheckpointError(f"{source}: field '{names['output_multiplier']}' must be > 0, got "
                              f"{kw['output_multiplier']}")
    kw["dflash2"] = _dflash2_fields(d, dc, source, kw, dflash2=DFLASH2_ARCHITECTURE in (arch or ()))
    kw["source_format"] = "zlab" if dc is not None else "zlab-flat"
    return _finish(kw, source, names)


def _dflash2_fields(d: dict, dc: dict | None, source: str, kw: dict[str, Any], dflash2: bool) -> DFlash2Fields | None:
    """A DFlash2 draft's fields, each required and checked (the authors' loader reads them with no default); a DFlash
    draft must set none of them (its checkpoint has no convolution or selector tensors)."""
    place = {key: _zlab_place(d, dc, key) for key in DFLASH2_FIELDS}
    if not dflash2:
        for key, (obj, prefix) in place.items():
            if obj.get(key):
                raise CheckpointError(f"{source}: field '{prefix}{key}' is a DFlash2 field, but 'architectures' does "
                                      f"not name {DFLASH2_ARCHITECTURE}")
        return None
    values = {key: _req(obj, key, int, source, prefix) for key, (obj, prefix) in place.items()}
    name = {key: prefix + key for key, (_, prefix) in place.items()}
    for key, v in values.items():
        if v < 1:
            raise CheckpointError(f"{source}: field '{name[key]}' must be >= 1, got {v}")
    if kw["hidden_size"] % values["conv_group_size"]:
        raise CheckpointError(f"{source}: field '{name['conv_group_size']}'={values['conv_group_size']} must divide "
                              f"hidden_size={kw['hidden_size']}")
    if values["selector_top_k"] > kw["vocab_size"]:
        raise CheckpointError(f"{source}: field '{name['selector_top_k']}'={values['selector_top_k']} exceeds "
                              f"vocab_size={kw['vocab_size']}")
    return DFlash2Fields(**values)


def _from_speculators(d: dict, source: str) -> DraftConfig:
    tl = d.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise CheckpointError(f"{source}: missing field 'transformer_layer_config' (speculators DFlash format)")
    kw = _common(tl, source, "transformer_layer_config.")
    # The outer num_hidden_layers is authoritative for the draft depth in speculators configs.
    if d.get("num_hidden_layers") is not None and d["num_hidden_layers"] != kw["num_hidden_layers"]:
        raise CheckpointError(
            f"{source}: field 'num_hidden_layers'={d['num_hidden_layers']} disagrees with "
            f"'transformer_layer_config.num_hidden_layers'={kw['num_hidden_layers']}"
        )
    dvs = d.get("draft_vocab_size")
    if dvs is not None and dvs != kw["vocab_size"]:
        raise CheckpointError(
            f"{source}: field 'draft_vocab_size'={dvs} differs from the target vocabulary "
            f"({kw['vocab_size']}); reduced draft vocabularies are not supported"
        )
    kw["mask_token_id"] = _req(d, "mask_token_id", int, source)
    kw["block_size"] = _opt(d, "block_size", int, source, 16)
    kw["num_target_layers"] = _opt(d, "num_target_layers", int, source, None)
    # Older speculators exports call the list target_layer_ids; report it under the name the file uses.
    ids_key = "aux_hidden_state_layer_ids"
    if d.get(ids_key) is None and d.get("target_layer_ids") is not None:
        ids_key = "target_layer_ids"
    if d.get(ids_key) is None:
        raise CheckpointError(f"{source}: missing field 'aux_hidden_state_layer_ids' (speculators DFlash format)")
    kw["target_layer_ids"] = _layer_ids(d[ids_key], source, ids_key)
    kw["source_format"] = "speculators"
    return _finish(kw, source, {"mask_token_id": "mask_token_id", "block_size": "block_size",
                                "target_layer_ids": ids_key})


# -------------------------------------------------------------------- target models
# Targets with recurrent / linear-attention layers (GDN, Mamba, short convolutions, lightning attention) keep
# per-request state that a rejected draft suffix would have to roll back; DFlash's verify-and-truncate of the KV
# cache alone cannot. Matched case- and underscore-insensitively against architectures and model_type.
RECURRENT_ARCHITECTURES = (
    "Mamba", "Jamba", "NemotronH", "FalconH1", "Zamba", "Qwen3Next", "Qwen3_5", "GraniteMoeHybrid", "Lfm2",
    "Bamba", "Plamo2", "MiniMaxText01", "MiniMaxM1", "KimiLinear", "RecurrentGemma",
)
# The recurrent families whose verify state our worker commits through SGLang (Gated DeltaNet layers).
GATED_DELTANET_ARCHITECTURES = ("Qwen3Next", "Qwen3_5")
# layer_types entries that hold no recurrent state (NemotronH lists its mlp / moe blocks there too).
STATELESS_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe")


def config_value(cfg: Any, name: str) -> Any:
    """cfg.name for config objects, cfg[name] for dicts (parsed config.json); None when absent."""
    return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)


def _listed(cfg: Any, name: str) -> tuple:
    v = config_value(cfg, name)
    return (v,) if isinstance(v, str) else tuple(v or ())


def _squash(name: str) -> str:
    return name.replace("_", "").replace("-", "").lower()


def recurrent_layers(target_hf_config: Any) -> str | None:
    """Evidence that a target has recurrent / linear-attention layers, e.g. "architecture Qwen3NextForCausalLM"
    or "layer_types has 'linear_attention'"; None for pure attention targets (Llama, Qwen3, Gemma, ...).

    Looks at the config (an HF PretrainedConfig, any object with attributes, or a config.json dict) and its
    nested text_config (multimodal wrappers such as Qwen3.5).
    """
    families = [_squash(a) for a in RECURRENT_ARCHITECTURES]
    for cfg in _configs(target_hf_config):
        for arch in _listed(cfg, "architectures"):
            if any(f in _squash(str(arch)) for f in families):
                return f"architecture {arch}"
        model_type = config_value(cfg, "model_type")
        if isinstance(model_type, str) and any(f in _squash(model_type) for f in families):
            return f"model_type {model_type!r}"
        for kind in _listed(cfg, "layer_types"):
            if str(kind) not in STATELESS_LAYER_TYPES:
                return f"layer_types has {kind!r}"
        pattern = config_value(cfg, "hybrid_override_pattern")
        if isinstance(pattern, str) and "M" in pattern:
            return f"hybrid_override_pattern {pattern!r} has 'M' (Mamba) layers"
        for kind in _listed(cfg, "layers_block_type"):
            if "mamba" in str(kind).lower():
                return f"layers_block_type has {kind!r}"
    return None


def _configs(cfg: Any) -> list:
    """A config and its nested text_config (multimodal wrappers such as Qwen3.5 / Gemma 4)."""
    text = config_value(cfg, "text_config")
    return [cfg] + ([text] if text is not None else [])


def gated_deltanet(target_hf_config: Any) -> bool:
    """Whether a hybrid target's linear layers are Gated DeltaNet (Qwen3.5 / Qwen3.6 / Qwen3-Next)."""
    families = [_squash(a) for a in GATED_DELTANET_ARCHITECTURES]
    for cfg in _configs(target_hf_config):
        names = [str(a) for a in _listed(cfg, "architectures")] + [str(config_value(cfg, "model_type") or "")]
        if any(f in _squash(n) for n in names for f in families):
            return True
    return False


def sliding_window_layers(target_hf_config: Any) -> str | None:
    """Evidence that a target has sliding-window attention layers (Gemma 2/3/4, ...), e.g. "layer_types has
    'sliding_attention'"; None when every attention layer sees the whole context."""
    for cfg in _configs(target_hf_config):
        if "sliding_attention" in _listed(cfg, "layer_types"):
            return "layer_types has 'sliding_attention'"
        if config_value(cfg, "use_sliding_window") and config_value(cfg, "sliding_window"):
            return f"sliding_window {config_value(cfg, 'sliding_window')}"
    return None
