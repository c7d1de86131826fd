"""Every setting of our DFLASH worker: its flag, type and default (`SETTINGS`), and the resolved `DFlashSettings`.

Serving settings are SGLang server flags. Where SGLang has a flag whose meaning fits we read it
(`--speculative-num-draft-tokens`, `--speculative-adaptive`, `--speculative-draft-attention-backend`, ...); the
rest are `--speculative-dflash-*` flags this plugin adds to SGLang's own parser (`add_plugin_flags`, shown in
`--help`) and takes as `sgl.Engine(...)` keywords. Environment variables are kept only for what is not a serving
setting: `DFLASH_SGLANG_IMPL` (ours / builtin), `DFLASH_SGLANG_HOME` (the kernel cache) and the simulations
(adapter/simulate.py). The variables of earlier
releases are refused at start-up naming their flag (`refuse_retired_env`).

How our flags travel: SGLang's ServerArgs has no fields for them, so the values parsed from the command line (or
popped from the Engine keywords) ride on the record as bookkeeping (`_dflash_flags`) or, while the record is being
built, in `pending_flags`; resolution (adapter/args.py) turns them and SGLang's flags into one frozen
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

from dflash_sglang.core.adaptive import AdaptivePolicy
from dflash_sglang.core.config import DraftConfig
from dflash_sglang.core.goodput import FixedStepCost, GoodputConfig

from .draft_memory import DraftMemory
from .simulate import SimulatedAcceptance

IMPL_ENV = "DFLASH_SGLANG_IMPL"
MODES = ("chain", "tree", "adaptive", "goodput")
DRAFT_ATTENTION = {None: "auto", "flashinfer": "flashinfer", "torch_native": "torch"}  # flag value -> ours
DRAFT_GRAPHS = ("auto", "eager", "static")


@dataclass(frozen=True)
class Setting:
    """One row of the settings table (docs/sglang.md prints it)."""

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
            "ascending, the last MAX_BS 'inf' (core/adaptive.py DEFAULT_TABLE is the earlier default)", ours=True),
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
            "Qwen3-Next), soft-capped Gemma 4 drafts and DFlash2 drafts (docs/sglang.md)", ours=True),
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


@dataclass(frozen=True)
class DFlashSettings:
    """What our worker serves with, resolved and checked once (adapter/args.py) in the process that builds
    ServerArgs. Modes: chain (N = B verify rows, k = 1), tree (N best-first nodes from the top-k of each draft
    position), adaptive (each step's shape from `policy()` by batch size; N and k its maxima), goodput (each step's
    chain, 1..N rows, or tree, up to N nodes over top-k, from the goodput controller, core/goodput.py)."""

    draft_dir: str
    draft: DraftConfig  # the checkpoint's config, checked against the target
    mode: str  # one of MODES
    block_size: int  # B: the drafter block [bonus, MASK x (B-1)], one drafter pass per step
    nodes: int  # N: the most verify rows per request and step (the result row stride)
    topk: int  # k: the largest top-k a step uses (1: chain)
    max_running_requests: int | None  # None: SGLang's own, as for plain decoding (the goodput controller, flag unset)
    device: str
    draft_attention: str  # "flashinfer" | "torch"
    draft_graphs: str  # one of DRAFT_GRAPHS
    draft_kv_dtype: str  # the draft KV pool's dtype, SGLang's name ("auto": the model dtype; "fp8_e4m3", ...)
    draft_memory: DraftMemory  # its pool row's bytes, what SGLang's KV sizing counts (adapter/draft_memory.py)
    draft_window: int | None  # --speculative-draft-window-size W (adapter/draft_window.py), None: the whole context
    context_len: int  # the target's context length (a request's most draft pool rows)
    tree_cuda_graph: bool  # target verify graphs captured with the tree mask (CUDA, trees)
    dummy_draft: bool  # random draft weights (--speculative-draft-load-format dummy)
    token_map: str | None = None  # the token map file drafted over (--speculative-token-map or the checkpoint's)
    adaptive_table: str | None = None  # adaptive mode only
    adaptive_token_budget: int | None = None
    simulation: SimulatedAcceptance | None = None  # SGLANG_SIMULATE_ACC_* (chain only)
    step_cost: FixedStepCost | None = None  # DFLASH_SIMULATE_STEP_COST (goodput only): the step time observed
    hybrid: bool = False  # the target has Gated DeltaNet layers: each verify's recurrent state is committed
    disaggregation: str | None = None  # PD: "prefill" or "decode" (adapter/disagg.py), None: a whole server

    def __post_init__(self) -> None:
        assert self.mode in MODES and (self.mode == "adaptive") == (self.adaptive_table is not None)
        assert self.mode != "chain" or (self.nodes == self.block_size and self.topk == 1)
        assert self.step_cost is None or self.mode == "goodput"

    @property
    def has_tree_rows(self) -> bool:
        """Whether a step may verify a tree (tree mode, or an adaptive table with a top-k > 1 row): what needs a
        page size of 1, a tree-capable target attention backend and, for graphs, the masked verify capture."""
        return self.topk > 1

    def controller_config(self) -> GoodputConfig:
        """Goodput mode's controller: chains of 1..N rows (1 = a plain step, no drafter pass) and, with k > 1, trees
        of up to N nodes over top-2..k."""
        assert self.mode == "goodput"
        return GoodputConfig(max_nodes=self.nodes, max_depth=self.block_size - 1, max_topk=self.topk)

    def policy(self) -> AdaptivePolicy:
        """Adaptive mode's per-step shapes (the table capped to this drafter block)."""
        assert self.adaptive_table is not None, "adaptive mode only"
        return AdaptivePolicy.parse(self.adaptive_table, self.adaptive_token_budget, self.block_size - 1)


def settings_of(server_args: Any) -> DFlashSettings:
    """The settings our resolution attached to these (published) server args."""
    settings = getattr(server_args, "_dflash_settings", None)
    if settings is None:
        raise RuntimeError(f"DFLASH (dflash-sglang): these server args were not resolved by dflash-sglang's hooks; "
                           f"set {IMPL_ENV} the same way for the whole server")
    return settings


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
                             f"(docs/sglang.md, Settings)")
