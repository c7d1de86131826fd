"""return_hidden_states: the target's final hidden state of every prompt token and every committed token.

Plain SGLang returns what its logits processor receives (the target's last layer after the final norm) when a request
asks for hidden states: at prefill every prompt position (`True`, the server's FULL mode) or the last one (`"last"`),
then one row per decode step, the row that predicted the new token. With DFLASH the target's forward captures the
drafter's feature layers, and SGLang puts those, not the final hidden states, into `logits_output.hidden_states`
(0.5.23 keeps the final ones beside them, 0.5.17 drops them). So we read the logits processor's input ourselves: a
forward pre-hook on the target's `LogitsProcessor`, armed only for a forward whose batch has a request that asks
(every other forward pays one attribute check). A verify row holds exactly the hidden state plain decoding computes at
that position (same prefix), so the committed token j of a request gets the row that predicted it: row j of a chain,
the j-th node of a tree's accepted path (`logprobs.predicting_rows`). The scheduler reads decode rows per request in
blocks of the result stride N (`hidden_states` [bs * N, H], rows i * N .. i * N + accepted - 1), as for its own
speculative workers, and prefill rows as it laid them out for the capture mode (`versions.prefill_hidden_full`).

A CUDA graph replay would skip the hook: a verify with such a request runs eagerly (`run_target_verify(eager=...)`),
and a forward whose hook did not fire raises instead of returning another layer's values.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from .logprobs import predicting_rows


class FinalHiddenStates:
    """The input hidden states of the target's logits processor [tokens, H], captured while armed."""

    def __init__(self, model: torch.nn.Module) -> None:
        from sglang.srt.layers.logits_processor import LogitsProcessor

        processors = [m for m in model.modules() if isinstance(m, LogitsProcessor)]
        if not processors:
            raise RuntimeError(f"DFLASH: the target {type(model).__name__} has no LogitsProcessor to read hidden "
                               f"states from")
        self._armed = False
        self._value: Tensor | None = None
        # the model's own (first) one: its forward ends with it
        processors[0].register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        if self._armed:
            self._value = args[1] if len(args) > 1 else kwargs["hidden_states"]

    @contextlib.contextmanager
    def capture(self, on: bool) -> Iterator[None]:
        """Arm the hook for the forwards inside (when `on`); `take()` reads the last one."""
        if not on:
            yield
            return
        self._armed, self._value = True, None
        try:
            yield
        finally:
            self._armed = False

    def take(self) -> Tensor:
        value, self._value = self._value, None
        if value is None:
            raise RuntimeError("DFLASH: the target's logits processor did not run eagerly in a forward whose requests "
                               "ask for hidden states (a CUDA graph replayed it?)")
        return value


def prefill_rows(hidden: Tensor, extend_lens: list[int], full: bool) -> Tensor:
    """hidden [sum(extend_lens), H] -> what the scheduler reads for a prefill: every row in FULL mode, else each
    request's last one [bs, H]."""
    if full:
        return hidden
    last = torch.tensor(extend_lens, device=hidden.device).cumsum(0) - 1
    return hidden[last]


def decode_rows(hidden: Tensor, accept_nodes: Tensor | None, bs: int, max_nodes: int) -> Tensor:
    """hidden [bs * n, H] (verify rows) -> [bs * N, H] (N = max_nodes, the result row stride): per request the
    committed tokens' predicting rows, then zeros in the slots the scheduler never reads. A step commits at most n
    tokens per request, so only m = min(n, N) rows per request are gathered (a plain step under the goodput
    controller: one, not N), as logprobs.attach_logprobs computes only m distributions."""
    n = hidden.shape[0] // bs
    m = min(n, max_nodes)
    rows = predicting_rows(accept_nodes, bs, n, m, hidden.device)  # [bs, m]
    flat = rows + torch.arange(bs, device=hidden.device)[:, None] * n
    out = hidden.new_zeros(bs, max_nodes, hidden.shape[1])
    out[:, :m] = hidden[flat.reshape(-1)].view(bs, m, -1)
    return out.view(bs * max_nodes, -1)
