"""What a draft window is for: the requests a fixed KV budget holds at long contexts, per draft pool layout.

Layouts (adapter/draft/context_rows.py, docs/sglang.md "Draft memory"):
- `whole`: no window, one draft row per target KV slot (SGLang's KV sizing counts target + draft bytes per token);
- `slots<W>`: a window over those slot rows (the radix cache on): the same memory, only the reads are bounded;
- `ring<W>`: the window's ring, R = W + N - 1 rows per request slot (the radix cache off): 0 draft bytes per token, and
  (max running requests + 1) rings resident before SGLang measures its memory;
- `builtin<W>`: SGLang 0.5.23's builtin DFLASH with the window: a draft row per target slot (its compact req_to_token
  bounds the reads; its KV sizing adds the draft's own bytes per token, `dflash_draft_cell_size_per_token`).

The arithmetic (`capacity_rows`): per-token layouts hold budget // (target + draft bytes per token) tokens, so
tokens // context requests of `context` tokens each; the ring holds the most requests b whose b + 1 rings and b
contexts of target KV fit the budget, and SGLang sizes the rest in target tokens.

SGLang's own numbers (`sglang_sizing`, in a process that imports SGLang): each layout's ServerArgs resolved by SGLang's
own pipeline for the config-only target and draft (dummy draft weights), the per-token cell as SGLang's KV sizing
computes it (its ModelConfig's KV heads x (head_dim + v_head_dim) x layers x dtype, then
`scale_kv_cell_size_per_token_for_dflash` as our plugin hooks it; the builtin's: SGLang's own
`dflash_draft_cell_size_per_token` added), and max_total_num_tokens from SGLang's `DefaultPoolConfigurator.
calculate_pool_sizes` at the budget (the ring's pool deducted first, as it is resident before SGLang measures). Both
must agree (`compare`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# Qwen/Qwen3-8B's config.json (the KV-sizing fields and what SGLang's ModelConfig reads) and z-lab/Qwen3-8B-DFlash-b16's
# shapes: block 16, target layer ids (1, 9, 17, 25, 33) (dflash_sglang/pairs.py), the target's attention shape; 5 layers
# is inferred from its published 1.0B parameters (5 Qwen3-8B-sized layers + the fc: 1.05B), not read from its config.
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645}
QWEN3_8B_DFLASH = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 4096,
                   "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-06,
                   "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                   "block_size": 16, "num_target_layers": 36,
                   "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33], "block_size": 16}}


@dataclass(frozen=True)
class CapacityRow:
    """One layout at one context length under the budget."""

    layout: str  # whole, slots<W>, ring<W>, builtin<W>
    context: int  # tokens per request (prompt + output)
    bytes_per_token: int  # SGLang's KV cell: target + the draft's per-token bytes (0 for the ring)
    ring_bytes: int  # one request slot's ring (0: per-token layouts)
    max_total_tokens: int  # SGLang's token capacity
    requests: int  # requests of `context` tokens held at once


def write_pair(root: Path, target: dict = QWEN3_8B, draft: dict = QWEN3_8B_DFLASH) -> tuple[Path, Path]:
    """Config-only target and draft dirs (no weights: SGLang's resolution reads configs; dummy draft weights)."""
    for name, cfg in (("target", target), ("draft", draft)):
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(cfg))
    return root / "target", root / "draft"


def capacity_rows(budget: int, target_cell: int, draft_row: int, contexts: list[int], windows: list[int],
                  max_nodes: int) -> list[CapacityRow]:
    """The arithmetic (module docstring): target_cell / draft_row bytes per token, N = max_nodes verify rows per
    step."""
    rows = []
    for context in contexts:
        cell = target_cell + draft_row
        tokens = budget // cell
        rows += [CapacityRow(name, context, cell, 0, tokens, tokens // context)
                 for name in ["whole", *(f"{kind}{w}" for w in windows for kind in ("slots", "builtin"))]]
        for w in windows:
            ring = (w + max_nodes - 1) * draft_row
            batch = max(0, (budget - ring) // (context * target_cell + ring))
            tokens = max(0, budget - (batch + 1) * ring) // target_cell
            rows.append(CapacityRow(f"ring{w}", context, target_cell, ring, tokens, batch))
    return rows


def sglang_sizing(target_dir: Path, draft_dir: Path, budget: int, contexts: list[int], windows: list[int],
                  dtype: str = "bfloat16") -> list[CapacityRow]:
    """The same rows from SGLang's own sizing (module docstring); imports SGLang (and applies our plugin's hooks)."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative import dflash_utils

    from dflash_sglang.adapter.boot import plugin
    from dflash_sglang.adapter.settings import settings_of
    from dflash_sglang.adapter.versions import resolve

    plugin.register()
    HookRegistry.apply_hooks()
    target, draft = ModelConfig(str(target_dir)), ModelConfig(str(draft_dir))
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    target_cell = target.get_num_kv_heads(1) * (target.head_dim + target.v_head_dim) * target.num_hidden_layers * elem
    layers = draft.num_hidden_layers

    def tokens(cell: int, available: int) -> int:  # SGLang's max_total_num_tokens at `available` bytes, page 1
        sizing = type("Sizing", (), {"_fixed_overhead_bytes": 0, "_cell_size": cell, "_zero_kv_max_tokens": 0})()
        return DefaultPoolConfigurator.calculate_pool_sizes(sizing, available, 1).max_total_num_tokens

    def ours(*flags: str):  # (the hooked per-token cell, the resolved settings) of our resolution
        args = resolve(prepare_server_args([
            "--model-path", str(target_dir), "--device", "cpu", "--attention-backend", "torch_native", "--dtype",
            dtype, "--skip-tokenizer-init", "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path",
            str(draft_dir), "--speculative-draft-load-format", "dummy", *flags]))
        get_context().set_server_args(args)
        cell = dflash_utils.scale_kv_cell_size_per_token_for_dflash(
            target_cell_size_per_token=target_cell, target_num_layers=target.num_hidden_layers,
            draft_num_layers=layers)
        return cell, settings_of(args)

    rows = []
    builtin = target_cell + dflash_utils.dflash_draft_cell_size_per_token(
        draft_model_config=draft, draft_num_layers=layers, draft_kv_cache_dtype=getattr(torch, dtype), tp_size=1)
    whole, _ = ours()
    slots = {w: ours("--speculative-draft-window-size", str(w))[0] for w in windows}
    ring = {w: ours("--speculative-draft-window-size", str(w), "--disable-radix-cache") for w in windows}
    for context in contexts:
        rows.append(CapacityRow("whole", context, whole, 0, tokens(whole, budget), tokens(whole, budget) // context))
        for w in windows:
            for name, cell in ((f"slots{w}", slots[w]), (f"builtin{w}", builtin)):
                rows.append(CapacityRow(name, context, cell, 0, tokens(cell, budget), tokens(cell, budget) // context))
        for w, (cell, settings) in ring.items():
            memory = settings.draft_memory
            ring_bytes = memory.ring * memory.bytes_per_row
            batch = 0  # the most requests whose rings (one more slot: SGLang's req_to_token rows) and KV fit
            while tokens(cell, budget - (batch + 2) * ring_bytes) >= (batch + 1) * context:
                batch += 1
            rows.append(CapacityRow(f"ring{w}", context, cell, ring_bytes,
                                    tokens(cell, budget - (batch + 1) * ring_bytes), batch))
    return rows


def sglang_sizing_in_child(target_dir: Path, draft_dir: Path, budget: int, contexts: list[int], windows: list[int],
                           python: str = sys.executable) -> list[CapacityRow]:
    """`sglang_sizing` in a child process (importing SGLang changes the process; CPU builds need the import shims)."""
    from dflash_sglang.measure.cpu_env import cpu_env

    code = ("import json, sys; from pathlib import Path; from dataclasses import asdict; "
            "from dflash_sglang.bench.memory.window_capacity import sglang_sizing; "
            "a = json.loads(sys.argv[1]); "
            "print(json.dumps([asdict(r) for r in sglang_sizing(Path(a[0]), Path(a[1]), *a[2:])]))")
    out = subprocess.run([python, "-c", code, json.dumps([str(target_dir), str(draft_dir), budget, contexts,
                                                          windows])],
                         env={**os.environ, **cpu_env()}, capture_output=True, text=True, timeout=900, check=True)
    return [CapacityRow(**r) for r in json.loads(out.stdout.strip().splitlines()[-1])]


def compare(ours: list[CapacityRow], sglang: list[CapacityRow]) -> list[str]:
    """Rows where the arithmetic and SGLang's own sizing differ (empty: they agree)."""
    theirs = {(r.layout, r.context): r for r in sglang}
    return [f"{r.layout} at {r.context}: {asdict(r)} vs SGLang's {asdict(theirs.get((r.layout, r.context)))}"
            for r in ours if theirs.get((r.layout, r.context)) != r]
