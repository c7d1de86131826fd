"""Simulated acceptance (SGLANG_SIMULATE_ACC_*): force each decode step's commit length, for capacity planning.

With random weights (`--load-format dummy`) acceptance is ~1 and says nothing about a real deployment; forcing
the commit length makes throughput at a given tau measurable before a drafter exists. We read the same
environment variables as SGLang's builtin DFLASH worker and draw the length with SGLang's own sampler, so both
workers see the same acceptance distribution in a side-by-side benchmark:

- `SGLANG_SIMULATE_ACC_LEN` (float): mean commit length per step (accepted drafts + bonus); <= 0 or unset: off;
- `SGLANG_SIMULATE_ACC_METHOD`: `match-expected` (floor/ceil of the mean with the probabilities that make the
  mean exact) or `multinomial` (round(N(mean, 1))), clamped to [1, B];
- `SGLANG_SIMULATE_ACC_TOKEN_MODE`: `fixed` (every emitted token is id 100) or `real-draft-token` (the first
  L-1 drafts, then the target's own token at row L-1).

Ours, for the goodput controller (core/shape/goodput.py), which must see shorter chains accept proportionally less:
- `DFLASH_SIMULATE_ACC_RATE` (0 < p <= 1): every draft position is accepted with probability p given the ones
  before it, so a chain of n rows commits 1 + min(G, n - 1) tokens (G geometric); tokens as `real-draft-token`.
  Chains and the goodput controller (not with SGLANG_SIMULATE_ACC_LEN).

And for the goodput controller's other input, step time:
- `DFLASH_SIMULATE_STEP_COST`: six comma-separated seconds, the controller's cost terms (core/shape/goodput.py TERMS:
  step, per_request, per_extra_row, draft_pass, draft_per_request, tree_per_request); every decode step is observed
  as costing theta . features(shape, batch size) instead of its wall time, so the controller's choices follow
  acceptance and batch size alone (deterministic tests; what-if runs of another machine's costs). Goodput mode only.

One length L is drawn per step (on the host) and applied to every request of the batch; KV and draft-KV commits
follow L exactly as if verification had accepted it. Chains only (a tree's accepted path is not a prefix).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_sglang.core.shape.goodput import FixedStepCost

METHODS = ("match-expected", "multinomial")
TOKEN_MODES = ("fixed", "real-draft-token")
FIXED_TOKEN_ID = 100  # the builtin's "some legit token id"


RATE_ENV = "DFLASH_SIMULATE_ACC_RATE"
STEP_COST_ENV = "DFLASH_SIMULATE_STEP_COST"


def simulated_step_cost(env: Mapping[str, str] | None = None) -> FixedStepCost | None:
    """DFLASH_SIMULATE_STEP_COST's fixed step cost, or None when unset (a malformed value raises, naming it)."""
    raw = (os.environ if env is None else env).get(STEP_COST_ENV, "").strip()
    if not raw:
        return None
    try:
        return FixedStepCost.parse(raw)
    except ValueError as e:
        raise ValueError(f"{STEP_COST_ENV}: {e}") from None


@dataclass(frozen=True)
class SimulatedAcceptance:
    mean: float = 0.0  # SGLANG_SIMULATE_ACC_LEN
    method: str = "match-expected"
    token_mode: str = "fixed"
    rate: float | None = None  # DFLASH_SIMULATE_ACC_RATE: per-position acceptance instead of a mean length

    @property
    def variable(self) -> str:
        return RATE_ENV if self.rate is not None else "SGLANG_SIMULATE_ACC_LEN"

    def serves(self, mode: str) -> bool:
        """Whether this simulation applies to a worker mode (adapter/settings.py MODES)."""
        return mode in ("chain", "goodput") if self.rate is not None else mode == "chain"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> SimulatedAcceptance | None:
        """The configured simulation, or None when SGLANG_SIMULATE_ACC_LEN is unset or <= 0.

        Raises ValueError naming the variable for a malformed value (at worker start-up, not mid-run).
        """
        env = os.environ if env is None else env
        raw = env.get("SGLANG_SIMULATE_ACC_LEN", "").strip()
        rate = env.get(RATE_ENV, "").strip()
        if rate:
            if raw:
                raise ValueError(f"{RATE_ENV} and SGLANG_SIMULATE_ACC_LEN are both set: choose one")
            try:
                p = float(rate)
            except ValueError:
                raise ValueError(f"{RATE_ENV}={rate!r}: expected a number in (0, 1]") from None
            if not 0 < p <= 1:
                raise ValueError(f"{RATE_ENV}={rate!r}: expected a number in (0, 1]")
            return cls(token_mode="real-draft-token", rate=p)
        if not raw:
            return None
        try:
            mean = float(raw)
        except ValueError:
            raise ValueError(f"SGLANG_SIMULATE_ACC_LEN={raw!r}: expected a number") from None
        if mean <= 0:
            return None
        method = env.get("SGLANG_SIMULATE_ACC_METHOD", "match-expected") or "match-expected"
        mode = env.get("SGLANG_SIMULATE_ACC_TOKEN_MODE", "fixed") or "fixed"
        if method not in METHODS:
            raise ValueError(f"SGLANG_SIMULATE_ACC_METHOD={method!r}: expected one of {', '.join(METHODS)}")
        if mode not in TOKEN_MODES:
            raise ValueError(f"SGLANG_SIMULATE_ACC_TOKEN_MODE={mode!r}: expected one of {', '.join(TOKEN_MODES)}")
        return cls(mean, method, mode)

    def sample_commit_len(self, block_size: int) -> int:
        """One commit length L in [1, block_size], drawn by SGLang's own sampler (same law as the builtin), or with
        the per-position rate (leading successes, torch's default generator: SGLang's --random-seed)."""
        if self.rate is not None:
            hits = (torch.rand(block_size - 1) < self.rate).tolist() + [False]
            return 1 + hits.index(False)
        from .versions import sample_simulated_acc_len

        return sample_simulated_acc_len(self.mean, self.method, block_size)

    def force(self, drafts: Tensor, target_argmax: Tensor, commit_len: int) -> tuple[Tensor, Tensor, Tensor]:
        """Outcome of a step that commits `commit_len` tokens for every request.

        drafts [bs, B-1] int64, target_argmax [bs, B] int64 (row j: the target's token after block row j).
        Returns accept_len [bs] int64 (= commit_len - 1), out_tokens [bs, B] int64 (the committed tokens, then
        -1), bonus [bs] int64 (the last committed token, the next step's root).
        """
        bs, block = target_argmax.shape
        assert 1 <= commit_len <= block and drafts.shape == (bs, block - 1)
        accepted = commit_len - 1
        out = torch.full((bs, block), -1, dtype=torch.int64, device=drafts.device)
        if self.token_mode == "fixed":
            out[:, :commit_len] = FIXED_TOKEN_ID
        else:
            out[:, :accepted] = drafts[:, :accepted]
            out[:, accepted] = target_argmax[:, accepted]
        accept_len = torch.full((bs,), accepted, dtype=torch.int64, device=drafts.device)
        return accept_len, out, out[:, accepted].clone()
