import os
import shutil

import pytest
import torch

from dflash_sglang import ops
from dflash_sglang.core.step.block import BlockInputs, build_block_inputs, build_tree_inputs, draft_kv_indices


def _table(rows: int = 3, width: int = 8) -> torch.Tensor:
    return (1000 * torch.arange(rows)[:, None] + torch.arange(width)).to(torch.int32)


def test_block_inputs_hand_computed():
    bonus, seq_lens, pool = torch.tensor([7, 9]), torch.tensor([3, 0]), torch.tensor([2, 0])
    r = build_block_inputs(bonus, seq_lens, 4, 99, _table(), pool)
    assert r.input_ids.tolist() == [[7, 99, 99, 99], [9, 99, 99, 99]]
    assert r.positions.tolist() == [[3, 4, 5, 6], [0, 1, 2, 3]]
    assert r.out_cache_loc.tolist() == [[2003, 2004, 2005, 2006], [0, 1, 2, 3]]
    assert all(t.dtype == torch.int64 for t in (r.input_ids, r.positions, r.out_cache_loc))
    assert build_block_inputs(bonus, seq_lens, 4, 99).out_cache_loc is None


def test_int32_indices_give_the_same_result():
    bonus, seq_lens, pool = torch.tensor([5, 6, 7]), torch.tensor([1, 4, 2]), torch.tensor([1, 2, 0])
    a = build_block_inputs(bonus, seq_lens, 3, 0, _table(), pool)
    b = build_block_inputs(bonus, seq_lens.int(), 3, 0, _table(), pool.int())
    assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values()))


def test_tree_inputs_hand_computed_and_chain_is_a_block():
    tokens = torch.tensor([[7, 11, 12, 13], [9, 21, 22, 23]])
    depth = torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]])
    r = build_tree_inputs(tokens, depth, torch.tensor([3, 0]), _table(), torch.tensor([2, 0]))
    assert r.input_ids.tolist() == tokens.tolist()
    assert r.positions.tolist() == [[3, 4, 4, 5], [0, 1, 2, 3]]
    assert r.out_cache_loc.tolist() == [[2003, 2004, 2005, 2006], [0, 1, 2, 3]]
    block = build_block_inputs(torch.tensor([7, 9]), torch.tensor([3, 0]), 4, 99, _table(), torch.tensor([2, 0]))
    chain = build_tree_inputs(block.input_ids, torch.arange(4).expand(2, 4), torch.tensor([3, 0]), _table(),
                              torch.tensor([2, 0]))
    assert all(torch.equal(x, y) for x, y in zip(vars(block).values(), vars(chain).values()))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=1), "block_size must be >= 2"),
        (dict(seq_lens=torch.tensor([1, 2, 3])), "one batch size"),
        (dict(req_to_token=_table(), req_pool_indices=None), "req_pool_indices"),
        (dict(seq_lens=torch.tensor([6, 0]), req_to_token=_table()), "exceeds req_to_token width 8"),
        (dict(req_to_token=_table()[0]), r"req_to_token must be \[R, W\]"),
    ],
)
def test_block_inputs_errors(kwargs, match):
    args = dict(bonus=torch.tensor([1, 2]), seq_lens=torch.tensor([0, 1]), block_size=4, mask_token_id=5,
                req_to_token=None, req_pool_indices=torch.tensor([0, 1]))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_block_inputs(**args)


def test_ops_face_runs_the_reference_on_cpu_and_fills_out_buffers():
    tokens, depth = torch.tensor([[7, 1, 2, 3], [9, 4, 5, 6]]), torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]])
    seq_lens, pool = torch.tensor([3, 0]), torch.tensor([2, 0])
    want = build_tree_inputs(tokens, depth, seq_lens, _table(), pool)
    out = BlockInputs(*(torch.full((2, 4), -7, dtype=torch.int64) for _ in range(3)))
    got = ops.build_tree_inputs(tokens, depth, seq_lens, _table(), pool, out=out)
    assert got is out and all(torch.equal(x, y) for x, y in zip(vars(want).values(), vars(out).values()))
    with pytest.raises(ValueError, match=r"out.positions must be \[2, 4\] int64"):
        ops.build_tree_inputs(tokens, depth, seq_lens, _table(), pool,
                              out=BlockInputs(out.input_ids, out.positions[:, :3], out.out_cache_loc))


def same(x, y):
    return y is None if x is None else torch.equal(x, y)


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs g++ or $CXX")
def test_kernel_logic_on_cpu_matches_reference():
    g = torch.Generator().manual_seed(0)
    bs, block = 99, 7
    seq, pool = torch.randint(0, 8, (bs,), generator=g), torch.randperm(bs, generator=g).int()
    bonus, table = torch.randint(0, 500, (bs,), generator=g), torch.randint(0, 1 << 30, (bs, 16), generator=g).int()
    tokens = torch.randint(0, 500, (bs, block), generator=g)
    tokens[:, 0] = bonus
    for args in ((), (table, pool)):
        depth = torch.randint(0, 4, (bs, block), generator=g)
        want = build_tree_inputs(tokens, depth, seq, *args)
        got = ops.build_tree_inputs(tokens, depth.int(), seq.int(), *args, backend="host")
        assert all(same(x, y) for x, y in zip(vars(want).values(), vars(got).values()))


def test_backend_choice_is_checked():
    tokens, depth, seq_lens = torch.tensor([[7], [9]]), torch.zeros(2, 1, dtype=torch.int64), torch.tensor([3, 0])
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.build_tree_inputs(tokens, depth, seq_lens, backend="gpu")
    with pytest.raises(ValueError, match="backend 'cuda' cannot run on cpu tensors"):
        ops.build_tree_inputs(tokens, depth, seq_lens, backend="cuda")


def _draft_case(seq_lens, pool, g, rows=6, width=16):
    """kv_indptr [bs+1] int32 for contexts seq_lens and block 4, a [rows, width] table of distinct slots."""
    block = 4
    kv = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    kv[1:] = torch.cumsum(torch.tensor(seq_lens) + block, 0)
    table = torch.randperm(10_000, generator=g)[: rows * width].view(rows, width).to(torch.int32)
    return kv, torch.tensor(pool), table, block


def test_draft_kv_indices_hand_computed():
    """Per request: its context slots, then its block scratch rows; a padded request (context 0, the padding slot
    past the table) gets only its scratch rows; a context outside the table reads -1; rows past the end stay."""
    g = torch.Generator().manual_seed(0)
    seq_lens, pool = (5, 0, 12, 2, 0), (3, 0, 5, 2, 6)  # request 4: padded (slot 6 is past the 6-row table)
    kv, pool_t, table, block = _draft_case(seq_lens, pool, g)
    out = torch.full((int(kv[-1]) + 5,), -7, dtype=torch.int32)
    draft_kv_indices(kv, pool_t, table, 500, block, out)
    want = []
    for n, r in zip(seq_lens, pool):
        want += (table[r, :n].tolist() if n else []) + [500 + r * block + j for j in range(block)]
    assert out.tolist() == want + [-7] * 5
    wide = torch.full((int(kv[-1]),), 0, dtype=torch.int32)  # request 2's context is longer than a 10-wide table
    draft_kv_indices(kv, pool_t, table[:, :10], 500, block, wide)
    start = int(kv[2])
    assert wide[start:start + 12].tolist() == table[5, :10].tolist() + [-1, -1]


def test_draft_kv_indices_of_a_window_hand_computed():
    """With seq_lens (a draft window W): request i's keys are the slots of its last kv_len - block positions, then
    its block scratch rows; kv_indptr from min(seq_len, W) (adapter/draft/context_rows.py `SlotRows` with a window)."""
    g = torch.Generator().manual_seed(2)
    seq_lens, pool, window = (9, 0, 3, 14), (3, 0, 5, 2), 5
    keys = [min(n, window) for n in seq_lens]
    kv, pool_t, table, block = _draft_case(keys, pool, g)
    out = draft_kv_indices(kv, pool_t, table, 500, block, torch.full((int(kv[-1]),), -7, dtype=torch.int32),
                           seq_lens=torch.tensor(seq_lens))
    want = []
    for n, k, r in zip(seq_lens, keys, pool):
        want += table[r, n - k:n].tolist() + [500 + r * block + j for j in range(block)]
    assert out.tolist() == want


def test_draft_kv_indices_of_a_ring_hand_computed():
    """With a ring of R rows per request slot (a draft window W over the ring, adapter/draft/context_rows.py
    `WindowRows`): request i's keys are the ring rows r*R + p % R of its last min(L, W) positions, no table read."""
    seq_lens, pool, window, ring, block = (9, 0, 3, 14), (3, 0, 5, 2), 5, 8, 4
    keys = [min(n, window) for n in seq_lens]
    kv = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    kv[1:] = torch.cumsum(torch.tensor(keys) + block, 0)
    out = draft_kv_indices(kv, torch.tensor(pool), None, 500, block, torch.full((int(kv[-1]),), -7, dtype=torch.int32),
                           seq_lens=torch.tensor(seq_lens), ring=ring)
    want = []
    for n, k, r in zip(seq_lens, keys, pool):
        want += [r * ring + p % ring for p in range(n - k, n)] + [500 + r * block + j for j in range(block)]
    assert out.tolist() == want


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs g++ or $CXX")
@pytest.mark.parametrize("layout", ["whole", "window", "ring"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_draft_kv_indices_kernel_logic_matches_reference(index_dtype, layout):
    """The kernel's per-row logic (built for the CPU) equals the reference: the whole context, or a window's last W
    positions (seq_lens given, some past the table's width so that their rows read -1) over the slot rows or a ring of
    R rows per request slot (no table)."""
    g = torch.Generator().manual_seed(1)
    window, ring = (None, 0) if layout == "whole" else (5, 8 if layout == "ring" else 0)
    seq_lens = torch.randint(0, 17 if window is None else 20, (40,), generator=g)
    keys = seq_lens if window is None else seq_lens.clamp(max=window)
    pool = torch.randint(0, 7, (40,), generator=g).tolist()  # slot 6: past the table, so context rows read -1
    kv, pool_t, table, block = _draft_case(keys.tolist(), pool, g)
    lens, table = (None if window is None else seq_lens), (None if ring else table)
    want = draft_kv_indices(kv, pool_t, table, 900, block, torch.full((int(kv[-1]) + 3,), -7, dtype=torch.int32),
                            seq_lens=lens, ring=ring)
    got = ops.draft_kv_indices(kv, pool_t.to(index_dtype), table, 900, block, out=torch.full_like(want, -7),
                               seq_lens=None if lens is None else lens.to(index_dtype), ring=ring, backend="host")
    assert torch.equal(got, want) and (want == -1).any() == (not ring)
    with pytest.raises(ValueError, match="kv_indptr must be"):
        ops.draft_kv_indices(kv[:-1], pool_t, table, 900, block, out=want, ring=ring, seq_lens=lens, backend="host")
    with pytest.raises(ValueError, match="seq_lens must be"):
        ops.draft_kv_indices(kv, pool_t, table, 900, block, out=want, seq_lens=seq_lens[:3], ring=ring,
                             backend="host")
    with pytest.raises(ValueError, match="a ring .* needs seq_lens"):
        ops.draft_kv_indices(kv, pool_t, None, 900, block, out=want, seq_lens=None, ring=max(ring, 8),
                             backend="host")
