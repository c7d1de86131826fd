"""Simulated acceptance (SGLANG_SIMULATE_ACC_*) of our worker on small tensors: env parsing errors, forced rows."""
from __future__ import annotations

import pytest
import torch
from sglang_support import requires_sglang

pytestmark = requires_sglang


def test_env_parsing_and_errors_name_the_variable():
    from dflash_sglang.adapter.simulate import SimulatedAcceptance as Sim

    assert Sim.from_env({}) is None and Sim.from_env({"SGLANG_SIMULATE_ACC_LEN": "-1"}) is None
    assert Sim.from_env({"SGLANG_SIMULATE_ACC_LEN": "3.5"}) == Sim(3.5, "match-expected", "fixed")
    env = {"SGLANG_SIMULATE_ACC_LEN": "2", "SGLANG_SIMULATE_ACC_METHOD": "multinomial",
           "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token"}
    assert Sim.from_env(env) == Sim(2.0, "multinomial", "real-draft-token")
    for bad, var in (({"SGLANG_SIMULATE_ACC_LEN": "x"}, "SGLANG_SIMULATE_ACC_LEN"),
                     ({**env, "SGLANG_SIMULATE_ACC_METHOD": "uniform"}, "SGLANG_SIMULATE_ACC_METHOD"),
                     ({**env, "SGLANG_SIMULATE_ACC_TOKEN_MODE": "zero"}, "SGLANG_SIMULATE_ACC_TOKEN_MODE")):
        with pytest.raises(ValueError, match=var):
            Sim.from_env(bad)


@pytest.mark.parametrize("mode", ["fixed", "real-draft-token"])
@pytest.mark.parametrize("commit", [1, 3, 5])
def test_forced_rows_commit_exactly_l_tokens(mode, commit):
    from dflash_sglang.adapter.simulate import FIXED_TOKEN_ID, SimulatedAcceptance

    bs, block = 3, 5
    drafts = torch.randint(0, 50, (bs, block - 1))
    argmax = torch.randint(50, 100, (bs, block))
    accept_len, out, bonus = SimulatedAcceptance(2.0, token_mode=mode).force(drafts, argmax, commit)
    assert accept_len.tolist() == [commit - 1] * bs
    assert (out[:, commit:] == -1).all() and (out[:, :commit] >= 0).all()
    assert torch.equal(bonus, out[:, commit - 1])
    if mode == "fixed":
        assert (out[:, :commit] == FIXED_TOKEN_ID).all()
    else:
        assert torch.equal(out[:, : commit - 1], drafts[:, : commit - 1])
        assert torch.equal(bonus, argmax[:, commit - 1])
