"""bench/serving/pd.py (scripts/bench_pd.py): the PD arms' servers and the report. The PD path itself is tested end to
end in tests/test_sglang_e2e.py (`test_pd_disaggregation_over_mooncake_matches_plain`); the timed runs are
benchmarks."""
from __future__ import annotations

from contextlib import ExitStack

import pytest

from dflash_sglang.bench.serving import pd
def test_report_gives_tokens_per_second_acceptance_and_the_ratio_over_the_first_arm():
    whole = pd.ArmResult("whole", seconds=[10.0, 12.0], tokens=[640, 640], steps=[200, 200])
    split = pd.ArmResult("pd", seconds=[20.0, 16.0], tokens=[640, 640], steps=[210, 190], mismatches=1)
    rows = pd.report([whole, split])
    assert rows[0] == {"arm": "whole", "tokens_per_s": pytest.approx(58.7, abs=0.05), "seconds": [10.0, 12.0],
                       "acceptance": 3.2, "mismatches": 0}
    assert rows[1]["tokens_per_s"] == pytest.approx(36.0) and rows[1]["acceptance"] == 3.2
    assert rows[1]["ratio"] == pytest.approx((0.5 + 12 / 16) / 2, abs=1e-3) and rows[1]["mismatches"] == 1
    assert "ratio" not in rows[0]
    assert rows[1]["words"].startswith("same as whole within noise") and "plain" not in rows[1]["words"]


@pytest.mark.parametrize("arm, servers", [("whole", 1), ("plain", 1), ("pd", 3), ("plain-pd", 3)])
def test_each_arm_starts_its_servers_with_the_right_flags(monkeypatch, tmp_path, arm, servers):
    started = []

    class FakeServer:
        def __init__(self, argv, env, log, startup_timeout=900.0, python=None, module="sglang.launch_server"):
            self.argv, self.env, self.module, self.url = argv, env, module, f"http://x/{len(started)}"
            started.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def start(self):
            pass

        def wait_ready(self):
            return self

        def stop(self):
            pass

    monkeypatch.setattr(pd, "Server", FakeServer)
    monkeypatch.setattr(pd, "await_router_workers", lambda url, params: None)
    args = pd.build_parser().parse_args(["--target", "T", "--draft", "D", "--out", str(tmp_path)])
    with ExitStack() as stack:
        url = pd.launch(stack, args, arm, 0)
    assert len(started) == servers and url == started[-1].url
    spec = [s for s in started if "--speculative-algorithm" in s.argv]
    assert len(spec) == (0 if arm.startswith("plain") else servers - (servers > 1))  # (the router runs no model)
    if servers > 1:
        prefill, decode, router = started
        assert prefill.argv[prefill.argv.index("--disaggregation-mode") + 1] == "prefill"
        assert decode.argv[decode.argv.index("--disaggregation-mode") + 1] == "decode"
        assert router.module == pd.ROUTER and "--pd-disaggregation" in router.argv
        assert prefill.env["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] == "1"


def test_unknown_arms_are_refused():
    with pytest.raises(SystemExit, match="--arms"):
        pd.main(["--arms", "whole,bogus"])
