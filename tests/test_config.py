import json
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest

from dflash_sglang.core.config import (CheckpointError, DraftConfig, build_target_layer_ids, gated_deltanet,
                                       recurrent_layers, sliding_window_layers)

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
        (lambda d: d.update(architectures=["LlamaForCausalLM"]), "not a DFlash v1 draft"),
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


DFLASH2_KEYS = ["output_multiplier", "projector_type", "selector_layers",
                "num_selector_layers", "conv_layers", "conv_kernel_size"]


@pytest.mark.parametrize("key", DFLASH2_KEYS)
@pytest.mark.parametrize("base,where", [(ZLAB_QWEN3_8B, "dflash_config"), (ZLAB_QWEN3_8B, "top"),
                                        (ZLAB_FLAT, "top"), (SPECULATORS, "top")], ids=["nested", "nested-top",
                                                                                         "flat", "speculators"])
def test_dflash2_fields_are_refused(base, where, key):
    d = json.loads(json.dumps(base))
    (d["dflash_config"] if where == "dflash_config" else d)[key] = 2
    name = re.escape(f"dflash_config.{key}" if where == "dflash_config" else key)
    match = rf"^draft/config.json: field '{name}' is a DFlash2 feature .*\(use SGLang's builtin DFLASH: .*=builtin\)$"
    with pytest.raises(CheckpointError, match=match):
        DraftConfig.from_dict(d, source="draft/config.json")


def test_dflash2_fields_switched_off_are_accepted():
    d = json.loads(json.dumps(ZLAB_QWEN3_8B))
    d.update(final_logit_softcapping=None, num_selector_layers=0)  # e.g. copied from a Gemma target config
    d["dflash_config"]["conv_layers"] = []
    assert DraftConfig.from_dict(d) == DraftConfig.from_dict(ZLAB_QWEN3_8B)


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
