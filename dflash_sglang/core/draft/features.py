"""Target feature capture: the layer-id convention in one place.

Layer id i means the OUTPUT of target decoder layer i, which HF exposes as `hidden_states[i + 1]`
(`hidden_states[0]` is the embedding output). Getting this offset wrong is the classic DFlash bug.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def target_layer_features(hidden_states: Sequence[Tensor], layer_ids: Sequence[int]) -> Tensor:
    """HF `output_hidden_states` tuple (len L + 1, each [bs, T, H]) -> [bs, T, len(layer_ids) * H]."""
    n_layers = len(hidden_states) - 1
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"target layer ids {bad} out of range for a target with {n_layers} layers")
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)
