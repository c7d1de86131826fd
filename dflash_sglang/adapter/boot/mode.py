"""The mode and verify shape of a DFLASH server, from SGLang's shape flags and ours.

Shape per mode (N verify rows per request and step, B the drafter block, k the top-k):
- chain (`--speculative-eagle-topk` 1, the default): B = `--speculative-num-draft-tokens` (alias
  `--speculative-dflash-block-size`), default the checkpoint's `block_size`; N = B.
- tree (`--speculative-eagle-topk k`, k > 1): B = `--speculative-dflash-block-size` (default the checkpoint's);
  N = `--speculative-num-draft-tokens` (default B) nodes, root included, best-first over the top-k of each of the
  B-1 draft positions.
- goodput (no shape flag at all, or `--speculative-adaptive` without a table): B as for a tree; each step's chain
  (1..N rows) or tree (up to N nodes over top-2 / top-k) from the goodput controller (core/shape/goodput.py: measured
  acceptance and step cost); N = the explicit `--speculative-num-draft-tokens` (at most B) or B; k =
  `--speculative-eagle-topk` (with `--speculative-adaptive`; 1: chains only) or DEFAULT_TREE_TOPK where the server can
  verify trees (page size 1, a tree-capable attention backend), else 1.
- adaptive (`--speculative-adaptive` with `--speculative-dflash-adaptive-table`): B as for a tree; each step's shape
  from the table by batch size; N = the largest shape it can pick (or the explicit `--speculative-num-draft-tokens`,
  which every row must fit), k = its largest top-k.
A shape flag (`--speculative-num-draft-tokens`, `--speculative-dflash-block-size`, `--speculative-eagle-topk`) without
`--speculative-adaptive` pins the shape (chain or tree), as does simulated acceptance (`SGLANG_SIMULATE_ACC_LEN`).
SGLang sizes its per-step KV reservation from the declared N (`DFlashDraftInputV2.prepare_for_decode` reserves
2*N slots past the committed length) and the result row stride from it.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dflash_sglang.core.draft.config import DraftConfig, sliding_window_layers
from dflash_sglang.core.shape.goodput import DEFAULT_TREE_TOPK
from dflash_sglang.core.step.tree import max_tree_nodes
from dflash_sglang.ops import MAX_NODES

from ..settings import TREE_ATTENTION_BACKENDS, UnsupportedFlagError
from ..step.shapes import AdaptiveConfigError, adaptive_limits
from ..simulate import SimulatedAcceptance
from ..versions import model_config, view
from .flags import PLUGIN_DEFAULTS
from .refusals import refuse

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# --max-running-requests when unset, for pinned shapes (chain, tree, a table): the builtin DFLASH's default. The goodput
# controller leaves it to SGLang (as plain decoding: it shrinks the verify as the batch grows, down to plain steps)
# and instead bounds each step's verify rows by this many requests' worth of N rows (`running_limits`).
DEFAULT_MAX_RUNNING_REQUESTS = 48


def running_limits(mode: str, max_nodes: int, requested: int | None,
                   budget: int | None) -> tuple[int | None, int | None]:
    """(--max-running-requests to declare, the verify token budget per step) of a resolved mode.

    Pinned shapes verify N rows for every running request, so they keep the builtin's default of 48 requests. The
    goodput controller chooses each step's rows from the batch size (plain steps where drafting does not pay), so a
    cap at 48 would only queue requests that plain decoding serves at once: it leaves the cap to SGLang (None), and
    bounds the rows a step verifies by what 48 requests of N rows would (the verify's logits and buffers stay the
    size the builtin's default allows) unless the operator set a budget or the cap."""
    if mode == "goodput" and requested is None:
        return None, budget if budget is not None else DEFAULT_MAX_RUNNING_REQUESTS * max_nodes
    return (requested if requested is not None else DEFAULT_MAX_RUNNING_REQUESTS), (budget if mode != "chain" else None)


def resolve_shape(server_args: ServerArgs, cfg: DraftConfig, flags: dict, max_running: int | None,
                  simulation: SimulatedAcceptance | None = None) -> tuple[str, int, int, int, str | None]:
    """(mode, B, N, k, adaptive table or None) from the flags (see the module docstring); max_running: the operator's
    --max-running-requests (None: unset)."""
    v = view(server_args)
    topk_flag = v.speculative_eagle_topk
    table, budget = flags["speculative_dflash_adaptive_table"], flags["speculative_dflash_adaptive_token_budget"]
    explicit = v.speculative_num_draft_tokens
    pinned = explicit is not None or v.speculative_dflash_block_size is not None or topk_flag is not None
    if not flags["speculative_adaptive"] and not pinned and table is None and (simulation is None or
                                                                               simulation.serves("goodput")):
        block = draft_block_size(v, cfg)
        check_token_budget(budget, max_running)
        return "goodput", block, block, goodput_topk(server_args, cfg, block, None, simulation), None
    if flags["speculative_adaptive"] and table is None:
        block = draft_block_size(v, cfg)
        max_nodes = int(explicit) if explicit is not None else block
        if not 2 <= max_nodes <= block:
            refuse("--speculative-num-draft-tokens", max_nodes, f"with --speculative-adaptive it is the most verify "
                    f"rows per request, 2 .. the drafter block ({block})")
        check_token_budget(budget, max_running)
        return "goodput", block, max_nodes, goodput_topk(server_args, cfg, max_nodes, topk_flag, simulation), None
    if flags["speculative_adaptive"]:
        if topk_flag is not None:
            refuse("--speculative-eagle-topk", topk_flag, "with --speculative-adaptive the top-k of each batch size "
                    "comes from --speculative-dflash-adaptive-table; drop the flag")
        block = draft_block_size(v, cfg)
        try:
            _, largest = adaptive_limits(table, budget, block, None if explicit is None else int(explicit),
                                         cfg.vocab_size, max_running or DEFAULT_MAX_RUNNING_REQUESTS)
        except AdaptiveConfigError as e:
            raise UnsupportedFlagError(str(e)) from None
        if largest.topk > 1:
            source = f"--speculative-dflash-adaptive-table {table!r} ({largest.nodes} nodes)"
            if explicit is not None:
                source = f"--speculative-num-draft-tokens {largest.nodes}"
            check_tree_serving(server_args, largest.nodes, source, "tree rows in --speculative-dflash-adaptive-table")
        return "adaptive", block, largest.nodes, largest.topk, table
    given = [flag for flag, name in (("--speculative-dflash-adaptive-table", "speculative_dflash_adaptive_table"),
                                     ("--speculative-dflash-adaptive-token-budget",
                                      "speculative_dflash_adaptive_token_budget"))
             if flags[name] != PLUGIN_DEFAULTS[name]]
    if given:
        refuse(given[0], "", "needs --speculative-adaptive")
    topk = 1 if topk_flag is None else int(topk_flag)
    if topk < 1:
        refuse("--speculative-eagle-topk", topk, "must be >= 1 (1: chain, > 1: tree verification)")
    if topk == 1:
        block = chain_block_size(v, cfg)
        return "chain", block, block, 1, None
    block = draft_block_size(v, cfg)
    if topk > cfg.vocab_size:
        refuse("--speculative-eagle-topk", topk, f"larger than the draft vocabulary ({cfg.vocab_size} tokens)")
    explicit = v.speculative_num_draft_tokens
    max_nodes = int(explicit if explicit is not None else block)
    most = max_tree_nodes(block - 1, topk)
    if max_nodes < 2:
        refuse("--speculative-num-draft-tokens", max_nodes, "a draft tree needs >= 2 nodes (the root and one draft)")
    if max_nodes > most:
        refuse("--speculative-num-draft-tokens", max_nodes, f"a tree of depth {block - 1} (block size {block}) with "
                f"--speculative-eagle-topk {topk} has at most {most} nodes")
    check_tree_serving(server_args, max_nodes, f"--speculative-num-draft-tokens {max_nodes}",
                       "--speculative-eagle-topk > 1")
    return "tree", block, max_nodes, topk, None


def check_token_budget(budget, max_running: int | None) -> None:
    """--speculative-dflash-adaptive-token-budget for the goodput controller (a static table checks its own);
    max_running None: --max-running-requests unset (SGLang's own cap; a step over more requests than the budget
    runs plain)."""
    flag = "--speculative-dflash-adaptive-token-budget"
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise UnsupportedFlagError(f"{flag} {budget!r}: expected a positive integer (verify tokens per step over the "
                                   f"batch)")
    if budget is not None and max_running is not None and budget < max_running:
        raise UnsupportedFlagError(f"{flag} {budget} is below --max-running-requests {max_running}: every running "
                                   f"request verifies at least one token per step")


def draft_block_size(v, cfg: DraftConfig) -> int:
    """The drafter block B of tree and adaptive modes: --speculative-dflash-block-size, else the checkpoint's."""
    alias = v.speculative_dflash_block_size
    block = int(alias if alias is not None else cfg.block_size)
    if block < 2:
        refuse("--speculative-dflash-block-size", block, "the draft block size must be >= 2")
    if block > MAX_NODES:
        refuse("--speculative-dflash-block-size", block, f"at most {MAX_NODES}")
    return block


def chain_block_size(v, cfg: DraftConfig) -> int:
    """The chain's B = N: --speculative-num-draft-tokens or its alias --speculative-dflash-block-size, else the
    checkpoint's."""
    explicit, alias = v.speculative_num_draft_tokens, v.speculative_dflash_block_size
    if alias is not None and explicit is not None and int(alias) != int(explicit):
        raise UnsupportedFlagError(f"--speculative-num-draft-tokens {explicit} and --speculative-dflash-block-size "
                                   f"{alias} differ (both are the DFLASH block size)")
    block = int(explicit if explicit is not None else alias if alias is not None else cfg.block_size)
    if block < 2:
        raise UnsupportedFlagError(f"--speculative-num-draft-tokens {block}: the block size must be >= 2")
    if block > MAX_NODES:
        # A verify of that many rows per request would exhaust memory at warm-up, far from this flag.
        raise UnsupportedFlagError(f"--speculative-num-draft-tokens {block}: at most {MAX_NODES} verify tokens per "
                                   f"request and step (the draft was trained for {cfg.block_size})")
    if block > cfg.block_size:
        logger.warning("DFLASH block size %d is larger than the draft was trained for (%d); acceptance will suffer",
                       block, cfg.block_size)
    return block


def goodput_topk(server_args: ServerArgs, cfg: DraftConfig, max_nodes: int, topk_flag,
                 simulation: SimulatedAcceptance | None) -> int:
    """The goodput controller's largest tree top-k: 1 under simulated acceptance (it forces chain outcomes), else
    --speculative-eagle-topk when given with --speculative-adaptive (1: chains only; a larger one must be servable),
    else DEFAULT_TREE_TOPK where this server can verify trees (page size 1, a tree-capable attention backend, as far
    as ServerArgs has resolved them; the worker drops trees if what it finds differs), else 1."""
    if simulation is not None:
        return 1
    if topk_flag is not None:
        topk = int(topk_flag)
        if not 1 <= topk <= cfg.vocab_size:
            refuse("--speculative-eagle-topk", topk, f"with --speculative-adaptive it is the controller's largest "
                    f"tree top-k, 1 (chains only) .. the draft vocabulary ({cfg.vocab_size})")
        if topk > 1:
            check_tree_serving(server_args, max_nodes, "--speculative-num-draft-tokens",
                               "--speculative-eagle-topk with --speculative-adaptive")
        return topk
    if max_nodes < 3 or max_nodes > MAX_NODES or tree_serving_problems(server_args, "goodput trees"):
        return 1
    return min(DEFAULT_TREE_TOPK, cfg.vocab_size)


def check_tree_serving(server_args: ServerArgs, max_nodes: int, max_nodes_source: str, tree_source: str) -> None:
    """What tree verification needs of the server: N = max_nodes within the kernels' limit, page size 1, a target
    attention backend that takes the tree mask. max_nodes_source / tree_source name where N / the tree shapes come
    from."""
    if max_nodes > MAX_NODES:
        raise UnsupportedFlagError(f"{max_nodes_source}: the tree kernels verify at most {MAX_NODES} nodes")
    problems = tree_serving_problems(server_args, tree_source)
    if problems:
        refuse(*problems[0])


def tree_serving_problems(server_args: ServerArgs, tree_source: str) -> list[tuple[str, object, str]]:
    """(flag, value, why) for each server setting that rules tree verification out (empty: trees can be served)."""
    v = view(server_args)  # what SGLang picked by itself so far (backend and page size for this GPU/model)
    problems = []
    page_size = int(v.page_size or 1)
    if page_size != 1:
        # The accepted path is committed by permuting req_to_token entries, which only a page size of 1 allows.
        problems.append(("--page-size", page_size, f"tree verification ({tree_source}) needs page size 1"
                         + _picked(server_args, v, "page_size")))
    if (window := sliding_window_layers(model_config(server_args).hf_config)) is not None:
        # Tree rows sit at depths, not consecutive positions: a sliding window over them is not what the masks say.
        problems.append(("--model-path", v.model_path, f"tree verification ({tree_source}) needs full attention in "
                         f"every target layer; the target has sliding-window layers ({window})"))
    for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        backend = getattr(v, flag, None)
        if backend is not None and backend not in TREE_ATTENTION_BACKENDS:
            problems.append((f"--{flag.replace('_', '-')}", backend, f"tree verification supports "
                             f"{', '.join(TREE_ATTENTION_BACKENDS)} target attention" + _picked(server_args, v, flag)))
    return problems


def _picked(server_args: ServerArgs, v, field: str) -> str:
    """A hint when the value is SGLang's own choice, not what the user passed."""
    if getattr(server_args, field, None) != getattr(v, field, None):
        return f" (SGLang chose it for this model/GPU; pass --{field.replace('_', '-')} explicitly)"
    return ""
