"""Adaptive speculation shape per decode step in the SGLang worker (`--speculative-adaptive`).

Each decode step verifies `core.shape.adaptive.AdaptivePolicy.choose(running batch size)`: large trees at low
concurrency (the verify is memory-bound, extra nodes are nearly free), short chains at high concurrency (it is
compute-bound). Settings (adapter/boot/flags.py): `--speculative-dflash-adaptive-table` (core/shape/adaptive.py syntax
`MAX_BS:NODESxTOPK,...,inf:NODESxTOPK`, default `core.shape.adaptive.DEFAULT_TABLE`; chain rows longer than the drafter
block and tree rows larger than its lattice are capped to them, as in the reference decoder) and
`--speculative-dflash-adaptive-token-budget` (optional: at most this many verify tokens per step over the whole
batch, bs * nodes; it must be >= --max-running-requests, as every request verifies at least its root).

SGLang sizes the result row stride and the per-step KV reservation (`DFlashDraftInputV2.prepare_for_decode`:
2*N slots past the committed length) from `speculative_num_draft_tokens` = N, read once. In adaptive mode N is
the largest shape the table can pick (or the explicit --speculative-num-draft-tokens, which every row must fit),
each step verifies only its own shape's nodes, and result rows stay N wide (-1 padded). `adaptive_limits` checks a
table at start-up (adapter/boot/mode.py), one line naming the flag.

`ShapeSchedule` is what the worker asks each step (`start`); in fixed mode it returns the one shape of the flags, in
goodput mode (the default, core/shape/goodput.py) the controller's chain or tree, which then learns from each step's
acceptance and wall time (`finish`, observed at the next `start`).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from torch import Tensor

from dflash_sglang.core.shape.adaptive import AdaptivePolicy, SpecShape
from dflash_sglang.core.shape.goodput import FixedStepCost, GoodputController, describe, label
from dflash_sglang.core.speculate import rank_paths

from ..settings import DFlashSettings
from .metrics import GoodputMetrics

logger = logging.getLogger(__name__)
TABLE_FLAG = "--speculative-dflash-adaptive-table"
BUDGET_FLAG = "--speculative-dflash-adaptive-token-budget"


class AdaptiveConfigError(ValueError):
    """A malformed or unservable adaptive configuration; the message is one line naming the flag."""


def adaptive_limits(
    table: str, token_budget: int | None, block_size: int, nodes: int | None, vocab_size: int, max_running: int,
) -> tuple[AdaptivePolicy, SpecShape]:
    """The policy for a drafter block of `block_size`, and the largest shape any step may get: (N, max top-k).

    nodes: --speculative-num-draft-tokens when given (every row must fit in it), else None (N = the largest row).
    max_running: --max-running-requests, the largest decode batch (must fit in the token budget).
    """
    if token_budget is not None and (not isinstance(token_budget, int) or token_budget < 1):
        raise AdaptiveConfigError(f"{BUDGET_FLAG} {token_budget!r}: expected a positive integer (verify tokens per "
                                  f"step over the batch)")
    try:
        policy = AdaptivePolicy.parse(table, token_budget, block_size - 1)
    except ValueError as e:
        raise AdaptiveConfigError(f"{TABLE_FLAG} {table!r}: {e}") from None
    shapes = policy.row_shapes()
    largest = max(shapes, key=lambda s: s.nodes)
    if nodes is not None and largest.nodes > nodes:
        raise AdaptiveConfigError(
            f"{TABLE_FLAG} {table!r} has a {largest.nodes}x{largest.topk} row ({largest.nodes} verify nodes "
            f"per request with block size {block_size}), more than --speculative-num-draft-tokens {nodes} (the "
            f"per-step maximum): raise the flag, drop it, or shrink the table"
        )
    topk = max(s.topk for s in shapes)
    if topk > vocab_size:
        raise AdaptiveConfigError(f"{TABLE_FLAG} {table!r}: top-k {topk} is larger than the draft vocabulary "
                                  f"({vocab_size} tokens)")
    if token_budget is not None and token_budget < max_running:
        raise AdaptiveConfigError(
            f"{BUDGET_FLAG} {token_budget} is below --max-running-requests {max_running}: every running request "
            f"verifies at least one token per step"
        )
    return policy, SpecShape(nodes if nodes is not None else largest.nodes, topk)


@dataclass
class ShapeSchedule:
    """The verify shape of every decode step: the fixed one of the flags, the policy's for the batch size, or the
    goodput controller's.

    Adaptive mode counts decode steps per shape and logs the distribution at debug level whenever the shape
    changes (so a steady load logs nothing). Goodput mode logs the controller's state (chosen chains, acceptance by
    depth, cost terms, predicted vs measured tokens/s) at INFO every `log_every_s` seconds of decoding.
    """

    max_nodes: int  # N: the result row stride and KV reservation; no step verifies more nodes per request
    fixed: SpecShape | None = None
    policy: AdaptivePolicy | None = None
    controller: GoodputController | None = None
    table: str = ""
    token_budget: int | None = None  # goodput: at most this many verify rows per step over the batch
    steps: Counter = field(default_factory=Counter)  # adaptive: decode steps per SpecShape
    current: SpecShape | None = None
    log_every_s: float = 60.0
    metrics: GoodputMetrics | None = None  # goodput mode with --enable-metrics (adapter/step/metrics.py)
    step_cost: FixedStepCost | None = None  # goodput: observed instead of wall time (DFLASH_SIMULATE_STEP_COST)
    _last_log: float = field(default=0.0, repr=False)
    # goodput: the last decode step (shape, accepted drafts [bs], the drafter's ranks of the committed tokens [bs, m]
    # or None, start time), observed at the next step's start (its tensors are ready by then, no sync of their own;
    # the time between the two starts is what the step cost the server); its time is not used after a prefill or
    # idle step in between (the interval was not its own: `_clean`)
    _last: tuple | None = field(default=None, repr=False)
    _clean: bool = field(default=False, repr=False)
    _start: float = field(default=0.0, repr=False)  # perf_counter at this decode step's shape choice

    def __post_init__(self) -> None:
        assert sum(x is not None for x in (self.fixed, self.policy, self.controller)) == 1, \
            "a schedule is fixed, a table or the goodput controller"
        if self.fixed is not None:
            assert self.fixed.nodes <= self.max_nodes
            self.current = self.fixed

    @classmethod
    def from_settings(cls, settings: DFlashSettings) -> ShapeSchedule:
        """Adaptive mode: the table's policy under N = settings.max_nodes; else the fixed shape N x k (the chain:
        N = B, k = 1). The table was checked at start-up."""
        if settings.mode == "goodput":
            return cls(settings.max_nodes, controller=GoodputController(settings.controller_config()),
                       token_budget=settings.adaptive_token_budget, step_cost=settings.step_cost)
        if settings.mode != "adaptive":
            return cls(settings.max_nodes, fixed=SpecShape(settings.max_nodes, settings.topk))
        return cls(settings.max_nodes, policy=settings.policy(), table=settings.adaptive_table)

    def node_counts(self) -> tuple[int, ...]:
        """Verify rows per request of the table's shapes (the fixed shape's alone): what commit graphs are captured
        for. A token budget can shrink a step below its row's count; such a step commits eagerly."""
        if self.controller is not None:
            return tuple(sorted({s.nodes for s in self.controller.shapes}))
        if self.policy is None:
            return (self.fixed.nodes,)
        return tuple(sorted({s.nodes for s in self.policy.row_shapes()}))

    def start(self, batch_size: int, vocab, device) -> SpecShape:
        """A decode step's shape; in goodput mode the previous step is observed first, and TP rank 0's choice is every
        rank's (each rank times its own steps; vocab: adapter/scale/tp.py's DraftVocab)."""
        self._start = time.perf_counter()
        if self._last is not None:
            shape, accepted, ranks, start = self._last
            self.observe(shape, accepted.tolist(), self._start - start if self._clean else None,
                         None if ranks is None else rank_paths(ranks.tolist()))
            self._last = None
        shape = self.choose(batch_size)
        if self.controller is not None and vocab.world_size > 1:
            shape = SpecShape(*vocab.same_ints_on_every_rank((shape.nodes, shape.topk), device))
        return shape

    def finish(self, shape: SpecShape, accepted: Tensor, ranks: Tensor | None) -> None:
        """The step's drafts' real acceptance [bs] (before any max_new_tokens cut) and ranks, for goodput mode."""
        if self.controller is not None:
            self._last, self._clean = (shape, accepted, ranks, self._start), True

    def interrupt(self) -> None:
        """A prefill or idle step: the time to the next decode step is not the last decode step's."""
        self._clean = False

    @property
    def wants_ranks(self) -> bool:
        """Whether `finish` reads the drafter's ranks of the committed tokens (the controller prices trees by them)."""
        return self.controller is not None and self.controller.uses_ranks

    def choose(self, batch_size: int) -> SpecShape:
        """The shape of a decode step over `batch_size` running requests (host-side, no device sync)."""
        if self.controller is not None:
            decision = self.controller.choose(batch_size)
            shape = decision.shape
            if self.token_budget is not None:
                shape = shape.at_most(max(1, self.token_budget // batch_size))
            if shape != self.current and logger.isEnabledFor(logging.DEBUG):
                logger.debug("DFLASH goodput: batch size %d -> %s %s (%s)", batch_size,
                             "chain" if shape.is_chain else "tree", label(shape), decision.reason)
            self.current = shape
            return shape
        if self.policy is None:
            return self.fixed
        shape = self.policy.choose(batch_size)
        assert 1 <= shape.nodes <= self.max_nodes, (shape, self.max_nodes)  # adaptive_limits checked the rows
        self.steps[shape] += 1
        if shape != self.current:
            self.current = shape
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("DFLASH adaptive: batch size %d -> %s; decode steps per shape so far: %s",
                             batch_size, _name(shape), self.distribution())
        return shape

    def observe(self, shape: SpecShape, accepted: Sequence[int], seconds: float | None,
                ranks: Sequence[Sequence[int]] | None = None) -> None:
        """A finished decode step (goodput mode): its shape, accepted drafts per request, wall seconds (None when
        the interval held other work, e.g. a prefill) and the drafter's ranks of the committed tokens (None: not
        measured)."""
        if self.controller is None:
            return
        if self.step_cost is not None and seconds is not None:  # (a step whose interval held other work stays out)
            seconds = self.step_cost.seconds(shape, len(accepted))
        self.controller.observe(shape, accepted, seconds, ranks)
        if self.metrics is not None:
            self.metrics.step(shape, self.controller, len(accepted))
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s and logger.isEnabledFor(logging.INFO):
            self._last_log = now
            logger.info("DFLASH goodput: %s", describe(self.controller.summary(len(accepted))))
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("DFLASH goodput step: shape=%s bs=%d accepted=%s seconds=%s", label(shape), len(accepted),
                         sum(accepted), seconds)

    def chains_only(self, why: str) -> None:
        """Goodput mode on a server that cannot verify trees (page size, attention backend: known only once the
        worker runs): the controller chooses among chains alone."""
        if self.controller is None or not self.controller.trees:
            return
        self.controller = GoodputController(replace(self.controller.cfg, max_topk=1))
        logger.info("DFLASH goodput: trees are not candidates (%s); chains only", why)

    def distribution(self) -> str:
        """'10x3: 12, 4x1: 40' (decode steps per shape, most used first)."""
        return ", ".join(f"{_name(s)}: {n}" for s, n in self.steps.most_common())

    def describe(self) -> str:
        """One phrase for the startup log line."""
        if self.controller is not None:
            budget = "" if self.token_budget is None else f", token budget {self.token_budget}"
            trees = self.controller.trees
            tree_part = (f" and trees of {'/'.join(sorted({str(s.nodes) for s in trees}, key=int))} nodes over top-"
                         f"{'/'.join(sorted({str(s.topk) for s in trees}, key=int))}" if trees else "")
            return (f"goodput controller over chains of {'/'.join(map(str, self.controller.lengths))} rows (1: a plain "
                    f"step){tree_part}{budget}")
        if self.policy is None:
            shape = self.fixed
            return f"chain of {shape.nodes}" if shape.is_chain else f"tree of {shape.nodes} nodes (top-{shape.topk})"
        budget = "" if self.policy.token_budget is None else f", token budget {self.policy.token_budget}"
        return f"adaptive shapes {self.table}{budget}, at most {self.max_nodes} nodes"


def _name(shape: SpecShape) -> str:
    return f"{shape.nodes}x{shape.topk}"
