"""Recurrent (linear-attention) layers of a hybrid target in the reference decoder: a state per verify node.

A hybrid target (Qwen3.5 / Qwen3.6 / Qwen3-Next: Gated DeltaNet layers between full-attention layers) carries, per
request and per linear layer, a convolution window and a recurrent state that every token updates. Attention K/V of
rejected drafts can simply be dropped; recurrent state cannot, it has already absorbed them. So the reference verifies
a hybrid target one node at a time, each node starting from its parent's state (a chain's parent is the previous row;
a tree node's is its tree parent, so siblings never see each other), keeps the state after every node, and after
acceptance makes the state of each request's last accepted node the live one. This is what SGLang does on the GPU
with its per-draft-position state buffers (`disable_state_update` during the verify, then a scatter of the last
accepted position's state into the live slot).

The states live in an HF cache's linear-attention layers (`conv_states` / `recurrent_states`, one dict entry per
state kind); this module reads and writes them in place.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def is_recurrent_layer(layer) -> bool:
    """An HF cache layer holding recurrent state (transformers' LinearAttentionLayer and its hybrids)."""
    return hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states")


def has_attention(layer) -> bool:
    """An HF cache layer holding attention K/V on a time axis."""
    return getattr(layer, "keys", None) is not None


def select_rows(cache, rows: Tensor) -> None:
    """Keep only batch rows `rows` [bs'] int64 of every layer of an HF cache (attention K/V and recurrent state)."""
    for layer in cache.layers:
        if is_recurrent_layer(layer):
            layer.reorder_cache(rows)  # index_select of every initialized state on the batch axis
        if has_attention(layer):
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]


def _live(cache) -> list[Tensor]:
    """Every initialized recurrent state tensor of the cache, each [bs, ...] (written in place by the target)."""
    out = []
    for layer in cache.layers:
        if not is_recurrent_layer(layer):
            continue
        for states in (layer.conv_states, layer.recurrent_states):
            out.extend(t for t in states.values() if t is not None)
    return out


@dataclass
class NodeStates:
    """The recurrent state before a verify (slot 0) and after each of its N nodes (slot n + 1).

    `saved[i]` [N + 1, bs, ...] mirrors the cache's i-th live state tensor. A verify calls `load(parent)` before each
    node's forward and `record(n)` after it; `commit(last)` then leaves each request in its last accepted node's state.
    """

    live: list[Tensor]
    saved: list[Tensor]

    @classmethod
    def of(cls, cache, n_nodes: int) -> NodeStates:
        live = _live(cache)
        assert live, "a hybrid target's cache holds recurrent state after the prefill"
        saved = [t.new_empty((n_nodes + 1, *t.shape)) for t in live]
        for s, t in zip(saved, live):
            s[0].copy_(t)
        return cls(live, saved)

    def _write(self, slot: Tensor) -> None:
        rows = torch.arange(slot.shape[0], device=slot.device)
        for s, t in zip(self.saved, self.live):
            t.copy_(s[slot, rows])

    def load(self, parent: Tensor) -> None:
        """Before a node's forward: each request's state after its parent node, parent [bs] int64 (-1: the
        committed state, i.e. the node is the verify's root)."""
        self._write(parent + 1)

    def record(self, node: int) -> None:
        """After node `node`'s forward: keep every request's state."""
        for s, t in zip(self.saved, self.live):
            s[node + 1].copy_(t)

    def commit(self, last: Tensor) -> None:
        """After acceptance: each request's state after its last kept node, last [bs] int64 (the deepest node of
        the accepted path; the root is always kept)."""
        self._write(last + 1)


def last_row(accept_len: Tensor, path: Tensor | None) -> Tensor:
    """The verify row of each request's last committed token [bs] int64, whose state becomes the live one: row
    accept_len [bs] of a chain; of a tree, the accepted path's node at that depth (path [bs, D+1] int64: the root,
    then the accepted nodes, then -1; core/step/tree_verify.py)."""
    return accept_len if path is None else path.gather(1, accept_len[:, None])[:, 0]
