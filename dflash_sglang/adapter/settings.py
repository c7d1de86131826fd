"""The resolved `DFlashSettings`: what start-up decided (boot/resolve.py) and every step reads.

Resolution turns SGLang's flags and ours (boot/flags.py) into one frozen `DFlashSettings`, checked once and attached
to the ServerArgs record (`_dflash_settings`), which is pickled into every scheduler process. The worker reads that
object and nothing else. This module also holds the names every room shares: the error a refused flag raises and the
target attention backends that take a tree mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_sglang.core.draft.config import DraftConfig
from dflash_sglang.core.shape.adaptive import AdaptivePolicy
from dflash_sglang.core.shape.goodput import FixedStepCost, GoodputConfig

if TYPE_CHECKING:  # (field types only: the rooms that define them import this one)
    from .draft.memory import DraftMemory
    from .simulate import SimulatedAcceptance

IMPL_ENV = "DFLASH_SGLANG_IMPL"

MODES = ("chain", "tree", "adaptive", "goodput")

DRAFT_ATTENTION = {None: "auto", "flashinfer": "flashinfer", "torch_native": "torch"}  # flag value -> ours

DRAFT_GRAPHS = ("auto", "eager", "static")

# Target attention backends that take the tree mask: torch_native through adapter/step/tree.py, the GPU
# ones through the verify input's `custom_mask` (the layout EAGLE's tree verify uses).
TREE_ATTENTION_BACKENDS = ("torch_native", "flashinfer", "triton")


class UnsupportedFlagError(ValueError):
    """A server flag (or flag combination) that dflash_sglang's DFLASH does not support yet."""


@dataclass(frozen=True)
class DFlashSettings:
    """What our worker serves with, resolved and checked once (adapter/boot/resolve.py) in the process that builds
    ServerArgs. Modes: chain (N = B verify rows, k = 1), tree (N best-first nodes from the top-k of each draft
    position), adaptive (each step's shape from `policy()` by batch size; N and k its maxima), goodput (each step's
    chain, 1..N rows, or tree, up to N nodes over top-k, from the goodput controller, core/shape/goodput.py)."""

    draft_dir: str
    draft: DraftConfig  # the checkpoint's config, checked against the target
    mode: str  # one of MODES
    block_size: int  # B: the drafter block [bonus, MASK x (B-1)], one drafter pass per step
    max_nodes: int  # N: the most verify rows per request and step (the result row stride); a step verifies n <= N
    topk: int  # k: the largest top-k a step uses (1: chain)
    max_running_requests: int | None  # None: SGLang's own, as for plain decoding (the goodput controller, flag unset)
    device: str
    draft_attention: str  # "flashinfer" | "torch"
    draft_graphs: str  # one of DRAFT_GRAPHS
    draft_kv_dtype: str  # the draft KV pool's dtype, SGLang's name ("auto": the model dtype; "fp8_e4m3", ...)
    draft_memory: DraftMemory  # its pool row's bytes, what SGLang's KV sizing counts (adapter/draft/memory.py)
    # --speculative-draft-window-size W (adapter/draft/context_rows.py), None: the whole context; served over the slot
    # rows, or over a ring per request slot where `draft_memory.ring` > 0
    draft_window: int | None
    context_len: int  # the target's context length (a request's most draft pool rows)
    tree_cuda_graph: bool  # target verify graphs captured with the tree mask (CUDA, trees)
    dummy_draft: bool  # random draft weights (--speculative-draft-load-format dummy)
    token_map: str | None = None  # the token map file drafted over (--speculative-token-map or the checkpoint's)
    adaptive_table: str | None = None  # adaptive mode only
    adaptive_token_budget: int | None = None
    simulation: SimulatedAcceptance | None = None  # SGLANG_SIMULATE_ACC_* (chain only)
    step_cost: FixedStepCost | None = None  # DFLASH_SIMULATE_STEP_COST (goodput only): the step time observed
    hybrid: bool = False  # the target has Gated DeltaNet layers: each verify's recurrent state is committed
    disaggregation: str | None = None  # PD: "prefill" or "decode" (adapter/scale/disagg.py), None: a whole server
    draft_window_why: str | None = None  # why the window's layout (slot rows or the ring), for the start-up line

    def __post_init__(self) -> None:
        assert self.mode in MODES and (self.mode == "adaptive") == (self.adaptive_table is not None)
        assert self.mode != "chain" or (self.max_nodes == self.block_size and self.topk == 1)
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
        return GoodputConfig(max_nodes=self.max_nodes, max_depth=self.block_size - 1, max_topk=self.topk)

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
