"""DP attention (`--attn-dp-size N`, or `--enable-dp-attention --dp N`): our step in lockstep with the other groups.

Under DP attention each attention-DP group has its own scheduler and batch, while the target's dense layers (its MLP,
and its lm_head unless split per group) gather hidden rows from every group. So every rank runs exactly one target
forward per scheduler step, and every rank must know how many rows each group brings (`global_num_tokens`). SGLang's
scheduler gathers raw counts (a prefill group's extend tokens, a decoding group's requests, 0 for an idle group) and
multiplies all of them by the local verify width. Our width varies per step (the goodput controller, trees, the
context cap), and a step may mix groups that prefill with groups that verify. So each step, before its target
forward, every rank all-gathers (its phase, its verify shape) over the TP group (`StepPlan.agree`): the decoding groups
all verify the smallest of their shapes (each rank caps its own at the context limit, so the smallest fits
everywhere), and each rank writes the row counts of this step itself, in SGLang's coordinated-counts mode (no
rescaling, every rank keeps its own forward mode). A group with no batch runs the target's IDLE forward; so does a
group whose step SGLang made idle (ForwardMode.IDLE): SGLang 0.5.23's scheduler idles the other groups while one
prefills under speculative decoding (`Scheduler.get_next_batch_to_run`), so a step mixing prefill and verify groups
does not occur there, but the plan's counts cover it.

Our own collectives (the draft vocab merge and rank-0 broadcasts, adapter/scale/tp.py) run on the attention-TP group,
the ranks that share a batch, never across groups: the borrowed lm_head must be split over that group only
(`--enable-dp-lm-head`, checked at start-up, adapter/boot/refusals.py). The target verify runs eagerly when any group is
idle or prefilling (a replayed graph pads its rows, which the other groups' counts would not say).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dflash_sglang.core.shape.adaptive import SpecShape

from ..versions import attention_dp, view

logger = logging.getLogger(__name__)

IDLE, EXTEND, DECODE = 0, 1, 2  # a group's phase in this step
PHASES = ("idle", "prefill", "verify")


@dataclass(frozen=True)
class StepPlan:
    """One scheduler step over all attention-DP groups."""

    phases: tuple[int, ...]  # per group: IDLE / EXTEND / DECODE
    shape: SpecShape | None  # the verify shape every decoding group runs (None: no group decodes)

    @classmethod
    def agree(cls, phases: list[int], shapes: list[tuple[int, int]]) -> StepPlan:
        """phases [G], shapes [G] (nodes, topk; read for decoding groups only) -> the plan every rank derives alike:
        the decoding groups' smallest shape by nodes, ties to the lowest group."""
        decoding = [(nodes, g, topk) for g, (phase, (nodes, topk)) in enumerate(zip(phases, shapes)) if phase == DECODE]
        shape = None
        if decoding:
            nodes, _, topk = min(decoding)
            shape = SpecShape(nodes, topk)
        return cls(tuple(phases), shape)

    def counts(self, raw: list[int]) -> list[int]:
        """The scheduler's raw per-group counts [G] -> this step's target rows per group: a decoding group's requests
        times the verify width, the others as they are."""
        assert len(raw) == len(self.phases), (raw, self.phases)
        return [int(c) * self.shape.nodes if p == DECODE else int(c) for c, p in zip(raw, self.phases)]

    @property
    def uniform(self) -> bool:
        """Every group verifies this step (a replayed verify graph is then safe)."""
        return all(p == DECODE for p in self.phases)

    @property
    def any_work(self) -> bool:
        return any(p != IDLE for p in self.phases)


class SingleGroup:
    """No DP attention: the worker's DP hooks (`AttentionDP`'s) do nothing; every step is this group's alone."""

    def prefills(self, batch) -> bool:
        return batch.forward_mode.is_extend() or batch.is_extend_in_batch

    def decode(self, batch, shape: SpecShape) -> tuple[SpecShape, bool]:
        return shape, False

    def prefill(self, batch) -> None:
        pass

    def idle(self, batch) -> bool:
        return False

    def seed(self, seed: int) -> int:
        return seed

    def reseed(self) -> None:
        pass


class AttentionDP(SingleGroup):
    """The step plan's collective (over the TP group: every rank of every group takes part once per step)."""

    def __init__(self, groups: int, attn_tp: int, group) -> None:
        self.groups, self.attn_tp, self.group = groups, attn_tp, group
        self._seen: set[tuple[int, ...]] = set()  # the phase patterns met so far (each logged once, at DEBUG)
        self._seed: int | None = None  # torch's default generator's seed, applied at the group's first forward

    @classmethod
    def of(cls, server_args) -> SingleGroup:
        """This worker's DP attention (from its resolved server args: adapter/boot/resolve.py admitted it), or a
        SingleGroup."""
        cfg = view(server_args)
        dp = attention_dp(cfg)
        if dp is None:
            return SingleGroup()
        from sglang.srt.distributed import get_tp_group

        groups = dp[1]
        return cls(groups, int(cfg.tp_size) // groups, get_tp_group())  # (attention CP is refused: 1)

    @property
    def index(self) -> int:
        """This rank's attention-DP group: the TP group's ranks are group-major (`plan` reads them so too)."""
        return int(self.group.rank_in_group) // self.attn_tp

    def plan(self, phase: int, shape: SpecShape | None) -> StepPlan:
        """This rank's phase (and, decoding, its shape) -> the step's plan, the same on every rank. Host integers over
        the TP group's CPU (gloo) group: no device work, no device sync."""
        nodes, topk = (shape.nodes, shape.topk) if shape is not None else (0, 0)
        mine = torch.tensor([phase, nodes, topk], dtype=torch.int64)
        rows = [torch.empty(3, dtype=torch.int64) for _ in range(self.group.world_size)]
        torch.distributed.all_gather(rows, mine, group=self.group.cpu_group)
        every = [r.tolist() for r in rows[:: self.attn_tp]]  # one row per group: ranks are group-major
        assert len(every) == self.groups, (every, self.groups)
        plan = StepPlan.agree([r[0] for r in every], [(r[1], r[2]) for r in every])
        if plan.phases not in self._seen:
            self._seen.add(plan.phases)
            logger.debug("DFLASH DP attention: a step with groups %s, here %s, verify shape %s",
                         "/".join(PHASES[p] for p in plan.phases), PHASES[phase], plan.shape)
        return plan

    def prefills(self, batch) -> bool:
        """Whether this group prefills (`is_extend_in_batch` says whether any group does)."""
        return batch.forward_mode.is_extend()

    def decode(self, batch, shape: SpecShape) -> tuple[SpecShape, bool]:
        """(the shape every decoding group verifies, whether the verify runs eagerly: unless every group verifies);
        this step's counts applied."""
        plan = self.plan(DECODE, shape)
        self.apply(batch, plan)
        return plan.shape, not plan.uniform

    def prefill(self, batch) -> None:
        self.apply(batch, self.plan(EXTEND, None))

    def idle(self, batch) -> bool:
        """Whether the target runs its IDLE forward (another group's collectives wait for it)."""
        plan = self.plan(IDLE, None)
        if plan.any_work:
            self.apply(batch, plan)
        return plan.any_work

    def seed(self, seed: int) -> int:
        """SGLang seeds torch's default generator alike in every scheduler; the target's sampler and our accept draw
        from it. Each group samples its own requests, so two groups running alike batches would draw alike uniforms
        (the same prompt in both got the same tokens: the chi-square of tests/test_sglang_e2e.py caught it). So each
        group reseeds it at its first forward (SGLang reseeds after building the workers) with --random-seed offset
        by the group, and seeds the worker's walk generator so; the ranks of one group still draw alike."""
        self._seed = seed + 7919 * self.index
        return self._seed

    def reseed(self) -> None:
        if self._seed is not None:
            torch.manual_seed(self._seed)
            self._seed = None

    @staticmethod
    def apply(batch, plan: StepPlan) -> None:
        """Write this step's per-group rows on the batch, for SGLang's ForwardBatch (coordinated: not rescaled)."""
        if batch.global_num_tokens is None:  # (no gather ran: a lone group)
            return
        batch.global_num_tokens = plan.counts(batch.global_num_tokens)
        batch.global_num_tokens_for_logprob = plan.counts(batch.global_num_tokens_for_logprob)
        batch.dp_spec_prefill_coordination_applied = True
