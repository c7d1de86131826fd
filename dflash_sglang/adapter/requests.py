"""Per-request checks of our DFLASH worker: what it cannot serve identically to plain decoding is refused.

Called by the plugin's hook on SGLang's `validate_dflash_request` (the scheduler aborts a refused request with a
400 and this message, and keeps serving the others). Each refusal is a feature our speculative step does not
reproduce exactly yet, so serving the request would silently change its output:

- token ids outside the target vocabulary (the embedding would raise inside the scheduler and take every running
  request down with it: upstream's plain path crashes the same way, we check since we validate anyway);
- an empty prompt (`"text": ""` or `"input_ids": []`; prefilled alone it is a 0-token forward that raises in the
  target's attention and kills the scheduler, on the plain path too);
- frequency / presence / repetition penalties (they must see the tokens drafted earlier in the same block);
- min_new_tokens (EOS would have to be masked row by row inside a verify block);
- custom logit processors (they may read the output so far, which the verify rows extend);
- return_hidden_states (the worker returns none).
"""
from __future__ import annotations

from typing import Any

PREFIX = "DFLASH (dflash-sglang)"
# sampling param -> its neutral value
PENALTIES = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


def refusal(req: Any) -> str | None:
    """Why our worker cannot serve this SGLang Req identically to plain decoding, or None."""
    vocab = getattr(req, "vocab_size", None)
    ids = req.origin_input_ids
    if not len(ids):
        return f"{PREFIX}: empty prompt (no input tokens)"
    if vocab is not None and len(ids) and (max(ids) >= vocab or min(ids) < 0):
        bad = next(t for t in ids if t >= vocab or t < 0)
        return f"{PREFIX}: input token id {bad} is outside the target vocabulary [0, {vocab})"
    params = req.sampling_params
    for name, neutral in PENALTIES.items():
        value = getattr(params, name, neutral)
        if value is not None and value != neutral:
            return f"{PREFIX} does not support {name} yet (got {value})"
    if (getattr(params, "min_new_tokens", 0) or 0) > 0:
        return f"{PREFIX} does not support min_new_tokens yet (got {params.min_new_tokens})"
    if getattr(req, "custom_logit_processor", None):
        return f"{PREFIX} does not support custom logit processors yet"
    if getattr(req, "return_hidden_states", False):
        return f"{PREFIX} does not support return_hidden_states yet"
    return None
