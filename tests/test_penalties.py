"""Penalties at every verify row (core/step/penalties.py): the reference decoder with frequency / presence / repetition
penalties and min_new_tokens is token-identical to plain decoding under greedy, in chains, trees, adaptive shapes and
the goodput controller, and samples the target's exact penalized distribution. The oracle below is written from
SGLang's penaltylib one request and one token at a time, with no batching or verify-row logic."""
import itertools

import pytest
import torch

from dflash_sglang.core.reference import ReferenceDecoder
from dflash_sglang.core.shape.adaptive import AdaptivePolicy, SpecShape
from dflash_sglang.core.shape.goodput import GoodputConfig, GoodputController
from dflash_sglang.core.step.penalties import OutputPenalties, Penalties, apply_penalties
from factories import STEP_COST, draft_config_for, mixed_prompts, sampled_fit_pvalue, tiny_drafter, tiny_target

# (frequency, presence, repetition, min_new_tokens) per request of a batch: every kind alone, all together, none
SETTINGS = [(0.6, 0.0, 1.0, 0), (0.0, 0.9, 1.0, 0), (0.0, 0.0, 1.7, 0), (0.4, 0.3, 1.3, 6), (0.0, 0.0, 1.0, 0),
            (0.0, 0.0, 1.0, 9)]
SHAPES = [dict(block=16), dict(block=16, tree=SpecShape(12, 3)),
          dict(block=16, policy=AdaptivePolicy.parse("2:8x2,inf:5x1")), dict(block=16, goodput=True)]


def oracle_penalize(logits: torch.Tensor, output: list[int], setting, stops) -> torch.Tensor:
    """One request's next-token logits [V] after its output so far, as SGLang's penalizers make them."""
    freq_p, pres_p, rep_p, min_new = setting
    vocab = logits.shape[0]
    freq, pres, rep = torch.zeros(vocab), torch.zeros(vocab), torch.ones(vocab)
    for t in output:  # one occurrence at a time, float32, as the penalizers accumulate them step by step
        freq[t] += torch.tensor(freq_p, dtype=torch.float32)
        pres[t], rep[t] = pres_p, rep_p
    add = torch.zeros(vocab) - freq - pres  # SGLang's overlap scheduler: the additive ones summed, added, then scaled
    if len(output) < min_new:
        add[list(stops)] = float("-inf")
    out = logits + add
    return torch.where(out < 0, out * rep, out / rep)


def oracle_greedy(target, prompt, n, setting, stops):
    output = []
    for _ in range(n):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + output])).logits[0, -1].float()
        output.append(int(oracle_penalize(logits, output, setting, stops).argmax()))
    return output


def batch_penalties(settings, stops) -> Penalties:
    return Penalties.stack([Penalties.full(1, f, p, r, m, stop_ids=tuple(stops)) for f, p, r, m in settings])


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama", vocab=8, seed=2)
    return target, tiny_drafter(draft_config_for(target, block_size=16), seed=2)


@pytest.mark.parametrize("spec", SHAPES, ids=str)
def test_greedy_with_penalties_matches_plain_decoding(pair, spec):
    target, drafter = pair
    prompts = mixed_prompts(8, lengths=(3, 9, 1, 14, 6, 4))
    dec = ReferenceDecoder(target, drafter)
    plain = dec.plain_generate(prompts, 20)
    # a stop token plain decoding emits early for request 3 (min_new_tokens 6 holds it back; no request ends on it, so
    # every output is 20 tokens long)
    stops = (plain[3][2],)
    pen = batch_penalties(SETTINGS, stops)
    ctrl = GoodputController(GoodputConfig(max_nodes=16)) if spec.get("goodput") else None
    outs = dec.generate(prompts, max_new_tokens=20, block_size=spec["block"], tree=spec.get("tree"),
                        policy=spec.get("policy"), controller=ctrl, penalties=pen, step_cost=STEP_COST)
    expected = [oracle_greedy(target, p, 20, s, stops) for p, s in zip(prompts, SETTINGS)]
    assert [o.tokens for o in outs] == expected
    assert dec.plain_generate(prompts, 20, penalties=pen) == expected
    # the penalties change the output (else this tests nothing): every penalized request differs from plain's
    unpenalized = plain
    assert all(e != u for e, u, s in zip(expected, unpenalized, SETTINGS) if s != (0.0, 0.0, 1.0, 0)), expected
    assert expected[4] == unpenalized[4]  # and leave the request without any alone
    assert stops[0] in unpenalized[3][:6] and stops[0] not in expected[3][:6]  # min_new_tokens held EOS back
    steps = [a for o in outs for a in o.accept_lengths]
    assert max(steps) >= 3, steps  # drafts were accepted under the penalties, so the verify rows were penalized


def test_verify_rows_hold_the_state_along_each_path():
    """A tree's row sees its own ancestors' tokens, not its siblings'; row 0 sees the committed output only."""
    pen = Penalties.full(1, frequency=1.0, presence=0.5, repetition=2.0)
    state = OutputPenalties.empty(1, 6)
    state.extend(pen, torch.tensor([[3, 3, 1]]), torch.tensor([3]))  # output so far: 3, 3, 1
    ids = torch.tensor([[1, 2, 4, 2]])  # root 1 (the newest output token), children 2 and 4, then 2 under 4
    parent = torch.tensor([[-1, 0, 0, 2]])
    rows = state.along_paths(pen, ids, parent)
    assert rows.frequency[0, :, 2].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert rows.frequency[0, :, 4].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert rows.frequency[0, :, 3].tolist() == [2.0] * 4 and rows.length[0].tolist() == [3, 4, 4, 5]
    logits = torch.tensor([[[1.0, -1.0, 2.0, 4.0, -2.0, 0.5]] * 4])
    apply_penalties(logits, rows, pen)
    # token 3: (4 - 2 - 0.5) / 2; token 2 at row 1: (2 - 1 - 0.5) / 2; token 4 at row 3: (-2 - 1.5) * 2
    assert logits[0, 0, 3] == 0.75 and logits[0, 1, 2] == 0.25 and logits[0, 3, 4] == -7.0 and logits[0, 0, 2] == 2


def test_a_row_constant_penalty_as_the_builtin_applies_it_changes_greedy_output(pair, monkeypatch):
    """SGLang's builtin DFLASH verify adds the penalty computed before the block to every verify row
    (`apply_dflash_verify_logits_adjustments`): a row deep in a block then ignores the drafts before it. Emulated here
    (every row gets the root's state), a token drafted early and repeated later in the same block is accepted where
    plain decoding would have penalized it: the greedy output differs from plain's; ours (per-row state) does not."""
    target, drafter = pair
    prompts = mixed_prompts(8, lengths=(3, 9, 1, 14, 6, 4))
    settings = [(0.8, 0.4, 1.0, 0)] * len(prompts)  # additive penalties only (the builtin drops the repetition one)
    pen = batch_penalties(settings, ())
    expected = [oracle_greedy(target, p, 20, s, ()) for p, s in zip(prompts, settings)]
    dec = ReferenceDecoder(target, drafter)
    assert [o.tokens for o in dec.generate(prompts, 20, block_size=16, penalties=pen)] == expected

    def root_state_everywhere(self, penalties, ids, parent):
        t = ids.shape[1]
        return OutputPenalties(*(x.unsqueeze(1).repeat(1, t, *([1] * (x.dim() - 1)))
                                 for x in (self.frequency, self.presence, self.repetition, self.length)))

    monkeypatch.setattr(OutputPenalties, "along_paths", root_state_everywhere)
    approx = [o.tokens for o in ReferenceDecoder(target, drafter).generate(prompts, 20, block_size=16, penalties=pen)]
    assert approx != expected


def _exact_penalized_joint(target, prompt, n, vocab, setting, stops):
    """Exact probability of every n-token continuation at temperature 1 under the oracle's penalties."""
    probs = {}
    for seq in itertools.product(range(vocab), repeat=n):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + list(seq)])).logits[0].float()
        p = 1.0
        for i, t in enumerate(seq):
            row = oracle_penalize(logits[len(prompt) - 1 + i], list(seq[:i]), setting, stops)
            p *= float(torch.softmax(row.double(), -1)[t])
        probs[seq] = p
    return probs


@pytest.mark.parametrize("tree", [None, SpecShape(7, 3)], ids=["chain", "tree"])
def test_sampling_with_penalties_matches_the_penalized_distribution(tree):
    vocab, n_new, n_samples = 5, 3, 12000
    target = tiny_target("llama", vocab=vocab, seed=4)
    drafter = tiny_drafter(draft_config_for(target, block_size=4), seed=5)
    prompt, setting, stops = [1, 3, 2], (0.8, 0.4, 1.6, 2), (0,)
    exact = _exact_penalized_joint(target, prompt, n_new, vocab, setting, stops)
    dec = ReferenceDecoder(target, drafter)
    prompts = [prompt] * n_samples + [[2] * 7, [4]]  # unpenalized companions of other lengths
    pen = batch_penalties([setting] * n_samples + [(0.0, 0.0, 1.0, 0)] * 2, stops)
    outs = dec.generate(prompts, max_new_tokens=n_new, block_size=4, temperature=1.0, seed=11, tree=tree,
                        penalties=pen)[:n_samples]
    assert max(a for o in outs for a in o.accept_lengths) >= 2  # drafts accepted: penalized verify rows at work
    # min_new_tokens: no EOS in the first 2 tokens (probability 0, never sampled)
    assert sampled_fit_pvalue([tuple(o.tokens) for o in outs], exact) > 1e-3
