"""What the draft KV pool costs, and SGLang's KV sizing told exactly that.

Our pool (adapter/draft/model.py `DraftKVPool`) keeps, for every target KV slot, K and V of every draft layer: 2 x
layers x kv_heads x head_dim elements in the draft KV dtype (the model dtype, or fp8: core/draft/draft_kv.py), on every
TP rank (the drafter is replicated; only its vocabulary is split). Past the mirrored slots it has one block of scratch
rows per request-pool slot (+ one for graph padding), which scales with the request pool, not the context. SGLang's
sizing is per token, so it cannot count them: over the slot rows they come out of the memory SGLang leaves outside its
KV pools (--mem-fraction-static's headroom), as the builtin's draft activations do, and both start-up lines say so and
how much (`scratch_words`); with a window's ring they are allocated with the rings, before the sizing, which counts
them.

SGLang sizes the target's token capacity (max_total_num_tokens, and from it max_running_requests) from the bytes one
token costs; for DFLASH it adds the draft pool's share through `dflash_utils.scale_kv_cell_size_per_token_for_dflash`
(same signature from 0.5.17 to 0.5.23): 0.5.17 scales the target's per-layer bytes by the draft's layer count (wrong
when the draft's heads, head_dim or KV dtype differ from the target's), 0.5.23 counts the draft's own geometry and
dtype but divides its KV heads by the TP size (our pool is not sharded). `cell_size_hook` replaces both with the exact
bytes of our pool row, so the target pool plus ours fit the memory SGLang measured.

A draft window (`--speculative-draft-window-size W`, adapter/draft/context_rows.py) over the slot rows (the radix cache
on, or what else needs them) costs the same per token: the rows stay, only the reads are bounded. With the ring (the
radix cache off) the pool has no per-token term: it holds R = W + N - 1 rows per request-pool slot, a per-request term
SGLang's per-token sizing cannot express. The worker allocates that pool when it is built (`DFlashWorker.__init__`, as
it loads the draft weights), before SGLang measures the memory its KV pools may take, so the measurement counts it, and
the hook adds 0 B/token. The request slots it serves are --max-running-requests + 1 (SGLang's req_to_token rows), which
the resolution always declares with the ring (adapter/boot/resolve.py); the worker checks SGLang's table against it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dflash_sglang.core.draft.config import DraftConfig
from dflash_sglang.core.draft.draft_kv import parse_kv_dtype

logger = logging.getLogger(__name__)

CELL_SIZE = "sglang.srt.speculative.dflash_utils.scale_kv_cell_size_per_token_for_dflash"


@dataclass(frozen=True)
class DraftMemory:
    """One draft pool row (a token's draft K/V) and what a request costs at a context length."""

    layers: int
    kv_heads: int
    head_dim: int
    element_size: int  # bytes per stored element
    dtype: str  # the draft KV dtype's name ("auto" resolved to the model dtype's torch name)
    window: int | None = None  # W (--speculative-draft-window-size), None: the whole context
    ring: int = 0  # R: rows per request-pool slot of the window's ring (context_rows.py `ring_size`), 0: slot rows

    def __post_init__(self) -> None:
        assert self.ring == 0 or (self.window is not None and self.ring > self.window), self

    @property
    def bytes_per_row(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_token(self) -> int:
        """What a target KV slot costs the draft pool (SGLang's per-token sizing): a row, or 0 with the ring."""
        return self.bytes_per_row if self.ring == 0 else 0

    def bytes_per_request(self, context_len: int) -> int:
        """A request of context_len tokens: one row per target KV slot it holds, or its ring."""
        return self.bytes_per_row * (context_len if self.ring == 0 else self.ring)

    def describe(self, context_len: int) -> str:
        if self.ring:
            return (f"draft KV {self.dtype}: window {self.window}, 0 B/token, {self.ring} rows x {self.bytes_per_row} "
                    f"B = {human_bytes(self.bytes_per_request(context_len))}/request at any context length")
        window = "" if self.window is None else f"window {self.window} over slot rows, "
        return (f"draft KV {self.dtype}: {window}{self.bytes_per_token} B/token, "
                f"{human_bytes(self.bytes_per_request(context_len))}/request at {context_len} tokens")


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB' (KiB, MiB or GiB, whichever keeps the number at least 1)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def draft_memory(cfg: DraftConfig, kv_dtype: str, model_dtype: torch.dtype, window: int | None = None,
                 ring: int = 0) -> DraftMemory:
    """The pool row of a draft of config cfg stored in kv_dtype (SGLang's name; "auto": model_dtype); under a draft
    window W, over slot rows (ring 0) or R = ring rows per request slot."""
    dtype = parse_kv_dtype(kv_dtype) or model_dtype
    name = kv_dtype if kv_dtype != "auto" else str(model_dtype).removeprefix("torch.")
    return DraftMemory(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                       torch.empty((), dtype=dtype).element_size(), name, window, ring)


def cell_size_hook(original, *args, **kwargs) -> int:
    """AROUND `scale_kv_cell_size_per_token_for_dflash(target_cell_size_per_token=..., ...)`: the target's bytes per
    token plus our pool row's (`DFlashSettings.draft_memory`), where our worker serves; SGLang's estimate otherwise."""
    from sglang.srt.runtime_context import get_context

    estimate = original(*args, **kwargs)
    try:
        settings = getattr(get_context().server_args, "_dflash_settings", None)
    except ValueError:  # no server args published in this process: not a scheduler of ours
        return estimate
    if settings is None:
        return estimate
    target = int(kwargs["target_cell_size_per_token"] if "target_cell_size_per_token" in kwargs else args[0])
    cell = target + settings.draft_memory.bytes_per_token
    logger.info("DFLASH (dflash-sglang): %s", sizing_line(target, estimate, settings))
    return cell


def sizing_line(target: int, estimate: int, settings) -> str:
    """The KV sizing's start-up line: the bytes per token it is told (the target's `target` + our pool row), SGLang's
    own `estimate`, and the block scratch it does not count per token (settings: the resolved DFlashSettings)."""
    memory = settings.draft_memory
    return (f"KV sizing at {target + memory.bytes_per_token} B/token = target {target} + "
            f"{memory.describe(settings.context_len)} (SGLang's estimate: {estimate}); "
            f"{scratch_words(memory, settings.block_size)}")


def scratch_words(memory: DraftMemory, block: int) -> str:
    """What the pool's block scratch costs per request slot (`block` rows) and whether SGLang's KV sizing counts it."""
    per_slot = f"block scratch {block} rows = {human_bytes(block * memory.bytes_per_row)} per request slot"
    if memory.ring:  # (a window over the slot rows holds target slots, as the whole context does)
        return f"{per_slot}, allocated with the rings before SGLang's KV sizing, which counts both"
    return (f"{per_slot}, not in SGLang's per-token KV sizing: allocated with the pool from the memory SGLang leaves "
            f"outside its KV pools (--mem-fraction-static)")


def check_pool_memory(pool, memory: DraftMemory, slots: int, context_len: int) -> str:
    """The start-up line on an allocated pool (adapter/draft/model.py `DraftKVPool`) of `slots` context rows (mirrored
    target slots, or the window rings); raises if a row costs other than what SGLang's KV sizing was told at
    resolution (`memory`), which would let the pool outgrow the memory SGLang measured."""
    row = pool.nbytes() // pool.rows
    if row != memory.bytes_per_row:
        raise RuntimeError(f"DFLASH (dflash-sglang): a draft KV pool row costs {row} B, but the KV sizing counted "
                           f"{memory.bytes_per_row} B/row ({memory.dtype}): the drafter's dtype differs from the "
                           f"target model config's")
    scratch = human_bytes((pool.rows - slots) * row)
    if memory.ring:  # (a window over the slot rows holds target slots, as the whole context does)
        held = (f"{slots // memory.ring} request slots x {memory.ring} ring rows, allocated before SGLang's KV sizing "
                f"with their {scratch} block scratch: all counted by it")
    else:
        held = (f"{slots} target slots, counted by SGLang's KV sizing per token, + {scratch} block scratch, not "
                f"counted: from the memory SGLang leaves outside its KV pools")
    return f"{memory.describe(context_len)}, pool {human_bytes(pool.nbytes())} ({held})"
