"""Adaptive speculation shape per decode step in the SGLang worker (`DFLASH_ADAPTIVE=1`).

Each decode step verifies `core.adaptive.AdaptivePolicy.choose(running batch size)`: large trees at low
concurrency (the verify is memory-bound, extra nodes are nearly free), short chains at high concurrency (it is
compute-bound). Configuration, read from the environment of the server (every SGLang process inherits it):

- `DFLASH_ADAPTIVE=1` turns it on (`0` or unset: the fixed chain / tree of the flags);
- `DFLASH_ADAPTIVE_TABLE` (core/adaptive.py syntax `MAX_BS:NODESxTOPK,...,inf:NODESxTOPK`, default
  `core.adaptive.DEFAULT_TABLE`); chain rows longer than the drafter block and tree rows larger than its lattice
  are capped to them, as in the reference decoder;
- `DFLASH_ADAPTIVE_TOKEN_BUDGET` (optional int): at most this many verify tokens per step over the whole batch
  (bs * nodes); it must be >= --max-running-requests (every request verifies at least its root).

SGLang sizes the result row stride and the per-step KV reservation (`DFlashDraftInputV2.prepare_for_decode`:
2*N slots past the committed length) from `speculative_num_draft_tokens` = N, read once. In adaptive mode N is
the largest shape the table can pick (or the explicit --speculative-num-draft-tokens, which every row must fit),
each step verifies only its own shape's nodes, and result rows stay N wide (-1 padded). Errors are raised at
ServerArgs construction (adapter/args.py) and again at worker start, one line naming the variable.

`ShapeSchedule` is what the worker asks each step; in fixed mode it returns the one shape of the flags.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field

from dflash_sglang.core.adaptive import DEFAULT_TABLE, ENV_TABLE, AdaptivePolicy, SpecShape

logger = logging.getLogger(__name__)

ENV_SWITCH = "DFLASH_ADAPTIVE"
ENV_BUDGET = "DFLASH_ADAPTIVE_TOKEN_BUDGET"
_SWITCH_VALUES = {"": False, "0": False, "1": True}


class AdaptiveConfigError(ValueError):
    """A malformed or unservable adaptive configuration; the message is one line naming the variable."""


@dataclass(frozen=True)
class AdaptiveEnv:
    """The adaptive-mode environment, parsed and checked for syntax (not yet against the server flags)."""

    table: str  # DFLASH_ADAPTIVE_TABLE, or the default table
    token_budget: int | None  # DFLASH_ADAPTIVE_TOKEN_BUDGET

    @classmethod
    def read(cls, env: dict[str, str] | None = None) -> AdaptiveEnv | None:
        """The configuration when DFLASH_ADAPTIVE=1, else None. Raises AdaptiveConfigError."""
        env = os.environ if env is None else env
        switch = env.get(ENV_SWITCH, "").strip()
        if switch not in _SWITCH_VALUES:
            raise AdaptiveConfigError(f"{ENV_SWITCH}={switch!r}: expected 1 (adaptive shapes) or 0")
        if not _SWITCH_VALUES[switch]:
            ignored = [name for name in (ENV_TABLE, ENV_BUDGET) if env.get(name)]
            if ignored:
                logger.warning("%s set but %s is not 1: the fixed chain/tree flags apply", " and ".join(ignored),
                               ENV_SWITCH)
            return None
        raw_budget = env.get(ENV_BUDGET, "").strip()
        budget = None
        if raw_budget:
            try:
                budget = int(raw_budget)
            except ValueError:
                budget = 0
            if budget < 1:
                raise AdaptiveConfigError(f"{ENV_BUDGET}={raw_budget!r}: expected a positive integer (verify tokens "
                                          f"per step over the batch)")
        settings = cls(env.get(ENV_TABLE, "").strip() or DEFAULT_TABLE, budget)
        settings.policy(block_size=None)  # syntax errors surface here, naming the variable
        return settings

    def policy(self, block_size: int | None) -> AdaptivePolicy:
        """The policy for a drafter block of `block_size` (None: uncapped depth)."""
        max_depth = None if block_size is None else block_size - 1
        try:
            return AdaptivePolicy.parse(self.table, self.token_budget, max_depth)
        except ValueError as e:
            why = str(e).removeprefix(f"{ENV_TABLE}: ")
            raise AdaptiveConfigError(f"{ENV_TABLE}={self.table!r}: {why}") from None


def adaptive_limits(
    settings: AdaptiveEnv, block_size: int, nodes: int | None, vocab_size: int, max_running: int | None,
) -> tuple[AdaptivePolicy, SpecShape]:
    """The policy for a drafter block of `block_size`, and the largest shape any step may get: (N, max top-k).

    nodes: --speculative-num-draft-tokens when given (every row must fit in it), else None (N = the largest row).
    max_running: --max-running-requests, the largest decode batch (must fit in the token budget).
    """
    policy = settings.policy(block_size)
    shapes = policy.row_shapes()
    largest = max(shapes, key=lambda s: s.nodes)
    if nodes is not None and largest.nodes > nodes:
        raise AdaptiveConfigError(
            f"{ENV_TABLE}={settings.table!r} has a {largest.nodes}x{largest.topk} row ({largest.nodes} verify nodes "
            f"per request with block size {block_size}), more than --speculative-num-draft-tokens {nodes} (the "
            f"per-step maximum): raise the flag, drop it, or shrink the table"
        )
    topk = max(s.topk for s in shapes)
    if topk > vocab_size:
        raise AdaptiveConfigError(f"{ENV_TABLE}={settings.table!r}: top-k {topk} is larger than the draft "
                                  f"vocabulary ({vocab_size} tokens)")
    budget = settings.token_budget
    if budget is not None and max_running is not None and budget < max_running:
        raise AdaptiveConfigError(
            f"{ENV_BUDGET}={budget} is below --max-running-requests {max_running}: every running request "
            f"verifies at least one token per step"
        )
    return policy, SpecShape(nodes if nodes is not None else largest.nodes, topk)


@dataclass
class ShapeSchedule:
    """The verify shape of every decode step: the fixed one of the flags, or the policy's for the batch size.

    Adaptive mode counts decode steps per shape and logs the distribution at debug level whenever the shape
    changes (so a steady load logs nothing).
    """

    max_nodes: int  # N: the result row stride and KV reservation; no step verifies more nodes per request
    fixed: SpecShape | None = None
    policy: AdaptivePolicy | None = None
    table: str = ""
    steps: Counter = field(default_factory=Counter)  # adaptive: decode steps per SpecShape
    current: SpecShape | None = None

    def __post_init__(self) -> None:
        assert (self.fixed is None) != (self.policy is None), "a schedule is either fixed or adaptive"
        if self.fixed is not None:
            assert self.fixed.nodes <= self.max_nodes
            self.current = self.fixed

    @classmethod
    def from_env(
        cls, nodes: int, topk: int, block_size: int, vocab_size: int, max_running: int | None
    ) -> ShapeSchedule:
        """The worker's schedule from the resolved flags (N = nodes, k = topk, drafter block B = block_size):
        adaptive when DFLASH_ADAPTIVE=1 (the environment ServerArgs were resolved in, checked again against the
        resolved N), else the fixed shape N x k (the chain: N = B, k = 1)."""
        settings = AdaptiveEnv.read()
        if settings is None:
            return cls(nodes, fixed=SpecShape(nodes, topk))
        policy, _ = adaptive_limits(settings, block_size, nodes, vocab_size, max_running)
        return cls(nodes, policy=policy, table=settings.table)

    @property
    def is_adaptive(self) -> bool:
        return self.policy is not None

    def node_counts(self) -> tuple[int, ...]:
        """Verify rows per request of the table's shapes (the fixed shape's alone): what commit graphs are captured
        for. A token budget can shrink a step below its row's count; such a step commits eagerly."""
        if self.policy is None:
            return (self.fixed.nodes,)
        return tuple(sorted({s.nodes for s in self.policy.row_shapes()}))

    def choose(self, batch_size: int) -> SpecShape:
        """The shape of a decode step over `batch_size` running requests (host-side, no device sync)."""
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

    def distribution(self) -> str:
        """'10x3: 12, 4x1: 40' (decode steps per shape, most used first)."""
        return ", ".join(f"{_name(s)}: {n}" for s, n in self.steps.most_common())

    def describe(self) -> str:
        """One phrase for the startup log line."""
        if self.policy is None:
            shape = self.fixed
            return f"chain of {shape.nodes}" if shape.is_chain else f"tree of {shape.nodes} nodes (top-{shape.topk})"
        budget = "" if self.policy.token_budget is None else f", token budget {self.policy.token_budget}"
        return f"adaptive shapes {self.table}{budget}, at most {self.max_nodes} nodes"


def _name(shape: SpecShape) -> str:
    return f"{shape.nodes}x{shape.topk}"
