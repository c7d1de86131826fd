"""adapter/step/cpu.py: the torch stand-ins for SGLang's Triton helpers on CPU, against plain transcriptions of the
kernels.

`assign_req_to_token_pool` (SGLang mem_cache/allocation.py, launched by `prepare_for_decode` for every decode batch):
one program per request copies its run of out_cache_loc, at the offset of the runs before it, into its
req_to_token row from start to end. The transcription below follows the kernel's pointer arithmetic on the flat
table, so it also shows what the kernel does past a row's end (it writes the next row).
"""
from __future__ import annotations

import random

import pytest
import torch
from sglang_support import requires_sglang

pytestmark = requires_sglang


def kernel_transcription(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc) -> None:
    """SGLang's Triton kernel, one loop iteration per program id, on the flat table."""
    pool_len = req_to_token.shape[1]
    flat = req_to_token.view(-1)
    for pid in range(req_pool_indices.numel()):
        kv_start, kv_end = int(start_offset[pid]), int(end_offset[pid])
        out_offset = int((end_offset[:pid] - start_offset[:pid]).sum())
        base = int(req_pool_indices[pid]) * pool_len
        for j in range(kv_end - kv_start):
            flat[base + kv_start + j] = out_cache_loc[out_offset + j]


def random_batch(rng: random.Random, bs: int, rows: int, width: int, slack: int = 0):
    """A decode batch as prepare_for_decode builds it: distinct request rows, each reserving a run of slots past its
    committed length (0 for a request that already holds enough), runs packed in request order, out_cache_loc possibly
    longer than needed."""
    pool = rng.sample(range(rows), bs)
    starts, ends = [], []
    for _ in range(bs):
        run = rng.choice([0, 1, 2, 3, 8, 16, 32])
        start = rng.randrange(0, width - run + 1)
        starts.append(start)
        ends.append(start + run)
    total = sum(e - s for s, e in zip(starts, ends))
    out = torch.tensor(rng.sample(range(1, 10**6), total + slack), dtype=torch.int64)
    return (torch.tensor(pool), torch.tensor(starts, dtype=torch.int64), torch.tensor(ends, dtype=torch.int64), out)


@pytest.mark.parametrize("bs", [1, 3, 48, 256, 300])
@pytest.mark.parametrize("seed", [0, 1])
def test_assign_matches_the_kernel_on_random_batches(bs, seed):
    from dflash_sglang.adapter.step.cpu import assign_req_to_token_pool

    rng = random.Random(seed * 1000 + bs)
    rows, width = bs + 7, 96
    pool, starts, ends, out = random_batch(rng, bs, rows, width, slack=rng.choice([0, 5]))
    got = torch.full((rows, width), -1, dtype=torch.int32)
    want = got.clone()
    assign_req_to_token_pool(pool, got, starts, ends, out)
    kernel_transcription(pool, want, starts, ends, out)
    assert torch.equal(got, want)
    assert int((got >= 0).sum()) == int((ends - starts).sum())


@pytest.mark.parametrize("over", [1, 3])
def test_a_run_past_the_row_is_refused_not_dropped(over):
    """Before: a run ending one column past the row was silently cut (a slot lost for good), a longer one crashed."""
    from dflash_sglang.adapter.step.cpu import assign_req_to_token_pool

    width = 16
    table = torch.zeros(4, width, dtype=torch.int32)
    start = width - 2
    with pytest.raises(AssertionError, match=r"KV slots assigned past the req_to_token row \(16 columns\)"):
        assign_req_to_token_pool(torch.tensor([2]), table, torch.tensor([start]), torch.tensor([start + 2 + over]),
                                 torch.arange(1, 3 + over))
    assert not table.any()  # nothing written
