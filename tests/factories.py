"""Tiny random targets and drafters for CPU tests (built from configs; no hub access)."""
from __future__ import annotations

import functools
import importlib
from pathlib import Path

import torch

from dflash_sglang.core.draft.checkpoint import save_drafter
from dflash_sglang.core.draft.config import DFlash2Fields, DraftConfig, build_target_layer_ids
from dflash_sglang.core.draft.drafter import DFlashDrafter
from dflash_sglang.core.shape.goodput import FixedStepCost


# Hybrid targets: Gated DeltaNet (linear-attention) layers between full-attention ones, as Qwen3.5 / Qwen3-Next have.
HYBRID_ARCHS = ("qwen3_5", "qwen3_next")
ARCHS = ("llama", "qwen3", "gemma4") + HYBRID_ARCHS
# The step cost a goodput controller sees in tests (core/shape/goodput.py FixedStepCost, TERMS order), not the clock: a
# memory-bound decode where a step's fixed cost dominates, verify rows are nearly free and a drafter pass costs a tenth
# of a plain step, so drafting pays wherever drafts are accepted and the controller's choices never follow the load.
STEP_COST = FixedStepCost((0.02, 0.0005, 0.00005, 0.002, 0.0001, 0.0002))
STEP_COST_ENV = ",".join(map(str, STEP_COST.theta))  # the same for a server (DFLASH_SIMULATE_STEP_COST)
# Gemma 4 drafts (z-lab): sliding-window layers then a full one, logits soft-capped as the target's are.
GEMMA4_DRAFT = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=4, final_logit_softcapping=30.0)
# DFlash2 drafts, the published layout scaled down (2 layers): per-layer convolutions (2 taps, groups of 8 channels), a
# selector over each position's top 4 candidates, bidirectional sliding-window layers, scaled and soft-capped logits.
DFLASH2_DRAFT = dict(dflash2=DFlash2Fields(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=4),
                     is_causal=False, layer_types=("sliding_attention",) * 2, sliding_window=6,
                     output_multiplier=0.75, final_logit_softcapping=5.0)
# The published Muse Glimmer DFlash2 draft's config.json: its DFlash2 fields, and all that fixes its tensor shapes
MUSE_GLIMMER_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
    "dflash_config": {"block_size": 16, "conv_group_size": 16, "conv_kernel_size": 2, "final_logit_softcapping": 20.0,
                      "mask_token_id": 201818, "output_multiplier": 0.19611613513818404, "selector_rank": 256,
                      "selector_top_k": 16, "target_layer_ids": [1, 13, 25, 37, 49]},
    "head_dim": 128, "hidden_size": 6656, "intermediate_size": 19968, "layer_types": ["sliding_attention"] * 5,
    "num_attention_heads": 32, "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 52,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 2048, "use_sliding_window": True, "vocab_size": 202048,
}


# HF's torch path of the Gated DeltaNet rule (what a hybrid tiny target runs on the CPU) pads every multi-token forward
# to chunks of 64 positions and walks each chunk's rows in a Python loop over [rows, heads, 64, 64] tensors; the tests'
# forwards are a few tokens long (a prompt, a verify block) on batches of up to 12,000 rows. Chunking is an exact
# rewriting of the recurrence (chunk size changes only float rounding), so their targets run chunks of 8: the hybrid
# sampled-distribution tests of tests/test_reference.py took 55 s of their 63 alone with chunks of 64, 15 with 8.
HYBRID_CHUNK = 8


def _short_chunks(module) -> None:
    """Make `module`'s (an HF hybrid model's) chunked rule run HYBRID_CHUNK-position chunks (idempotent)."""
    rule = module.torch_chunk_gated_delta_rule
    if not isinstance(rule, functools.partial):
        module.torch_chunk_gated_delta_rule = functools.partial(rule, chunk_size=HYBRID_CHUNK)


def tiny_target(arch: str = "llama", vocab: int = 96, hidden: int = 32, layers: int = 6, seed: int = 0):
    """A tiny random HF target: `arch` one of ARCHS (hybrid ones alternate linear and full attention layers)."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=hidden // 4, rope_theta=10000.0))
    elif arch == "gemma4":
        # Gemma 4's scaled embedding (x sqrt(hidden)), soft-capped logits and tied head; every layer full attention
        # (the reference keeps each request's whole time axis; a target's sliding window is SGLang's to serve)
        cfg = transformers.Gemma4TextConfig(
            **{**common, "tie_word_embeddings": True}, head_dim=hidden // 4, global_head_dim=hidden // 4,
            layer_types=["full_attention"] * layers, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=vocab, pad_token_id=0, eos_token_id=1, bos_token_id=2)
        model = transformers.Gemma4ForCausalLM(cfg)
    elif arch in HYBRID_ARCHS:
        linear = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                      linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * (layers // 2))
        if arch == "qwen3_5":
            config, cls = transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM
        else:  # no experts: a dense MLP in every layer
            config, cls = transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM
            linear.update(num_experts=0, mlp_only_layers=[])
        model = cls(config(**common, **linear, head_dim=hidden // 4))
        _short_chunks(importlib.import_module(cls.__module__))
    else:
        raise ValueError(arch)
    # Larger-than-default weights give peaked, tie-free distributions, so greedy comparisons are meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def draft_config_for(target, n_layers: int = 2, n_features: int = 3, block_size: int = 8, **kw) -> DraftConfig:
    """A draft config fitting `target` (a Gemma 4 target gets a Gemma 4-style draft, GEMMA4_DRAFT)."""
    tc = target.config
    if tc.model_type.startswith("gemma4"):
        kw = {**GEMMA4_DRAFT, **kw}
    return DraftConfig(
        hidden_size=tc.hidden_size, intermediate_size=2 * tc.hidden_size, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=tc.hidden_size // 4, vocab_size=tc.vocab_size,
        mask_token_id=tc.vocab_size - 1, block_size=block_size, num_target_layers=tc.num_hidden_layers,
        target_layer_ids=build_target_layer_ids(tc.num_hidden_layers, n_features), rope_theta=10000.0, **kw,
    )


def tiny_drafter(cfg: DraftConfig, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
            elif name.endswith("base_kernel"):  # DFlash2 convolutions: random taps around the identity
                p.add_(torch.randn_like(p) * 0.5)
    return model.eval()


def write_draft(tmp: Path, drafter: DFlashDrafter, dtype=torch.float32) -> Path:
    return save_drafter(drafter, tmp, dtype=dtype)


def mixed_prompts(vocab: int, lengths=(3, 9, 1, 14, 6), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def char_tokenizer(vocab: int):
    """A character-level fast tokenizer over `vocab - 1` printable characters (the last id is free for MASK)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)][: vocab - 2]
    table = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def save_tiny_pair(root: Path, arch: str = "llama", vocab: int = 96, seed: int = 2) -> tuple[Path, Path]:
    """A tiny HF target directory (safetensors + tokenizer) and a matching z-lab draft directory."""
    target = tiny_target(arch, vocab=vocab, seed=seed)
    target.config.eos_token_id = 0
    target_dir, draft_dir = root / "target", root / "draft"
    target.save_pretrained(target_dir, safe_serialization=True)
    char_tokenizer(vocab).save_pretrained(target_dir)
    write_draft(draft_dir, tiny_drafter(draft_config_for(target), seed=seed))
    return target_dir, draft_dir


def save_chat_target(root: Path, vocab: int = 96):
    """A tiny llama target directory with a char tokenizer that has a chat template (the training CLI templates
    prompts); returns (its dir, the tokenizer)."""
    target = tiny_target(vocab=vocab)
    target.config.eos_token_id = 0
    target_dir = root / "target"
    target.save_pretrained(target_dir, safe_serialization=True)
    tok = char_tokenizer(vocab)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}:{% endif %}")
    tok.save_pretrained(target_dir)
    return target_dir, tok


def sampled_fit_pvalue(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of sampled continuations against their exact probabilities; asserts that nothing of
    probability 0 was sampled. Rare continuations (expected count < 5) are pooled into one cell."""
    import torch
    from scipy.stats import chisquare

    counts = {s: 0 for s in exact}
    for s in samples:
        counts[s] += 1
    assert all(counts[s] == 0 for s, p in exact.items() if p == 0), "sampled a continuation of probability 0"
    obs = torch.tensor([counts[s] for s in exact], dtype=torch.float64)
    exp = torch.tensor([exact[s] for s in exact], dtype=torch.float64) * len(samples)
    possible, rare = exp > 0, exp < 5
    obs = torch.cat([obs[~rare], obs[rare & possible].sum()[None]])
    exp = torch.cat([exp[~rare], exp[rare & possible].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)
