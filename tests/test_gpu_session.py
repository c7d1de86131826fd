"""The GPU session's driver without a GPU or an Engine: the budget and skip logic (a fake clock), the session files
written after every stage, the carried folder's size refusal and trims, the throughput stage's simulated acceptance
and probe parsing, and the `sglang` extra against the adapter's admitted releases. The stages themselves run in the
CPU rehearsal (`bash scripts/gpu_session.sh --device cpu`, a step of .ci/run)."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import tomllib
import zipfile
from pathlib import Path

import pytest

from dflash_sglang.bench import gpu_wheels
from dflash_sglang.bench.gpu_probe import width_uses
from dflash_sglang.bench.gpu_context import Budget, Context, Stage, Table
from dflash_sglang.bench.gpu_session import Session, exit_code
from dflash_sglang.bench.gpu_stages import STAGES, select
from dflash_sglang.bench.gpu_throughput import BLOCK, arms, rate_for_tau

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _stage(number, cost_s, min_s, clock, seen, verdict="pass", devices=("cpu",), fail=False):
    def run(ctx: Context) -> Table:
        seen.append((number, ctx.reserve_s, (ctx.out / "session.json").is_file()))
        if fail:
            raise RuntimeError("broken stage")
        clock.t += cost_s
        table = Table(f"stage {number}", ["what", "verdict"])
        table.add(what="x", verdict=verdict)
        return table

    return Stage(number, f"s{number}", f"stage {number}", "decides", run, {d: min_s for d in devices},
                 {d: cost_s for d in devices})


def _session(tmp_path, stages, budget_s, clock):
    ctx = Context("cpu", tmp_path / "out", tmp_path / "work", Budget(budget_s, clock))
    return Session(stages, ctx), ctx


def test_stages_run_in_order_and_skip_what_the_budget_cannot_finish(tmp_path):
    clock, seen = Clock(), []
    stages = [_stage(1, 100, 50, clock, seen), _stage(2, 200, 150, clock, seen), _stage(3, 10, 60, clock, seen),
              _stage(4, 10, 10, clock, seen)]
    results, ctx = _session(tmp_path, stages, 330, clock)
    out = results.run()
    # 1 runs (100 s), 2 runs (200 s: 30 s left), 3 needs 60: skipped, 4 needs 10: runs
    assert [r.status for r in out] == ["passed", "passed", "skipped", "passed"]
    assert "skipped: budget (needs ~60 s, 30 s left)" == out[2].reason
    # each stage learns what the later stages need at least; the session files exist from the first stage's end on
    assert seen == [(1, 220.0, False), (2, 70.0, True), (4, 0.0, True)]
    assert exit_code(out) == 0


def test_a_cuda_only_stage_is_skipped_on_cpu_and_a_broken_one_costs_nothing_after_it(tmp_path):
    clock, seen = Clock(), []
    stages = [_stage(1, 5, 5, clock, seen, devices=("cuda",)), _stage(2, 5, 5, clock, seen, fail=True),
              _stage(3, 5, 5, clock, seen, verdict="FAIL: differs")]
    session, ctx = _session(tmp_path, stages, 100, clock)
    out = session.run()
    assert [(r.status, r.reason) for r in out] == [("skipped", "skipped: needs a GPU"),
                                                   ("error", "RuntimeError: broken stage"), ("failed", "")]
    assert (ctx.work / "stage2_error.log").read_text().endswith("RuntimeError: broken stage\n")
    assert exit_code(out) == 1


def test_session_files_hold_every_stage_table(tmp_path):
    clock, seen = Clock(), []
    session, ctx = _session(tmp_path, [_stage(1, 5, 5, clock, seen), _stage(2, 5, 500, clock, seen)], 100, clock)
    session.run()
    md = (ctx.out / "session.md").read_text()
    assert "| 1 s1 | passed | 0 | 5 |  |" in md and "| 2 s2 | skipped | 0 | 500 | skipped: budget" in md
    assert "### stage 1\n\n| what | verdict |\n|---|---|\n| x | pass |" in md
    data = json.loads((ctx.out / "session.json").read_text())
    assert [s["status"] for s in data["stages"]] == ["passed", "skipped"]
    assert data["stages"][0]["table"]["rows"] == [{"what": "x", "verdict": "pass"}]
    assert sorted(p.name for p in ctx.out.iterdir()) == ["logs.tar.gz", "session.json", "session.md"]  # <= 8 files


def test_table_status_and_cells():
    t = Table("t", ["a", "b", "verdict"])
    assert t.status() == "empty"
    t.add(a=1.23456, b=None, verdict="pass")
    assert t.status() == "passed" and "| 1.23 | - | pass |" in t.markdown()
    t.add(a="x|y", verdict="skipped: budget")
    assert t.status() == "partial" and "| x/y |" in t.markdown()
    t.add(verdict="FAIL: no")
    assert t.status() == "failed"


def test_budget_reserve_and_stage_selection():
    clock = Clock()
    b = Budget(100, clock)
    clock.t = 40
    assert b.fits(60) and not b.fits(60, 1) and b.left() == 60
    assert b.skip_reason(50, 20) == "skipped: budget (needs ~50 s + 20 s kept for later stages, 60 s left)"
    assert [s.number for s in select("4,1")] == [4, 1]
    with pytest.raises(SystemExit, match="expected numbers among"):
        select("6")
    assert [s.number for s in STAGES] == [1, 2, 3, 4, 5] and all(s.min_s.get("cuda") for s in STAGES)
    assert "cpu" not in STAGES[0].min_s  # the kernels need a GPU


# ---------------------------------------------------------------------------------------------- the carried wheels
def test_the_size_refusal_names_the_limit_and_how_to_prepare(tmp_path):
    assert gpu_wheels.size_refusal(40 * MIB, 20 * MIB) is None
    over = gpu_wheels.size_refusal(61 * MIB, 0)
    assert "61.0 MiB, over the 60 MiB" in over and "gpu_session.sh --prepare" in over
    assert "over the 64 MiB one device call carries" in gpu_wheels.size_refusal(50 * MIB, 15 * MIB)
    assert "bash scripts/gpu_session.sh --prepare" in gpu_wheels.check(tmp_path / "none")
    for pin in gpu_wheels.PINNED:  # one small wheel per pin: accepted beside a small tree
        (tmp_path / f"{pin.name.replace('-', '_')}-{pin.version}-py3-none-any.whl").write_bytes(b"x")
    assert gpu_wheels.check(tmp_path, tree=MIB) is None
    (tmp_path / "big.bin").write_bytes(b"\0" * (61 * MIB))
    assert "over the 60 MiB" in gpu_wheels.check(tmp_path, tree=MIB)
    (tmp_path / "big.bin").unlink()
    (tmp_path / "sglang-0.5.17-py3-none-any.whl").unlink()
    assert "lacks sglang" in gpu_wheels.check(tmp_path, tree=MIB)


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("pkg-1.0.dist-info/RECORD", "stale\n")
    return path


def test_repack_drops_trimmed_members_patches_and_records_what_is_left(tmp_path):
    source = b'AutoConfig.register("qwen3_asr", Qwen3ASRConfig)\nCONFIG_MAPPING.register(k, v, exist_ok=True)\n'
    wheel = _wheel(tmp_path / "sglang-0.5.17-cp312-cp312-manylinux_2_34_x86_64.whl", {
        "sglang/srt/configs/qwen3_asr.py": source, "sglang/srt/grpc/_core.cpython-312-x86_64-linux-gnu.so": b"so",
        "sglang/a,b.json": b"{}"})
    gpu_wheels.repack(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert "sglang/srt/grpc/_core.cpython-312-x86_64-linux-gnu.so" not in names
        assert all(i.compress_type == zipfile.ZIP_LZMA for i in z.infolist())
        patched = z.read("sglang/srt/configs/qwen3_asr.py").decode()
        assert 'register("qwen3_asr", Qwen3ASRConfig, exist_ok=True)' in patched
        assert "exist_ok=True, exist" not in patched
        rows = list(csv.reader(io.StringIO(z.read("pkg-1.0.dist-info/RECORD").decode())))
        for name, digest, size in rows[:-1]:  # every member's hash and size, names with commas quoted
            data = z.read(name)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)
        assert {r[0] for r in rows} == names


def test_the_plugin_entry_point_registered_beside_the_wheels(tmp_path):
    info = gpu_wheels.register_plugin(tmp_path)
    points = (info / "entry_points.txt").read_text()
    assert "[sglang.srt.plugins]\ndflash_sglang = dflash_sglang.adapter.boot.plugin:register" in points


def test_pins_name_one_version_each_and_the_install_is_offline(tmp_path):
    names = [p.name for p in gpu_wheels.PINNED]
    assert len(names) == len(set(names)) and "sglang" in names and "transformers" not in names  # (the image's 5.17)
    cmd = gpu_wheels.install_command(tmp_path, Path("/tmp/site"))
    assert "--no-index" in cmd and "--no-deps" in cmd
    down = gpu_wheels.download_command(gpu_wheels.PINNED[0], tmp_path)
    assert down[-1] == "sglang==0.5.17" and "--only-binary=:all:" in down and "3.12" in down


# ---------------------------------------------------------------------------------------------- throughput stage
@pytest.mark.parametrize("tau", [1.0, 2.0, 4.0, 6.0, 15.5])
def test_the_rate_commits_tau_on_average(tau):
    p = rate_for_tau(tau)
    assert sum(p**k for k in range(BLOCK)) == pytest.approx(tau, abs=1e-9)


def test_arms_give_both_implementations_the_same_tau():
    a = arms(4.0, "cuda")
    assert a["builtin"][1] == {"DFLASH_SGLANG_IMPL": "builtin", "SGLANG_SIMULATE_ACC_LEN": "4.0",
                               "SGLANG_SIMULATE_ACC_METHOD": "match-expected"}
    assert a["ours_chain"][0]["speculative_num_draft_tokens"] == BLOCK
    assert "speculative_num_draft_tokens" not in a["ours_controller"][0]  # the controller: no shape flag
    assert float(a["ours_chain"][1]["DFLASH_SIMULATE_ACC_RATE"]) == pytest.approx(rate_for_tau(4.0), abs=1e-6)
    assert "builtin" not in arms(4.0, "cpu")


def test_probe_lines_give_each_widths_use():
    log = "\n".join(["DFLASH verify probe: width=4 bs=8 tree=0 graphed=0 t=1.000",
                     "DFLASH verify probe: width=4 bs=8 tree=0 graphed=0 t=1.010",
                     "DFLASH verify probe: width=16 bs=8 tree=0 graphed=1 t=1.030",
                     "unrelated", "DFLASH verify probe: width=4 bs=8 tree=0 graphed=1 t=5.000"])
    uses = {u.width: u for u in width_uses(log)}
    assert (uses[4].steps, uses[4].graphed_share, uses[4].step_ms) == (3, pytest.approx(1 / 3), 15.0)  # (10 and 20 ms)
    assert (uses[16].steps, uses[16].graphed_share, uses[16].step_ms) == (1, 1.0, None)  # (its next call: 4 s on)


# ---------------------------------------------------------------------------------------------- the sglang extra
def test_the_sglang_extra_admits_exactly_the_supported_releases():
    import ast

    from packaging.requirements import Requirement

    # (read from the source: importing the adapter needs an SGLang in the range installed)
    tree = ast.parse((REPO / "dflash_sglang" / "adapter" / "versions.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SUPPORTED")
    SUPPORTED = eval(compile(ast.Expression(node.value), "versions.py", "eval"))  # noqa: N806

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = extras["sglang"]
    req = Requirement(spec)
    assert req.name == "sglang"
    assert all(req.specifier.contains(v) for v in SUPPORTED), (spec, SUPPORTED)
    lo, hi = SUPPORTED[0].rsplit(".", 1), SUPPORTED[-1].rsplit(".", 1)
    assert not req.specifier.contains(f"{lo[0]}.{int(lo[1]) - 1}") and not req.specifier.contains(
        f"{hi[0]}.{int(hi[1]) + 1}")


def test_an_ours_arm_counts_only_with_our_workers_start_line(tmp_path):
    """A plugin that failed to load leaves SGLang's builtin serving DFLASH: its timings must not pass for ours."""
    from dflash_sglang.bench.gpu_throughput import ours_started

    log = tmp_path / "arm.log"
    log.write_text("Failed to execute general plugin: dflash_sglang\n")
    assert not ours_started("ours_chain@2", log) and ours_started("none", log) and ours_started("builtin@2", log)
    log.write_text("[x] dflash_sglang.adapter.step.worker INFO DFLASH (dflash-sglang): block_size=16, chain of 16\n")
    assert ours_started("ours_controller@4", log)
