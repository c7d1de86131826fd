import json

import pytest

from dflash_sglang.core.config import CheckpointError, DraftConfig, build_target_layer_ids

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


@pytest.mark.parametrize("layers,n,expected", [(36, 5, (1, 9, 17, 25, 33)), (64, 5, (1, 16, 31, 46, 61)), (30, 1, (15,))])
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


def test_sliding_layers_and_rope_parameters():
    d = json.loads(json.dumps(ZLAB_QWEN3_8B))
    d["layer_types"] = ["sliding_attention"] * 4 + ["full_attention"]
    d["sliding_window"] = 2048
    d.pop("rope_theta")
    d["rope_parameters"] = {"rope_theta": 5e6, "rope_type": "default"}
    cfg = DraftConfig.from_dict(d)
    assert cfg.layer_is_causal(0) and not cfg.layer_is_causal(4)
    assert cfg.layer_window(0) == 2048 and cfg.layer_window(4) is None and cfg.rope_theta == 5e6
    d["is_causal"] = False
    assert not DraftConfig.from_dict(d).layer_is_causal(0)


def test_speculators_format():
    d = {
        "speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"], "block_size": 8,
        "mask_token_id": 151669, "aux_hidden_state_layer_ids": [1, 17, 33], "num_hidden_layers": 3,
        "transformer_layer_config": {k: ZLAB_QWEN3_8B[k] for k in (
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "vocab_size")} | {"num_hidden_layers": 3},
    }
    cfg = DraftConfig.from_dict(d)
    assert cfg.source_format == "speculators" and cfg.target_layer_ids == (1, 17, 33) and cfg.block_size == 8


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id"),
        (lambda d: d["dflash_config"].update(mask_token_id=200000), "mask_token_id'=200000 is outside"),
        (lambda d: d["dflash_config"].update(target_layer_ids=[1, 40]), "out of range for num_target_layers=36"),
        (lambda d: d["dflash_config"].update(target_layer_ids="1,2"), "target_layer_ids' must be a non-empty list"),
        (lambda d: d.update(hidden_size="4096"), "'hidden_size' must be int"),
        (lambda d: d.pop("intermediate_size"), "missing field 'intermediate_size'"),
        (lambda d: d.update(architectures=["LlamaForCausalLM"]), "not a DFlash v1 draft"),
        (lambda d: d.update(num_key_value_heads=5), "must divide num_attention_heads"),
        (lambda d: d.update(layer_types=["full_attention"] * 4), "layer_types"),
        (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
        (lambda d: d.pop("dflash_config"), "missing field 'dflash_config'"),
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
