import pytest
import torch

from dflash_sglang.core.step.accept import (
    DraftQ, SamplingParams, cap_commits, greedy_accept, rejection_accept, sample_from, target_probs,
)


def test_greedy_accept_cases():
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3], [9, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 0, 7, 8], [4, 2, 3, 1], [9, 6, 7, 2]])
    r = greedy_accept(draft, target)
    assert r.accept_len.tolist() == [3, 1, 0, 3]
    assert r.bonus.tolist() == [8, 0, 4, 2]
    assert r.out_tokens.tolist() == [[5, 6, 7, 8], [5, 0, -1, -1], [4, -1, -1, -1], [9, 6, 7, 2]]


def test_cap_commits_cuts_each_run_at_its_budget():
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3], [9, 6, 7]])
    r = greedy_accept(draft, torch.tensor([[5, 6, 7, 8], [5, 0, 7, 8], [4, 2, 3, 1], [9, 6, 7, 2]]))
    # budgets: below the run (cut), equal to it, above it, and 0 (a finished row's overshoot step: still 1 token)
    c = cap_commits(r, torch.tensor([2, 2, 3, 0]))
    assert c.accept_len.tolist() == [1, 1, 0, 0]
    assert c.bonus.tolist() == [6, 0, 4, 9]
    assert c.out_tokens.tolist() == [[5, 6, -1, -1], [5, 0, -1, -1], [4, -1, -1, -1], [9, -1, -1, -1]]


def test_greedy_rows_of_rejection_sampling_equal_greedy():
    torch.manual_seed(0)
    bs, B, V = 99, 6, 111
    logits = torch.randn(bs, B, V)
    argmax = logits.argmax(-1)
    draft = torch.where(torch.rand(bs, B - 1) < 0.7, argmax[:, :-1], torch.randint(0, V, (bs, B - 1)))
    p = target_probs(logits, SamplingParams.full(bs, temperature=0.0))
    r = rejection_accept(draft, p, torch.rand(bs, B - 1), torch.rand(bs))
    g = greedy_accept(draft, argmax)
    assert torch.equal(r.out_tokens, g.out_tokens) and torch.equal(r.accept_len, g.accept_len)
    assert int(g.accept_len.max()) == B - 1 and int(g.accept_len.min()) == 0  # both edge cases covered


def test_target_probs_filters():
    logits = torch.tensor([[[4.0, 3.0, 2.0, 1.0, 0.0]]])
    def p(**kw):
        return target_probs(logits, SamplingParams.full(1, **kw))[0, 0]

    assert (p(temperature=1.0, top_k=2)[2:] == 0).all() and p(temperature=1.0, top_k=2)[:2].sum() == pytest.approx(1)
    full = torch.softmax(logits[0, 0], -1)
    kept = p(temperature=1.0, top_p=float(full[0]) + 1e-3)  # needs the second token to reach p
    assert (kept[:2] > 0).all() and (kept[2:] == 0).all()
    assert p(temperature=1.0, top_p=0.01).tolist() == [1.0, 0, 0, 0, 0]
    torch.testing.assert_close(p(temperature=2.0), torch.softmax(logits[0, 0] / 2, -1))
    assert p(temperature=0.0).tolist() == [1.0, 0, 0, 0, 0]
    mixed = SamplingParams(torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]))
    out = target_probs(logits.expand(2, 1, 5), mixed)
    assert out[0, 0].tolist() == [1.0, 0, 0, 0, 0] and torch.allclose(out[1, 0], full)
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams.full(1, temperature=1.0, top_p=0.0)
    # min-p: tokens under min_p x the largest probability go, the rest renormalised (after top-k / top-p)
    floor = float(full[2] / full[0]) - 1e-4  # token 2 just above the floor: kept
    torch.testing.assert_close(p(temperature=1.0, min_p=floor), torch.cat([full[:3] / full[:3].sum(), torch.zeros(2)]))
    assert p(temperature=1.0, min_p=float(full[1] / full[0]) + 1e-3)[1:].eq(0).all()
    assert p(temperature=1.0, top_k=2, min_p=0.5 * floor)[2:].eq(0).all()  # top-k still applies
    torch.testing.assert_close(p(temperature=1.0, min_p=0.0), full)
    with pytest.raises(ValueError, match="min_p=1.5"):
        SamplingParams.full(1, temperature=1.0, min_p=1.5)


def test_sample_from_never_picks_zero_mass():
    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5, 5)
    u = torch.tensor([0.0, 0.49, 0.5, 0.99, 0.9999999])
    assert sample_from(w, u).tolist() == [1, 1, 3, 3, 3]


@pytest.mark.parametrize("seed", range(4))
def test_point_mass_rejection_is_exact(seed):
    """With a one-hot draft, P(first emitted token = x) equals p(x): integrate coins/resample on a grid."""
    g = torch.Generator().manual_seed(seed)
    V, n = 5, 400
    p = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    d = int(torch.randint(0, V, (1,), generator=g))
    grid = (torch.arange(n) + 0.5) / n
    coins, u = torch.meshgrid(grid, grid, indexing="ij")
    bs = coins.numel()
    target_p = p.expand(bs, 2, V).contiguous()
    r = rejection_accept(torch.full((bs, 1), d), target_p, coins.reshape(bs, 1), u.reshape(bs))
    first = r.out_tokens[:, 0]
    freq = torch.bincount(first, minlength=V).float() / bs
    torch.testing.assert_close(freq, p, atol=3.0 / n, rtol=0)


@pytest.mark.parametrize("support", [None, (4, 1, 3)], ids=["dense", "candidates"])
def test_sampled_draft_q_rejection_is_exact(support):
    """Non-degenerate q: emitted distribution is p (Monte Carlo with q-sampled drafts, chi-square); q over the whole
    vocabulary, or over a few candidate ids (zero elsewhere, as DFlash2's selector proposes)."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(3)
    V, bs = 6, 60000
    p = torch.softmax(torch.randn(V, generator=g), -1)
    q = torch.softmax(torch.randn(V if support is None else len(support), generator=g), -1)
    draft = torch.multinomial(q, bs, replacement=True, generator=g)[:, None]
    if support is None:
        draft_q = DraftQ.dense(q.expand(bs, 1, V))
    else:
        ids = torch.tensor(support)
        draft, draft_q = ids[draft], DraftQ(ids.expand(bs, 1, len(support)), q.expand(bs, 1, len(support)))
    r = rejection_accept(draft, p.expand(bs, 2, V), torch.rand(bs, 1, generator=g), torch.rand(bs, generator=g),
                         draft_q=draft_q)
    counts = torch.bincount(r.out_tokens[:, 0], minlength=V).double()
    assert chisquare(counts.numpy(), (p.double() * bs).numpy()).pvalue > 1e-3


def _mixed_params(bs: int, top_p_rows: bool, seed: int = 0) -> tuple[SamplingParams, list, list, list]:
    """A batch mixing greedy rows, temperature-only rows, top-k rows and (optionally) top-p rows, with min-p."""
    g = torch.Generator().manual_seed(seed)
    temperature = [0.0 if i % 3 == 0 else 0.5 + (i % 4) / 4 for i in range(bs)]
    top_k = [(0, 5, 40, 0)[i % 4] for i in range(bs)]
    top_p = [(0.6 if top_p_rows and i % 5 == 1 else 1.0) for i in range(bs)]
    min_p = torch.where(torch.rand(bs, generator=g) < 0.3, 0.1, 0.0)
    return (SamplingParams(torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p), min_p),
            temperature, top_k, top_p)


@pytest.mark.parametrize("top_p_rows", [False, True])
def test_host_hints_give_the_same_target_probs(top_p_rows):
    """With hints, target_probs skips the sort where no row asks for top-p (the k-th largest from a partial top-k):
    the same distribution, ties with the k-th logit kept, greedy rows one-hot. With a top-p row it sorts as before."""
    from dflash_sglang.core.step.accept import HostHints

    torch.manual_seed(1)
    bs, n, V = 40, 3, 97
    logits = torch.randn(bs, n, V).round(decimals=1)  # coarse values: ties at the k-th logit happen
    params, t, k, p = _mixed_params(bs, top_p_rows)
    hinted = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p, HostHints.of(t, k, p))
    assert hinted.hints.top_p == top_p_rows and hinted.hints.top_k == 40 and hinted.hints.sampled.numel() == 26
    general, fast = target_probs(logits, params), target_probs(logits, hinted)
    # the general path's top-p = 1 test drops tail tokens whose preceding mass rounds to 1: equal up to that
    torch.testing.assert_close(fast, general, atol=1e-6, rtol=0)
    assert torch.equal(fast > 1e-6, general > 1e-6)
    if top_p_rows:
        assert torch.equal(fast, general)
    only = target_probs(logits[hinted.hints.sampled], hinted.sampling_rows())  # every row samples: no one-hot
    torch.testing.assert_close(only, general[hinted.hints.sampled], atol=1e-6, rtol=0)


@pytest.mark.parametrize("with_q", [False, True])
def test_mixed_batch_accept_verifies_greedy_rows_greedily_with_the_same_result(with_q):
    """core's chain accept with host hints (greedy rows by greedy acceptance, the sampling rows alone by rejection
    sampling) commits exactly what rejection sampling every row (greedy rows one-hot) commits, uniform for uniform."""
    from dflash_sglang.core.speculate import Proposal, accept
    from dflash_sglang.core.step.accept import HostHints

    torch.manual_seed(2)
    bs, T, V = 60, 5, 50
    logits = torch.randn(bs, T, V) * 3
    argmax = logits.argmax(-1)
    draft = torch.where(torch.rand(bs, T - 1) < 0.6, argmax[:, :-1], torch.randint(0, V, (bs, T - 1)))
    ids = torch.cat([torch.randint(0, V, (bs, 1)), draft], 1)
    q = None
    if with_q:  # a sampled proposal over 4 candidates per position, the draft among them
        cand = torch.stack([draft, (draft + 1) % V, (draft + 2) % V, (draft + 3) % V], -1)
        q = DraftQ(cand, torch.softmax(torch.randn(bs, T - 1, 4), -1))
    proposal = Proposal(ids, torch.arange(T).expand(bs, T), None, q)
    params, t, k, p = _mixed_params(bs, top_p_rows=True)
    hinted = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p, HostHints.of(t, k, p))
    general = accept(proposal, logits, params, torch.Generator().manual_seed(5))
    fast = accept(proposal, logits, hinted, torch.Generator().manual_seed(5))
    assert torch.equal(fast.accept_len, general.accept_len) and torch.equal(fast.out_tokens, general.out_tokens)
    assert torch.equal(fast.bonus, general.bonus)
    greedy = torch.tensor(t) == 0
    assert torch.equal(fast.accept_len[greedy], greedy_accept(draft, argmax).accept_len[greedy])
    assert len(set(fast.accept_len.tolist())) > 2  # rows accept different lengths: the merge is exercised
