"""Per-request checks of our DFLASH worker: what it cannot serve identically to plain decoding is refused.

Checked twice, with the same rules and messages:
- on the tokenizer side, before the request is scheduled (`TokenizerManager._validate_one_request`, hooked by the
  plugin): SGLang answers a ValueError there as it answers any invalid request (a 400, or for a stream one error
  event), so no model code runs for a refused request and nothing is emitted;
- in the scheduler (`validate_dflash_request`), for requests that reach it another way: SGLang aborts those with a
  400 after an abort prefill.

Refused:
- an empty prompt (`"text": ""` or `"input_ids": []`; prefilled alone it is a 0-token forward that raises in the
  target's attention and kills the scheduler, on the plain path too);
- token ids outside the target vocabulary (the embedding would raise inside the scheduler and take every running
  request down with it: upstream's plain path crashes the same way);
- custom logit processors: SGLang calls a processor with the request itself (`__req__`), whose output it reads;
  at a verify row the output would have to include the drafts before that row, which the processor interface has
  no way to say (docs/request-options.md, "Request options");
Frequency / presence / repetition penalties and min_new_tokens are served exactly (adapter/step/penalties.py), hidden
states too (adapter/step/hidden.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PREFIX = "DFLASH (dflash-sglang)"


def _refusal(ids: Sequence[int] | None, vocab: int | None, custom_logit_processor: Any) -> str | None:
    if ids is not None and not len(ids):
        return f"{PREFIX}: empty prompt (no input tokens)"
    if ids is not None and vocab is not None and (max(ids) >= vocab or min(ids) < 0):
        bad = next(t for t in ids if t >= vocab or t < 0)
        return f"{PREFIX}: input token id {bad} is outside the target vocabulary [0, {vocab})"
    if custom_logit_processor:
        return (f"{PREFIX} does not support custom logit processors (a processor reads the request's output, which "
                f"at a verify row would have to include the drafts before it)")
    return None


def refusal(req: Any) -> str | None:
    """Why our worker cannot serve this SGLang scheduler Req identically to plain decoding, or None."""
    return _refusal(req.origin_input_ids, getattr(req, "vocab_size", None),
                    getattr(req, "custom_logit_processor", None))


def input_refusal(obj: Any, input_ids: Sequence[int] | None, vocab: int | None) -> str | None:
    """The same for one tokenized request on the tokenizer side (a single GenerateReqInput and its token ids; None
    where the prompt is given as embeddings)."""
    return _refusal(input_ids, vocab, getattr(obj, "custom_logit_processor", None))
