import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_sglang.core.checkpoint import check_fit, load_drafter, save_drafter
from dflash_sglang.core.config import CheckpointError
from factories import draft_config_for, tiny_drafter, tiny_target

ZLAB_NAMES_PER_LAYER = {
    "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
    "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


@pytest.fixture
def draft_dir(tmp_path, target):
    return save_drafter(tiny_drafter(draft_config_for(target)), tmp_path / "draft")


def test_names_match_zlab_exactly(draft_dir):
    names = set(load_file(draft_dir / "model.safetensors"))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(2) for n in ZLAB_NAMES_PER_LAYER}
    assert names == expected  # 2 * 11 + 3 tensors, no embed/lm_head/rotary buffers


def test_round_trip_is_exact(tmp_path, target):
    model = tiny_drafter(draft_config_for(target))
    out = save_drafter(model, tmp_path / "d", dtype=torch.float32)
    loaded = load_drafter(out)
    assert loaded.cfg == model.cfg
    for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [1, 2, 3]


def test_bf16_default_and_model_prefix(draft_dir):
    assert load_drafter(draft_dir).fc.weight.dtype == torch.bfloat16
    sd = load_file(draft_dir / "model.safetensors")
    save_file({f"model.{k}": v for k, v in sd.items()}, str(draft_dir / "model.safetensors"))
    assert load_drafter(draft_dir, dtype=torch.float32).fc.weight.dtype == torch.float32


def _rewrite(draft_dir, fn):
    sd = load_file(draft_dir / "model.safetensors")
    fn(sd)
    save_file(sd, str(draft_dir / "model.safetensors"))


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda sd: sd.pop("layers.1.mlp.up_proj.weight"), "missing tensor 'layers.1.mlp.up_proj.weight'"),
        (lambda sd: sd.update({"lm_head.weight": torch.zeros(2, 2)}), "unexpected tensor 'lm_head.weight'"),
        (lambda sd: sd.update({"fc.weight": torch.zeros(32, 64)}), r"tensor 'fc.weight' has shape \[32, 64\]"),
        (lambda sd: sd.update({"layers.0.self_attn.k_norm.weight": torch.zeros(9)}), "k_norm.weight' has shape"),
    ],
)
def test_bad_tensors_are_named(draft_dir, mutate, match):
    _rewrite(draft_dir, mutate)
    with pytest.raises(CheckpointError, match=match):
        load_drafter(draft_dir)


def test_pickle_only_is_rejected(draft_dir):
    (draft_dir / "model.safetensors").unlink()
    torch.save({}, draft_dir / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin: pickle weights are never loaded"):
        load_drafter(draft_dir)


def test_garbled_safetensors(draft_dir):
    (draft_dir / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_drafter(draft_dir)


def test_fit_checks(target):
    good = draft_config_for(target)
    assert check_fit(good, target.config)["num_hidden_layers"] == 6
    from dataclasses import replace

    cases = [
        (replace(good, hidden_size=64), "'hidden_size'=64 does not match the target's hidden_size=32"),
        (replace(good, vocab_size=97), "'vocab_size'=97 does not match"),
        (replace(good, mask_token_id=500, vocab_size=96), "mask_token_id'=500 is not a row"),
        (replace(good, target_layer_ids=(1, 6)), r"ids \[6\] out of range for a target with 6 layers"),
        (replace(good, num_target_layers=36), "'num_target_layers'=36 but the target has 6 layers"),
    ]
    for cfg, match in cases:
        with pytest.raises(CheckpointError, match=match):
            check_fit(cfg, target.config, "d/config.json")
