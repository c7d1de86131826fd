import json
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from dflash_sglang.core.draft.config import (CheckpointError, DFlash2Fields, DraftConfig, build_target_layer_ids,
                                             gated_deltanet, recurrent_layers, sliding_window_layers)
from factories import MUSE_GLIMMER_DFLASH2

ZLAB_QWEN3_8B = {
    "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3", "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "num_target_layers": 36, "num_hidden_layers": 5, "hidden_size": 4096, "intermediate_size": 12288,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "layer_types": ["full_attention"] * 5, "sliding_window": None, "use_sliding_window": False,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None, "vocab_size": 151936,
    "attention_bias": False, "hidden_act": "silu", "tie_word_embeddings": False, "dtype": "bfloat16",
}


def _flat(d: dict) -> dict:
    """The newer z-lab layout: the dflash_config fields at the top level, no dflash_config object."""
    d = json.loads(json.dumps(d))
    dc = d.pop("dflash_config")
    return d | dc


ZLAB_FLAT = _flat(ZLAB_QWEN3_8B)
FORMATS = {"zlab": (ZLAB_QWEN3_8B, "dflash_config."), "zlab-flat": (ZLAB_FLAT, "")}


@pytest.mark.parametrize("layers,n,expected",
                         [(36, 5, (1, 9, 17, 25, 33)), (64, 5, (1, 16, 31, 46, 61)), (30, 1, (15,))])
def test_default_layer_ids(layers, n, expected):
    assert build_target_layer_ids(layers, n) == expected


def test_zlab_config_parses():
    cfg = DraftConfig.from_dict(ZLAB_QWEN3_8B)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert (cfg.mask_token_id, cfg.block_size, cfg.n_features, cfg.head_dim) == (151669, 16, 5, 128)
    assert cfg.layer_types == ("full_attention",) * 5 and not cfg.layer_is_causal(0)
    again = DraftConfig.from_dict(cfg.to_dict())
    assert again == cfg


def test_default_ids_when_absent_and_nested_block_size():
    d = json.loads(json.dumps(ZLAB_QWEN3_8B))
    del d["dflash_config"]["target_layer_ids"]
    d["dflash_config"]["block_size"] = 10
    cfg = DraftConfig.from_dict(d)
    assert cfg.target_layer_ids == build_target_layer_ids(36, 5) and cfg.block_size == 10


def test_flat_zlab_config_parses():
    nested, flat = DraftConfig.from_dict(ZLAB_QWEN3_8B), DraftConfig.from_dict(ZLAB_FLAT)
    assert flat.source_format == "zlab-flat" and replace(flat, source_format="zlab") == nested
    assert DraftConfig.from_dict(flat.to_dict()) == nested  # written back in the nested layout


def test_dflash_config_wins_over_top_level():
    d = json.loads(json.dumps(ZLAB_QWEN3_8B))
    d.update(mask_token_id=7, target_layer_ids=[2, 3], block_size=4)
    d["dflash_config"]["block_size"] = 10
    cfg = DraftConfig.from_dict(d)
    assert (cfg.mask_token_id, cfg.target_layer_ids, cfg.block_size) == (151669, (1, 9, 17, 25, 33), 10)
    assert cfg.source_format == "zlab"
    del d["dflash_config"]["block_size"]  # a field dflash_config lacks comes from the top level
    assert DraftConfig.from_dict(d).block_size == 4


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "rope,theta,scaling",
    [
        ({"rope_theta": 5e6, "rope_type": "default"}, 5e6, None),
        ({"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}, 5e5, "llama3"),
    ],
    ids=["default", "llama3"],
)
def test_sliding_layers_and_rope_parameters(fmt, rope, theta, scaling):
    d = json.loads(json.dumps(FORMATS[fmt][0]))
    d["layer_types"] = ["sliding_attention"] * 4 + ["full_attention"]
    d["sliding_window"] = 2048
    d.pop("rope_theta")
    d["rope_parameters"] = rope  # newer configs nest rope settings here instead of rope_theta / rope_scaling
    cfg = DraftConfig.from_dict(d)
    assert cfg.layer_is_causal(0) and not cfg.layer_is_causal(4)
    assert cfg.layer_window(0) == 2048 and cfg.layer_window(4) is None and cfg.rope_theta == theta
    assert (cfg.rope_scaling or {}).get("rope_type") == scaling and cfg.source_format == fmt
    d["is_causal"] = False
    assert not DraftConfig.from_dict(d).layer_is_causal(0)


SPECULATORS = {
    "speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"], "block_size": 8,
    "mask_token_id": 151669, "aux_hidden_state_layer_ids": [1, 17, 33], "num_hidden_layers": 3,
    "transformer_layer_config": {k: ZLAB_QWEN3_8B[k] for k in (
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "rms_norm_eps", "rope_theta", "vocab_size")} | {"num_hidden_layers": 3},
}


def test_speculators_format():
    cfg = DraftConfig.from_dict(SPECULATORS)
    assert cfg.source_format == "speculators" and cfg.target_layer_ids == (1, 17, 33) and cfg.block_size == 8


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "key,value,match",
    [
        ("mask_token_id", None, "missing field '{p}mask_token_id'"),
        ("mask_token_id", 200000, "field '{p}mask_token_id'=200000 is outside"),
        ("mask_token_id", "7", "field '{p}mask_token_id' must be int"),
        ("target_layer_ids", [1, 40], r"field '{p}target_layer_ids'=\[1, 40\] has ids out of range"),
        ("target_layer_ids", "1,2", "field '{p}target_layer_ids' must be a non-empty list"),
        ("block_size", 1, "field '{p}block_size' must be >= 2"),
        ("input_embedding_scale", "x", "field '{p}input_embedding_scale' must be float"),
    ],
)
def test_dflash_fields_are_named_as_the_file_spells_them(fmt, key, value, match):
    base, prefix = FORMATS[fmt]
    d = json.loads(json.dumps(base))
    holder = d["dflash_config"] if prefix else d
    holder.pop(key, None)
    if value is not None:
        holder[key] = value
    with pytest.raises(CheckpointError, match="^draft/config.json: " + match.format(p=re.escape(prefix))):
        DraftConfig.from_dict(d, source="draft/config.json")


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d.update(hidden_size="4096"), "'hidden_size' must be int"),
        (lambda d: d.pop("intermediate_size"), "missing field 'intermediate_size'"),
        (lambda d: d.update(architectures=["LlamaForCausalLM"]), "is not a DFlash draft"),
        (lambda d: d.update(architectures=["DFlashDraftModel", "DFlash2DraftModel"]), "is not a DFlash draft"),
        (lambda d: d.update(num_key_value_heads=5), "must divide num_attention_heads"),
        (lambda d: d.update(layer_types=["full_attention"] * 4), "layer_types"),
        (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
        (lambda d: d.pop("dflash_config"), "missing field 'dflash_config'"),
        (lambda d: d.update(dflash_config=[1]), "field 'dflash_config' must be an object"),
    ],
)
def test_bad_configs_name_the_field(mutate, match):
    d = json.loads(json.dumps(ZLAB_QWEN3_8B))
    mutate(d)
    with pytest.raises(CheckpointError, match=match):
        DraftConfig.from_dict(d, source="draft/config.json")


def test_missing_and_invalid_json(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: missing"):
        DraftConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        DraftConfig.load(tmp_path)


UNSERVED_KEYS = ["projector_type", "selector_layers", "num_selector_layers", "conv_layers"]
PLACES = [(ZLAB_QWEN3_8B, "dflash_config"), (ZLAB_QWEN3_8B, "top"), (ZLAB_FLAT, "top"), (SPECULATORS, "top")]
HINT = r" is a feature dflash-sglang does not serve \(use SGLang's builtin DFLASH: .*=builtin\)$"


def _with(base: dict, where: str, **fields) -> dict:
    d = json.loads(json.dumps(base))
    (d["dflash_config"] if where == "dflash_config" else d).update(fields)
    return d


@pytest.mark.parametrize("key", UNSERVED_KEYS)
@pytest.mark.parametrize("base,where", PLACES, ids=["nested", "nested-top", "flat", "speculators"])
def test_features_of_other_drafts_are_refused(base, where, key):
    """Domino's projector, and selector or conv settings that DFlash2 drafts do not have, are refused by name."""
    name = re.escape(f"dflash_config.{key}" if where == "dflash_config" else key)
    with pytest.raises(CheckpointError, match=rf"^draft/config.json: field '{name}'{HINT}"):
        DraftConfig.from_dict(_with(base, where, **{key: 2}), source="draft/config.json")


@pytest.mark.parametrize("key", ["conv_kernel_size", "selector_top_k", "output_multiplier"])
def test_speculators_configs_have_no_dflash2_fields(key):
    with pytest.raises(CheckpointError, match=rf"^draft/config.json: field '{key}'{HINT}"):
        DraftConfig.from_dict(_with(SPECULATORS, "top", **{key: 2}), source="draft/config.json")


@pytest.mark.parametrize("base,where", PLACES[:3], ids=["nested", "nested-top", "flat"])
def test_dflash2_fields_need_the_dflash2_architecture(base, where):
    """A DFlash draft setting a DFlash2 field would be served without the convolutions and selector its checkpoint
    was trained with: refused, naming the field."""
    name = re.escape("dflash_config.selector_rank" if where == "dflash_config" else "selector_rank")
    with pytest.raises(CheckpointError, match=rf"^draft/config.json: field '{name}' is a DFlash2 field, but "
                                              r"'architectures' does not name DFlash2DraftModel$"):
        DraftConfig.from_dict(_with(base, where, selector_rank=256), source="draft/config.json")


def test_features_switched_off_are_accepted():
    d = json.loads(json.dumps(ZLAB_QWEN3_8B))
    d.update(final_logit_softcapping=None, num_selector_layers=0)  # e.g. copied from a Gemma target config
    d["dflash_config"].update(conv_layers=[], conv_kernel_size=0)
    assert DraftConfig.from_dict(d) == DraftConfig.from_dict(ZLAB_QWEN3_8B)


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_dflash2_config_parses(layout):
    """The published Muse Glimmer DFlash2 config: its DFlash2 fields, scaled and soft-capped logits, bidirectional
    sliding-window layers; written back as the authors' loader reads it."""
    d = MUSE_GLIMMER_DFLASH2 if layout == "nested" else _flat(MUSE_GLIMMER_DFLASH2)
    cfg = DraftConfig.from_dict(d)
    assert cfg.dflash2 == DFlash2Fields(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping, cfg.block_size) == (0.19611613513818404, 20.0, 16)
    assert not cfg.layer_is_causal(0) and cfg.layer_window(4) == 2048 and cfg.rope_theta == 500000.0
    back = cfg.to_dict()
    assert back["architectures"] == ["DFlash2DraftModel"] and back["dflash_config"]["selector_top_k"] == 16
    assert DraftConfig.from_dict(back) == replace(cfg, source_format="zlab")


@pytest.mark.parametrize("key,value,match", [
    ("selector_top_k", None, "missing field 'dflash_config.selector_top_k'"),
    ("conv_kernel_size", 0, r"field 'dflash_config.conv_kernel_size' must be >= 1, got 0"),
    ("selector_rank", 2.5, "field 'dflash_config.selector_rank' must be int, got 2.5"),
    ("conv_group_size", 12, r"field 'dflash_config.conv_group_size'=12 must divide hidden_size=6656"),
    ("selector_top_k", 300000, r"field 'dflash_config.selector_top_k'=300000 exceeds vocab_size=202048"),
    ("output_multiplier", -0.5, r"field 'dflash_config.output_multiplier' must be > 0, got -0.5"),
])
def test_dflash2_fields_are_checked(key, value, match):
    d = json.loads(json.dumps(MUSE_GLIMMER_DFLASH2))
    d["dflash_config"].pop(key)
    if value is not None:
        d["dflash_config"][key] = value
    with pytest.raises(CheckpointError, match=f"^draft/config.json: {match}$"):
        DraftConfig.from_dict(d, source="draft/config.json")


@pytest.mark.parametrize("fmt", FORMATS)
def test_dflash_drafts_may_scale_their_logits(fmt):
    """output_multiplier scales any z-lab draft's logits (as the authors' code applies it), and round-trips."""
    base, prefix = FORMATS[fmt]
    d = json.loads(json.dumps(base))
    (d["dflash_config"] if prefix else d)["output_multiplier"] = 0.5
    cfg = DraftConfig.from_dict(d)
    assert cfg.output_multiplier == 0.5 and cfg.dflash2 is None
    assert DraftConfig.from_dict(cfg.to_dict()).output_multiplier == 0.5


@pytest.mark.parametrize("where", ["dflash_config", "top"])
def test_gemma4_drafts_soft_cap_their_logits(where):
    """z-lab's Gemma 4 drafts are DFlash v1 with final_logit_softcapping (top level in the published config); it is
    read from either place, round-trips, and 0 / null mean off (as Gemma-derived configs spell it)."""
    d = json.loads(json.dumps(ZLAB_QWEN3_8B))
    (d["dflash_config"] if where == "dflash_config" else d)["final_logit_softcapping"] = 30
    cfg = DraftConfig.from_dict(d)
    assert cfg.final_logit_softcapping == 30.0
    assert DraftConfig.from_dict(cfg.to_dict()) == cfg
    for off in (0, None):
        (d["dflash_config"] if where == "dflash_config" else d)["final_logit_softcapping"] = off
        assert DraftConfig.from_dict(d).final_logit_softcapping is None
    (d["dflash_config"] if where == "dflash_config" else d)["final_logit_softcapping"] = "30"
    prefix = "dflash_config." if where == "dflash_config" else ""
    with pytest.raises(CheckpointError, match=rf"field '{prefix}final_logit_softcapping' must be float"):
        DraftConfig.from_dict(d)


def test_target_families():
    """Gated DeltaNet hybrids (what the worker commits state for) and sliding-window targets (chains only)."""
    qwen36 = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"model_type": "qwen3_5_text"}}
    assert gated_deltanet(qwen36) and gated_deltanet(SimpleNamespace(model_type="qwen3_next"))
    assert not gated_deltanet({"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"})
    gemma4 = {"text_config": {"layer_types": ["sliding_attention"] * 5 + ["full_attention"]}}
    assert sliding_window_layers(gemma4) == "layer_types has 'sliding_attention'"
    assert sliding_window_layers({"layer_types": ["full_attention"] * 4, "sliding_window": None}) is None
    assert sliding_window_layers(SimpleNamespace(use_sliding_window=True, sliding_window=4096)) == "sliding_window 4096"


# ------------------------------------------------------------------ recurrent_layers (hybrid targets)
HYBRID_ARCHITECTURES = [
    "MambaForCausalLM", "Mamba2ForCausalLM", "FalconMambaForCausalLM", "JambaForCausalLM", "NemotronHForCausalLM",
    "FalconH1ForCausalLM", "Zamba2ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM", "GraniteMoeHybridForCausalLM", "Lfm2ForCausalLM", "BambaForCausalLM",
    "Plamo2ForCausalLM", "MiniMaxText01ForCausalLM", "MiniMaxM1ForCausalLM", "KimiLinearForCausalLM",
    "RecurrentGemmaForCausalLM",
]


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_recurrent_architectures(arch):
    assert recurrent_layers(SimpleNamespace(architectures=[arch], model_type="x")) == f"architecture {arch}"


@pytest.mark.parametrize(
    "cfg,evidence",
    [
        (SimpleNamespace(layer_types=["linear_attention", "full_attention"]), "layer_types has 'linear_attention'"),
        (SimpleNamespace(layer_types=["conv", "full_attention"]), "layer_types has 'conv'"),
        (SimpleNamespace(layer_types=["attention", "mamba2"]), "layer_types has 'mamba2'"),
        (SimpleNamespace(layer_types=["full_attention", "mlp", "moe", "gdn"]), "layer_types has 'gdn'"),
        (SimpleNamespace(hybrid_override_pattern="M-M*-ME"), "hybrid_override_pattern 'M-M*-ME' has 'M'"),
        (SimpleNamespace(layers_block_type=["attention", "mamba"]), "layers_block_type has 'mamba'"),
        (SimpleNamespace(model_type="qwen3_next"), "model_type 'qwen3_next'"),
        (SimpleNamespace(architectures=["SomeVLM"], text_config=SimpleNamespace(layer_types=["linear_attention"])),
         "layer_types has 'linear_attention'"),
        ({"architectures": ["SomeVLM"], "text_config": {"model_type": "qwen3_5_text"}}, "model_type 'qwen3_5_text'"),
    ],
    ids=["linear", "conv", "mamba2", "gdn", "nemotron-h", "jamba", "model_type", "text_config", "dict"],
)
def test_recurrent_layer_evidence(cfg, evidence):
    assert recurrent_layers(cfg).startswith(evidence)


@pytest.mark.parametrize(
    "cfg",
    [
        SimpleNamespace(architectures=["LlamaForCausalLM"], model_type="llama"),
        SimpleNamespace(architectures=["Qwen3ForCausalLM"], model_type="qwen3", layer_types=["full_attention"] * 4),
        SimpleNamespace(architectures=["Gemma3ForCausalLM"], layer_types=["sliding_attention", "full_attention"]),
        SimpleNamespace(architectures=["Llama4ForConditionalGeneration"],
                        text_config=SimpleNamespace(layer_types=["chunked_attention", "full_attention"])),
        SimpleNamespace(architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2"),
        SimpleNamespace(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl"),
        SimpleNamespace(hybrid_override_pattern="*-*-"),
        SimpleNamespace(),
    ],
    ids=["llama", "qwen3", "gemma3", "llama4", "minimax-m2", "qwen2.5-vl", "attention-pattern", "empty"],
)
def test_attention_only_targets_have_no_recurrent_layers(cfg):
    assert recurrent_layers(cfg) is None


@pytest.mark.parametrize(
    "name,hybrid",
    [("LlamaConfig", False), ("Qwen3Config", False), ("Gemma3TextConfig", False), ("GptOssConfig", False),
     ("Qwen3NextConfig", True), ("Qwen3_5Config", True), ("NemotronHConfig", True), ("JambaConfig", True),
     ("FalconH1Config", True), ("Lfm2Config", True)],
)
def test_recurrent_layers_on_hf_configs(name, hybrid):
    config_cls = getattr(pytest.importorskip("transformers"), name, None)
    if config_cls is None:
        pytest.skip(f"transformers has no {name}")
    assert (recurrent_layers(config_cls()) is not None) == hybrid
