"""Our `--speculative-dflash-*` flags on SGLang's own parser, and how their values travel to resolution.

Serving settings are SGLang server flags. Where SGLang has a flag whose meaning fits we read it
(`--speculative-num-draft-tokens`, `--speculative-adaptive`, `--speculative-draft-attention-backend`, ...); the
rest are `--speculative-dflash-*` flags this plugin adds to SGLang's own parser (`add_plugin_flags`, shown in
`--help`) and takes as `sgl.Engine(...)` keywords. Environment variables are kept only for what is not a serving
setting: `DFLASH_SGLANG_IMPL` (ours / builtin), `DFLASH_SGLANG_HOME` (the kernel cache), the simulations
(adapter/simulate.py), `DFLASH_DEFER_PLAIN_UPKEEP` (adapter/step/upkeep.py: before/after timings of the plain steps'
draft K/V upkeep) and `DFLASH_PLAIN_STEP` (adapter/step/verify.py: of their forward), each listed in
docs/serving-flags.md. The variables of earlier releases are refused at start-up naming their flag
(`refuse_retired_env`).

How our flags travel: SGLang's ServerArgs has no fields for them, so the values parsed from the command line (or
popped from the Engine keywords) ride on the record as bookkeeping (`_dflash_flags`) or, while the record is being
built, in `pending_flags`; resolution (boot/resolve.py) turns them and SGLang's flags into one frozen
`DFlashSettings`, checked once and attached to the record (`_dflash_settings`), which is pickled into every
scheduler process. The worker reads that object and nothing else.
"""
from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..settings import DRAFT_GRAPHS


@dataclass(frozen=True)
class Setting:
    """One row of the settings table (docs/serving-flags.md prints it)."""

    name: str  # ServerArgs field (SGLang's flags) or Engine keyword (ours)
    flag: str
    type: type
    default: Any
    help: str
    ours: bool = False  # a flag this plugin adds to SGLang's parser
    choices: tuple[str, ...] | None = None

SETTINGS: tuple[Setting, ...] = (
    Setting("speculative_draft_model_path", "--speculative-draft-model-path", str, None,
            "draft checkpoint directory (z-lab or speculators DFlash format) or hub repo id"),
    Setting("speculative_num_draft_tokens", "--speculative-num-draft-tokens", int, None,
            "chain: the block size; tree: verify nodes per request and step (default: the block size)"),
    Setting("speculative_dflash_block_size", "--speculative-dflash-block-size", int, None,
            "the drafter block [bonus, MASK x (B-1)] (default: the checkpoint's block_size)"),
    Setting("speculative_eagle_topk", "--speculative-eagle-topk", int, 1,
            "candidates per draft position: 1 = chain, k > 1 = tree verification (pins the shape; with "
            "--speculative-adaptive: the goodput controller's largest tree top-k, 1 = chains only)"),
    Setting("speculative_adaptive", "--speculative-adaptive", bool, False,
            "each decode step's chain or tree from measured acceptance and step cost (the goodput controller, also "
            "the default without shape flags), or from the batch size with --speculative-dflash-adaptive-table"),
    Setting("speculative_dflash_adaptive_table", "--speculative-dflash-adaptive-table", str, None,
            "a static adaptive table instead of the goodput controller: comma-separated MAX_BS:NODESxTOPK rows "
            "ascending, the last MAX_BS 'inf' (core/shape/adaptive.py DEFAULT_TABLE is the earlier "
            "default)", ours=True),
    Setting("speculative_dflash_adaptive_token_budget", "--speculative-dflash-adaptive-token-budget", int, None,
            "adaptive: at most this many verify tokens per step over the batch (>= --max-running-requests)",
            ours=True),
    Setting("speculative_draft_attention_backend", "--speculative-draft-attention-backend", str, None,
            "the drafter's paged attention: flashinfer (CUDA default) or torch_native (CPU default)"),
    Setting("disable_cuda_graph", "--disable-cuda-graph", bool, False,
            "also runs the draft pass and commit eagerly (they are CUDA graphs wherever the target's are)"),
    Setting("speculative_dflash_draft_graphs", "--speculative-dflash-draft-graphs", str, "auto",
            "auto: the draft pass and commit are CUDA graphs wherever the target's are; eager: never (an A/B of the "
            "draft graphs); static: their static buffers replayed without capture, any device (tests the graph path "
            "on CPU)", ours=True, choices=DRAFT_GRAPHS),
    Setting("speculative_dflash_tree_cuda_graph", "--speculative-dflash-tree-cuda-graph", bool, False,
            "capture the target's verify CUDA graphs with the tree mask, so tree verifies replay graphs "
            "(not yet validated on a GPU)", ours=True),
    Setting("speculative_dflash_experimental", "--speculative-dflash-experimental", bool, False,
            "serve what is not yet validated end to end on a GPU: hybrid Gated DeltaNet targets (Qwen3.5 / Qwen3.6 / "
            "Qwen3-Next), soft-capped Gemma 4 drafts and DFlash2 drafts (docs/models.md)", ours=True),
    Setting("speculative_token_map", "--speculative-token-map", str, None,
            "a reduced draft vocabulary: token_map.safetensors (one int64 tensor 'token_map' of target ids, as "
            "`dflash-sglang train --draft-vocab K` writes); default: the checkpoint's own, if it has one"),
    Setting("speculative_draft_load_format", "--speculative-draft-load-format", str, None,
            "dummy: random draft weights of the checkpoint's shapes (capacity planning)"),
    Setting("max_running_requests", "--max-running-requests", int, None,
            "pinned shapes: default 48, as the builtin; the goodput controller: SGLang's own, as plain decoding"),
)

PLUGIN_FLAGS = tuple(s for s in SETTINGS if s.ours)

PLUGIN_DEFAULTS = {s.name: s.default for s in PLUGIN_FLAGS}

# Environment variables of earlier releases -> the flag that replaced each.
RETIRED_ENV = {
    "DFLASH_ADAPTIVE": "--speculative-adaptive",
    "DFLASH_ADAPTIVE_TABLE": "--speculative-dflash-adaptive-table",
    "DFLASH_ADAPTIVE_TOKEN_BUDGET": "--speculative-dflash-adaptive-token-budget",
    "DFLASH_DRAFT_ATTENTION": "--speculative-draft-attention-backend flashinfer|torch_native",
    "DFLASH_DRAFT_CUDA_GRAPH": "--speculative-dflash-draft-graphs auto|eager|static",
    "DFLASH_TREE_CUDA_GRAPH": "--speculative-dflash-tree-cuda-graph",
}


# ---------------------------------------------------------------------------------------------- our flags
# ---------------------------------------------------------------------------------------------- our flags
_pending: dict[str, Any] = {}


def add_plugin_flags(parser: argparse.ArgumentParser) -> None:
    """Add our flags to SGLang's server parser (after its own), in their own `--help` group."""
    group = parser.add_argument_group("dflash-sglang DFLASH (our worker; SGLang's builtin ignores these)")
    for s in PLUGIN_FLAGS:
        if s.type is bool:
            group.add_argument(s.flag, dest=s.name, action="store_true", default=s.default, help=s.help)
        else:
            group.add_argument(s.flag, dest=s.name, type=s.type, default=s.default, choices=s.choices,
                               help=f"{s.help} (default {s.default})")


def split_plugin_flags(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(our flags, everything else) from argparse results or Engine keywords."""
    names = {s.name for s in PLUGIN_FLAGS}
    return ({k: v for k, v in values.items() if k in names}, {k: v for k, v in values.items() if k not in names})


@contextlib.contextmanager
def pending_flags(values: dict[str, Any]) -> Iterator[None]:
    """Our flag values for the ServerArgs being built and resolved inside this block (0.5.17 resolves inside the
    constructor, and `sgl.Engine` resolves inside its own __init__, before we could attach them to the record)."""
    global _pending
    saved, _pending = _pending, dict(values)
    try:
        yield
    finally:
        _pending = saved


def plugin_flags_of(server_args: Any) -> dict[str, Any]:
    """Our flags for this record: attached ones first, then the block being built; defaults for the rest."""
    given = getattr(server_args, "_dflash_flags", None)
    values = dict(_pending if given is None else given)
    return {name: values.get(name, default) for name, default in PLUGIN_DEFAULTS.items()}


def nondefault_plugin_flags(server_args: Any) -> list[str]:
    """The flags of ours set to a non-default value (refused where our worker does not serve)."""
    values = plugin_flags_of(server_args)
    return [s.flag for s in PLUGIN_FLAGS if values[s.name] != s.default]


def refuse_retired_env(env: Mapping[str, str] | None = None) -> None:
    """Start-up error for an environment variable an earlier release read, naming the flag that replaced it."""
    env = os.environ if env is None else env
    for name, flag in RETIRED_ENV.items():
        if env.get(name, "").strip():
            raise ValueError(f"{name}={env[name]!r}: this variable is no longer read; use the server flag {flag} "
                             f"(docs/serving-flags.md, Settings)")
