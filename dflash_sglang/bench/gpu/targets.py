"""Targets the GPU session builds where it runs (the real SmolLM2-135M cannot travel): seeded, so every machine builds
the same weights.

- `smollm2_dummy`: the SmolLM2-135M-Instruct architecture (the testbed target's config.json: 30 Llama layers, hidden
  576, GQA 9 / 3 heads of 64, vocab 49152, tied embeddings) with seeded random weights, the shipped drafter's target
  (dflash_sglang/assets/smollm2_135m_dflash fits it), for throughput at a simulated acceptance and the training run;
  a character tokenizer with a chat template (ids 1..95 of the vocabulary) for what needs text.
- `qwen3_8b_pair`: a Qwen3-8B target (Qwen/Qwen3-8B's config.json) and a drafter of z-lab/Qwen3-8B-DFlash-b16's
  config, config files only: SGLang's dummy load format draws both models' weights where they load (no 16 GB
  checkpoint travels), for throughput at the user's shape; at `QWEN3_TINY` the same two architectures at toy sizes for
  the CPU rehearsal.
- `tiny_pair` / `hybrid_pair` / `gemma4_draft`: the CPU e2e tests' tiny pairs (tests/test_sglang_e2e.py
  `write_pair`, vocab 8: the sampled distributions are checked exactly over every continuation), at `hidden` 256 on
  CUDA (FlashInfer needs head_dim 64) and 32 on CPU.

The tiny pairs come from tests/ (factories, the e2e scenario), so the session runs from a source checkout.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from dflash_sglang.core.draft.config import build_target_layer_ids

from dflash_sglang.bench.memory.window_capacity import QWEN3_8B, QWEN3_8B_DFLASH

REPO = Path(__file__).resolve().parents[3]
SHIPPED_DRAFT = REPO / "dflash_sglang" / "assets" / "smollm2_135m_dflash"
SMOLLM2_135M = dict(  # the testbed target's config.json (testbed/target.py converts the real one)
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, pad_token_id=2, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
)
# Qwen/Qwen3-8B's and z-lab/Qwen3-8B-DFlash-b16's config.json: window_capacity.py's KV-sizing fields plus the rest of
# what the published files hold (a dummy load builds the model from these alone)
QWEN3_8B_TARGET = {**QWEN3_8B, "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
                   "initializer_range": 0.02, "max_window_layers": 36, "rope_scaling": None, "sliding_window": None,
                   "use_sliding_window": False, "use_cache": True}
QWEN3_8B_DRAFT = {**QWEN3_8B_DFLASH, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
                  "layer_types": ["full_attention"] * 5, "sliding_window": None, "use_sliding_window": False,
                  "rope_scaling": None, "attention_bias": False, "hidden_act": "silu", "dtype": "bfloat16",
                  "bos_token_id": 151643, "eos_token_id": 151645}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}:{% endif %}")


@dataclass(frozen=True)
class Qwen3Shape:
    """The sizes a Qwen3 target + DFlash drafter pair is built at; everything else (architectures, norms, RoPE, block
    16, five target features, the special ids' offsets from the vocabulary's end) stays Qwen3-8B's."""

    hidden: int = 4096
    intermediate: int = 12288
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936
    target_layers: int = 36
    draft_layers: int = 5


QWEN3_8B_SHAPE = Qwen3Shape()
QWEN3_TINY = Qwen3Shape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=1024, target_layers=8,
                        draft_layers=2)  # CPU float32: an Engine's forward costs next to nothing


def qwen3_configs(shape: Qwen3Shape = QWEN3_8B_SHAPE) -> tuple[dict, dict]:
    """(target, draft) config.json contents at `shape`: Qwen3-8B's and its z-lab drafter's at the default."""
    sizes = {"hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_attention_heads": shape.heads,
             "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab}

    def special(token_id: int) -> int:  # bos / eos / mask keep their distance from the vocabulary's end
        return token_id - QWEN3_8B_TARGET["vocab_size"] + shape.vocab

    target = {**QWEN3_8B_TARGET, **sizes, "num_hidden_layers": shape.target_layers,
              "max_window_layers": shape.target_layers, "bos_token_id": special(QWEN3_8B_TARGET["bos_token_id"]),
              "eos_token_id": special(QWEN3_8B_TARGET["eos_token_id"])}
    dc = QWEN3_8B_DRAFT["dflash_config"]
    features = len(dc["target_layer_ids"])
    draft = {**QWEN3_8B_DRAFT, **sizes, "num_hidden_layers": shape.draft_layers,
             "layer_types": ["full_attention"] * shape.draft_layers, "num_target_layers": shape.target_layers,
             "bos_token_id": target["bos_token_id"], "eos_token_id": target["eos_token_id"],
             "dflash_config": {**dc, "mask_token_id": special(dc["mask_token_id"]),
                               "target_layer_ids": list(build_target_layer_ids(shape.target_layers, features))}}
    return target, draft


def qwen3_8b_pair(out: Path, shape: Qwen3Shape = QWEN3_8B_SHAPE) -> tuple[Path, Path]:
    """out/target and out/draft holding only config.json (`qwen3_configs(shape)`): load both with SGLang's dummy load
    format (`load_format` / `speculative_draft_load_format` "dummy"). Returns (target dir, draft dir)."""
    dirs = out / "target", out / "draft"
    for path, config in zip(dirs, qwen3_configs(shape)):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config, indent=1))
    return dirs


def tests_importable() -> None:
    """Put tests/ on sys.path (factories, the e2e scenario); refuse outside a source checkout."""
    tests = REPO / "tests"
    if not (tests / "test_sglang_e2e.py").is_file():
        raise RuntimeError(f"the GPU session runs from a source checkout: {tests}/test_sglang_e2e.py is missing")
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))


def smollm2_dummy(out: Path, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """The SmolLM2-135M architecture with seeded random weights (HF's initialisation) in `out` (reused when there),
    with a character tokenizer and chat template; returns `out`."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tests_importable()
    from factories import char_tokenizer

    torch.manual_seed(seed)
    config = LlamaConfig(**SMOLLM2_135M)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok = char_tokenizer(96)  # ids 1..95: printable characters; the rest of the vocabulary has no text
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


def tiny_pair(root: Path, hidden: int, arch: str = "llama") -> Path:
    """tests/test_sglang_e2e.py's pair (target + draft, vocab 8, block 8) of `arch` in `root` (reused when there)."""
    tests_importable()
    import test_sglang_e2e as e2e

    if not (root / "draft" / "config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        e2e.write_pair(root, arch, hidden=hidden)
    return root


def gemma4_draft(root: Path, hidden: int) -> Path:
    """A Gemma 4-style draft (sliding-window then full layers, soft-capped logits: factories.GEMMA4_DRAFT) of the
    tiny llama pair's target, in root/gemma4_draft."""
    tests_importable()
    import test_sglang_e2e as e2e
    from factories import GEMMA4_DRAFT, draft_config_for, tiny_drafter, tiny_target, write_draft

    out = root / "gemma4_draft"
    if not (out / "config.json").is_file():
        target = tiny_target("llama", vocab=e2e.VOCAB, hidden=hidden, seed=2)  # the pair's target (write_pair)
        cfg = draft_config_for(target, block_size=e2e.BLOCK, **GEMMA4_DRAFT)
        write_draft(out, tiny_drafter(cfg, seed=2))
    return out


def synthetic_sharegpt(path: Path, n: int, seed: int = 0) -> Path:
    """`n` ShareGPT-format conversations of random printable text (what `dflash-sglang train --data FILE` reads)."""
    import json
    import random

    rng = random.Random(seed)
    chars = [chr(c) for c in range(33, 127)]
    convs = [{"id": f"c{i}_0", "conversations": [
        {"from": "human", "value": "".join(rng.choice(chars) for _ in range(rng.randint(16, 64)))},
        {"from": "gpt", "value": "ok"}]} for i in range(n)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(convs))
    return path
