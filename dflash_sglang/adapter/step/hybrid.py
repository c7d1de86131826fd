"""A hybrid target's recurrent state around our verify: SGLang's own snapshot / commit machinery, driven per step.

Hybrid targets (Qwen3.5 / Qwen3.6 / Qwen3-Next: Gated DeltaNet layers; SGLang calls their state "mamba") keep a
convolution window and a recurrent state per request and linear layer. During a TARGET_VERIFY SGLang's linear-attention
kernels leave the live state alone and write the state after every verify row into per-row scratch buffers
(`intermediate_ssm`, `intermediate_conv_window`; a tree's rows each from their tree parent's, found from
`retrieve_next_token` / `retrieve_next_sibling` when the server's top-k is > 1). After acceptance the worker copies
each request's last accepted row's state into its live slot, and fills the prefix cache's tracking slot where the
commit crossed a tracking point (`update_mamba_state_after_mtp_verify`, which the builtin DFLASH and EAGLE call too).
core/step/recurrent.py is the executable spec of the same rule (and `last_row`, the row both commit).

The scratch buffers hold `--speculative-num-draft-tokens` rows per request, and the worker declares that as the most
rows any step verifies (adapter/boot/resolve.py), so SGLang sizes them (`state_scratch_bytes`) and no step overruns
them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dflash_sglang.core.step.recurrent import last_row

from ..versions import mamba_track_interval


@dataclass(frozen=True)
class HybridTarget:
    """The target runner's linear-attention backend (it owns the scratch buffers and the commit) and the server's
    top-k (above 1 its kernels verify trees and read the tree links on every verify, chains included)."""

    backend: Any  # SGLang's HybridLinearAttnBackend (the target runner's attn_backend)
    model: Any  # the target model (the backend's commit reads its layers)
    server_topk: int

    @classmethod
    def of(cls, model_runner, server_topk: int) -> HybridTarget:
        """For a target start-up found hybrid (adapter/boot/draft_checks.py); refuses to serve where SGLang does not
        run it as one (no state would be committed: rejected drafts would stay in the recurrent state)."""
        from sglang.srt.configs.hybrid_arch import mambaish_config

        if mambaish_config(model_runner.model_config) is None:
            raise RuntimeError("DFLASH (dflash-sglang): the target has linear-attention layers but SGLang does not "
                               "run it as a hybrid model; serve it with DFLASH_SGLANG_IMPL=builtin")
        backend = model_runner.attn_backend
        if not hasattr(backend, "update_mamba_state_after_mtp_verify"):
            raise RuntimeError(f"DFLASH (dflash-sglang): the hybrid target's attention backend "
                               f"{type(backend).__name__} cannot commit verified recurrent state")
        return cls(backend, model_runner.model, int(server_topk))

    def links(self, tree, bs: int, n: int, device) -> tuple[Tensor, Tensor] | None:
        """The tree links the linear layers' tree kernels read on every verify of n rows per request once the
        server's top-k is > 1 (first child / next sibling [bs, n] int64, SGLang's EAGLE layout, -1 none; a chain as a
        one-child-each tree); None at top-k 1 (chain kernels)."""
        if self.server_topk <= 1:
            return None
        if tree is not None:
            return tree.retrive_next_token, tree.retrive_next_sibling
        return chain_links(bs, n, device)

    def commit(self, batch, seq_lens_pre: Tensor, accept_len: Tensor, path_rows: Tensor | None) -> None:
        """After acceptance, before anything plans another target forward (0.5.17 reads the verify's metadata):
        each request's live state <- its state after its last accepted verify row; the tracking slots where the
        commit crosses a tracking point. accept_len [bs] int64: accepted drafts (accept_len + 1 tokens commit);
        path_rows [bs, D+1] int64: a tree's accepted path (verify rows, root first, then -1); None for a chain (row i
        is the i-th committed token)."""
        track = None
        if batch.mamba_track_indices is not None:
            track = track_steps(seq_lens_pre, accept_len + 1, mamba_track_interval(batch.tree_cache.page_size),
                                path_rows)
        self.backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=last_row(accept_len, path_rows), mamba_track_indices=batch.mamba_track_indices,
            mamba_steps_to_track=track, model=self.model, req_pool_indices=batch.req_pool_indices[: len(accept_len)])


class NoRecurrentState:
    """The worker's hybrid hook for a target without linear-attention layers: no links, nothing to commit."""

    def links(self, tree, bs: int, n: int, device) -> None:
        return None

    def commit(self, batch, seq_lens_pre: Tensor, accept_len: Tensor, path_rows: Tensor | None) -> None:
        pass


def chain_links(bs: int, n: int, device) -> tuple[Tensor, Tensor]:
    """A chain of n rows in tree-link form: (first child [bs, n], next sibling [bs, n]) int64."""
    rows = torch.arange(n, device=device)
    nxt = torch.where(rows + 1 < n, rows + 1, -1).expand(bs, n).contiguous()
    return nxt, torch.full_like(nxt, -1)


def track_steps(seq_lens_pre: Tensor, commit_lens: Tensor, interval: int, path_rows: Tensor | None) -> Tensor:
    """The verify row whose state fills each request's prefix-cache tracking slot [bs] int64, -1 none: where the
    commit (seq_lens_pre -> seq_lens_pre + commit_lens) crosses a multiple of `interval`, the row of the token at that
    multiple minus one (the state after it covers the prefix up to the tracking point). The builtin DFLASH of 0.5.17
    compares the length before the verify with itself here, so it never tracks (0.5.23 fixed that)."""
    post = seq_lens_pre + commit_lens
    crosses = seq_lens_pre // interval != post // interval
    ith = (post // interval * interval - seq_lens_pre - 1).clamp_min(0)  # the tracked token's index in the commit
    ith = torch.where(crosses & (ith < commit_lens), ith, -1)
    if path_rows is None:
        return ith
    row = path_rows.gather(1, ith.clamp_min(0)[:, None])[:, 0]
    return torch.where(ith >= 0, row, -1)


def state_scratch_bytes(req_to_token_pool) -> int:
    """Bytes of a hybrid target's per-verify-row state buffers (SGLang's MambaPool speculative state, allocated from
    the rows we declare), logged beside our draft pool: they grow with --speculative-num-draft-tokens x
    --max-running-requests."""
    state = getattr(getattr(req_to_token_pool, "mamba_pool", None), "mamba_cache", None)
    seen, total = set(), 0
    for name in ("intermediate_ssm", "intermediate_conv_window"):
        bufs = getattr(state, name, None)
        for t in bufs if isinstance(bufs, (list, tuple)) else [bufs]:
            if isinstance(t, Tensor):
                base = t._base if t._base is not None else t  # a deduplicated window is a strided view of one buffer
                if id(base) not in seen:
                    seen.add(id(base))
                    total += base.numel() * base.element_size()
    return total
