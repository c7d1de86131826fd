import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_sglang.core.draft import checkpoint
from dflash_sglang.core.draft.checkpoint import (
    INDEX_FILE, WEIGHTS_FILE, check_fit, check_weight_headers, load_drafter, save_drafter,
)
from dflash_sglang.core.draft.config import CheckpointError, DraftConfig
from factories import DFLASH2_DRAFT, MUSE_GLIMMER_DFLASH2, draft_config_for, tiny_drafter, tiny_target

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
    sd = load_file(draft_dir / WEIGHTS_FILE)
    fn(sd)
    save_file(sd, str(draft_dir / WEIGHTS_FILE))


def _raw_header(draft_dir, fn):
    """Rewrite the weights file's JSON header in place: fn(header dict) -> new header (tensor bytes kept)."""
    raw = (draft_dir / WEIGHTS_FILE).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = json.dumps(fn(json.loads(raw[8:8 + n]))).encode()
    (draft_dir / WEIGHTS_FILE).write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def _raw_bytes(draft_dir, fn):
    (draft_dir / WEIGHTS_FILE).write_bytes(fn((draft_dir / WEIGHTS_FILE).read_bytes()))


def _entry(header, name, **kw):
    header[name].update(kw)
    return header


def _pickle_only(name):
    def mutate(draft_dir):
        (draft_dir / WEIGHTS_FILE).unlink()
        (draft_dir / name).write_bytes(b"never unpickled")  # only its name is looked at

    return mutate


def _model_prefix(draft_dir):
    sd = load_file(draft_dir / WEIGHTS_FILE)
    save_file({f"model.{k}": v for k, v in sd.items()}, str(draft_dir / WEIGHTS_FILE))


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _sharded(draft_dir):
    sd = load_file(draft_dir / WEIGHTS_FILE)
    (draft_dir / WEIGHTS_FILE).unlink()
    names = sorted(sd)
    weight_map = {n: SHARDS[i * 2 // len(names)] for i, n in enumerate(names)}
    for shard in SHARDS:
        save_file({n: sd[n] for n in names if weight_map[n] == shard}, str(draft_dir / shard))
    (draft_dir / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _sharded_then(fn):
    def mutate(draft_dir):
        _sharded(draft_dir)
        fn(draft_dir)

    return mutate


def _drop_from_shard(draft_dir):
    sd = load_file(draft_dir / SHARDS[1])
    sd.pop("norm.weight")
    save_file(sd, str(draft_dir / SHARDS[1]))


MALFORMED = [
    ("missing", lambda d: _rewrite(d, lambda sd: sd.pop("layers.1.mlp.up_proj.weight")),
     "model.safetensors: missing tensor 'layers.1.mlp.up_proj.weight'"),
    ("unexpected", lambda d: _rewrite(d, lambda sd: sd.update({"lm_head.weight": torch.zeros(2, 2)})),
     "unexpected tensor 'lm_head.weight'"),
    ("shape", lambda d: _rewrite(d, lambda sd: sd.update({"fc.weight": torch.zeros(32, 64)})),
     r"tensor 'fc.weight' has shape \[32, 64\], config.json implies \[32, 96\]"),
    ("norm-shape", lambda d: _rewrite(d, lambda sd: sd.update({"layers.0.self_attn.k_norm.weight": torch.zeros(9)})),
     "tensor 'layers.0.self_attn.k_norm.weight' has shape"),
    ("int-dtype", lambda d: _rewrite(d, lambda sd: sd.update({"norm.weight": torch.zeros(32, dtype=torch.int32)})),
     "tensor 'norm.weight' has dtype I32; draft weights must be one of BF16"),
    ("duplicate", lambda d: _rewrite(d, lambda sd: sd.update({"model.norm.weight": sd["norm.weight"].clone()})),
     "norm.weight' duplicates one in model.safetensors"),
    ("truncated-data", lambda d: _raw_bytes(d, lambda b: b[:-10]),
     r"tensor '[\w.]+' data ends at byte \d+ but only \d+ data bytes follow the header \(truncated file\)"),
    ("truncated-header", lambda d: _raw_bytes(d, lambda b: b[:40]),
     r"not a readable safetensors file \(header length \d+ exceeds the 32 bytes that follow: truncated\?\)"),
    ("too-short", lambda d: _raw_bytes(d, lambda b: b"abc"), "3 bytes, shorter than the 8-byte header length"),
    ("zeros", lambda d: _raw_bytes(d, lambda b: b"\x00" * 16), r"not a readable safetensors file \(header is not JSON"),
    ("garbage-header", lambda d: _raw_bytes(d, lambda b: b[:8] + b"#" * (len(b) - 8)), "header is not JSON"),
    ("header-not-object", lambda d: _raw_header(d, lambda h: [h]), "header is list, not a JSON object"),
    ("bad-entry", lambda d: _raw_header(d, lambda h: _entry(h, "fc.weight", shape="32x96")),
     "tensor 'fc.weight' has a malformed header entry"),
    ("byte-count", lambda d: _raw_header(d, lambda h: _entry(h, "norm.weight", shape=[16])),
     r"tensor 'norm.weight' has 64 data bytes, but BF16 \[16\] needs 32"),
    ("pickle-bin", _pickle_only("pytorch_model.bin"), "pytorch_model.bin: pickle weights are never loaded"),
    ("pickle-pt", _pickle_only("draft.pt"), "draft.pt: pickle weights are never loaded"),
    ("no-weights", lambda d: (d / WEIGHTS_FILE).unlink(), r"model.safetensors: missing \(no safetensors weights"),
    ("missing-shard", _sharded_then(lambda d: (d / SHARDS[0]).unlink()), f"shard '{SHARDS[0]}' is missing"),
    ("shard-lacks-tensor", _sharded_then(_drop_from_shard), f"{INDEX_FILE}: missing tensor 'norm.weight'"),
]


@pytest.mark.parametrize("check", ["headers", "load"])
@pytest.mark.parametrize("mutate,match", [pytest.param(fn, m, id=i) for i, fn, m in MALFORMED])
def test_malformed_checkpoints_fail_naming_file_and_tensor(draft_dir, check, mutate, match):
    cfg = DraftConfig.load(draft_dir)
    check_weight_headers(draft_dir, cfg)  # the good file passes
    mutate(draft_dir)
    with pytest.raises(CheckpointError, match=match) as err:
        check_weight_headers(draft_dir, cfg) if check == "headers" else load_drafter(draft_dir)
    assert len(str(err.value).splitlines()) == 1 and str(err.value).startswith(str(draft_dir))


def _no_safe_open(*args, **kwargs):
    raise AssertionError("the header check must not open tensor data")


@pytest.mark.parametrize("layout", [None, _model_prefix, _sharded], ids=["single", "model-prefix", "sharded"])
def test_good_layouts_pass_header_check_and_load(draft_dir, layout, monkeypatch):
    before = load_drafter(draft_dir).state_dict()
    if layout is not None:
        layout(draft_dir)
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "safe_open", _no_safe_open)
        check_weight_headers(draft_dir, DraftConfig.load(draft_dir))
    after = load_drafter(draft_dir).state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


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


# A DFlash2 draft's tensors beyond DFlash's (per layer, then the selector's), as the published checkpoints name them:
# the codebooks are stored without `.weight`.
DFLASH2_NAMES_PER_LAYER = {f"{conv}.{n}" for conv in ("attention_conv", "mlp_conv")
                           for n in ("base_kernel", "kernel_projection.weight")}
SELECTOR_NAMES = {f"candidate_selector.{n}" for n in ("hidden_projection.weight", "predecessor_codebook",
                                                      "successor_codebook")}



def test_dflash2_shapes_of_the_published_layout():
    """The tensors a published DFlash2 config implies (built on the meta device): 15 per layer and 6 more, the
    convolutions' base_kernel [2, taps, H] and kernel_projection [2 * taps * H / group, H], the selector's
    hidden_projection [r, H] and codebooks [V, r]."""
    shapes = checkpoint.expected_shapes(DraftConfig.from_dict(MUSE_GLIMMER_DFLASH2))
    assert len(shapes) == 5 * 15 + 6
    assert {n for n in shapes if "conv" in n or "selector" in n} == (
        {f"layers.{i}.{n}" for i in range(5) for n in DFLASH2_NAMES_PER_LAYER} | SELECTOR_NAMES)
    assert shapes["layers.4.mlp_conv.base_kernel"] == (2, 2, 6656)
    assert shapes["layers.0.attention_conv.kernel_projection.weight"] == (1664, 6656)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 6656)
    assert shapes["candidate_selector.predecessor_codebook"] == shapes["candidate_selector.successor_codebook"] == (
        202048, 256)


@pytest.fixture
def dflash2_dir(tmp_path, target):
    return save_drafter(tiny_drafter(draft_config_for(target, **DFLASH2_DRAFT)), tmp_path / "dflash2",
                        dtype=torch.float32)


def test_dflash2_round_trip_is_exact(dflash2_dir, target):
    names = set(load_file(dflash2_dir / WEIGHTS_FILE))
    assert names == ({"fc.weight", "hidden_norm.weight", "norm.weight"} | SELECTOR_NAMES
                     | {f"layers.{i}.{n}" for i in range(2) for n in ZLAB_NAMES_PER_LAYER | DFLASH2_NAMES_PER_LAYER})
    cfg = json.loads((dflash2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k", "output_multiplier")} == dict(
        conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=4, output_multiplier=0.75)
    loaded, saved = load_drafter(dflash2_dir), load_file(dflash2_dir / WEIGHTS_FILE)
    assert loaded.cfg == draft_config_for(target, **DFLASH2_DRAFT)
    assert all(torch.equal(saved[k], v) for k, v in loaded.state_dict().items())


def _as_dflash(draft_dir):
    """The same directory's config.json claiming a DFlash draft (no DFlash2 fields)."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        cfg["dflash_config"].pop(key)
    (draft_dir / "config.json").write_text(json.dumps(cfg))


DFLASH2_MALFORMED = [
    ("codebook-weight", lambda d: _rewrite(d, lambda sd: sd.update(
        {"candidate_selector.successor_codebook.weight": sd.pop("candidate_selector.successor_codebook")})),
     "unexpected tensor 'candidate_selector.successor_codebook.weight'"),
    ("no-conv", lambda d: _rewrite(d, lambda sd: sd.pop("layers.1.mlp_conv.base_kernel")),
     "missing tensor 'layers.1.mlp_conv.base_kernel'"),
    ("projection-shape", lambda d: _rewrite(d, lambda sd: sd.update(
        {"layers.0.attention_conv.kernel_projection.weight": torch.zeros(8, 32)})),
     r"tensor 'layers.0.attention_conv.kernel_projection.weight' has shape \[8, 32\], config.json implies \[16, 32\]"),
    ("as-dflash", _as_dflash, "unexpected tensor '(layers.0.attention_conv|candidate_selector)"),
]


@pytest.mark.parametrize("check", ["headers", "load"])
@pytest.mark.parametrize("mutate,match", [pytest.param(fn, m, id=i) for i, fn, m in DFLASH2_MALFORMED])
def test_malformed_dflash2_checkpoints_fail_naming_the_tensor(dflash2_dir, check, mutate, match):
    check_weight_headers(dflash2_dir, DraftConfig.load(dflash2_dir))  # the good file passes
    mutate(dflash2_dir)
    with pytest.raises(CheckpointError, match=match):
        if check == "headers":
            check_weight_headers(dflash2_dir, DraftConfig.load(dflash2_dir))
        else:
            load_drafter(dflash2_dir)
