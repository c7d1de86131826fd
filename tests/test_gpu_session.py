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
import os
import random
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

from dflash_sglang.bench.gpu import wheels as gpu_wheels
from dflash_sglang.bench.gpu.probe import width_uses
from dflash_sglang.bench.gpu.context import Budget, Context, Stage, Table
from dflash_sglang.bench.gpu.device import git_trap
from dflash_sglang.bench.gpu.session import Session, exit_code
from dflash_sglang.bench.gpu.stages import STAGES, select
from dflash_sglang.bench.gpu.throughput import BLOCK, arms, rate_for_tau

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
    assert "| 1 s1 | passed | 0 | 5 | nothing compiled |  |" in md
    assert "| 2 s2 | skipped | 0 | 500 | - | skipped: budget" in md
    assert "**verdict: not run in full: stages 2 s2**" in md
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
    assert [s.number for s in STAGES] == [0, 1, 2, 3, 4, 5] and all(s.min_s.get("cuda") for s in STAGES)
    assert "cpu" not in STAGES[1].min_s  # the kernels need a GPU


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
    from dflash_sglang.bench.gpu.throughput import ours_started

    log = tmp_path / "arm.log"
    log.write_text("Failed to execute general plugin: dflash_sglang\n")
    assert not ours_started("ours_chain@2", log) and ours_started("none", log) and ours_started("builtin@2", log)
    log.write_text("[x] dflash_sglang.adapter.step.worker INFO DFLASH (dflash-sglang): block_size=16, chain of 16\n")
    assert ours_started("ours_controller@4", log)


# ---------------------------------------------------------------------------------------------- the device path
def test_the_device_checks_the_folder_from_its_record_without_git(tmp_path, monkeypatch):
    folder = tmp_path / "whl"
    wheels = gpu_wheels.standin(folder)  # (here, where git is: it records the tree)
    assert len(wheels) == len(gpu_wheels.PINNED) and gpu_wheels.recorded_tree(folder) > 0
    trap = tmp_path / "trap"  # a `git` first on PATH that fails and leaves a mark: the device gets no promise of git
    monkeypatch.setenv("PATH", git_trap(trap)["PATH"])
    assert gpu_wheels.check(folder) is None  # the device's check: the recorded size
    assert not (trap / "called").exists()
    (folder / gpu_wheels.RECORD).unlink()
    assert "prepared.json does not say how large the working tree is" in gpu_wheels.check(folder)
    assert not (trap / "called").exists()
    with pytest.raises(subprocess.CalledProcessError):  # the trap has teeth: what measures the tree asks git
        gpu_wheels.tree_bytes()
    assert (trap / "called").read_text().startswith("git -C")


def test_stand_in_wheels_install_as_the_device_installs_the_real_ones(tmp_path):
    folder, site = tmp_path / "whl", tmp_path / "site"
    gpu_wheels.standin(folder)
    assert gpu_wheels.install(folder, site) == len(gpu_wheels.PINNED)
    infos = {p.name for p in site.glob("*.dist-info")}
    assert "sglang-0.5.17.dist-info" in infos and any(n.startswith("dflash_sglang-") for n in infos)
    assert not [p for p in site.iterdir() if not p.name.endswith(".dist-info")]  # metadata only: no module shadowed


def _prelude_ctx(tmp_path, wheels=None) -> Context:
    ctx = Context("cpu", tmp_path / "out", tmp_path / "work", Budget(100, Clock()), wheels=wheels,
                  site=tmp_path / "site")
    ctx.work.mkdir(parents=True)
    return ctx


def test_stage_0_fails_on_a_refused_folder_and_a_broken_import_chain(tmp_path, monkeypatch):
    from dflash_sglang.bench.gpu import prelude as gpu_prelude
    folder = tmp_path / "whl"
    gpu_wheels.standin(folder)
    (folder / gpu_wheels.RECORD).unlink()  # a folder not made by --prepare
    ctx = _prelude_ctx(tmp_path, folder)
    assert gpu_prelude.install_row(ctx, 60)["verdict"] == "FAIL: the wheel folder was refused"
    monkeypatch.setitem(gpu_prelude.IMPORTS, "cpu", ("no_such_module_dflash",))
    row = gpu_prelude.imports_row(ctx, 60)
    assert row["verdict"] == "FAIL: the import chain exited 1 (imports.log)" and "no_such_module_dflash" in row["note"]
    monkeypatch.setattr(gpu_prelude, "_run", lambda *a, **k: (3, "plugins []"))  # SGLang up, our plugin not found
    assert gpu_prelude.imports_row(ctx, 60)["verdict"].startswith("FAIL: our plugin's entry point is not among")
    table = gpu_prelude.stage_prelude(_prelude_ctx(tmp_path / "again", folder))
    assert table.status() == "failed"


def test_gpu_session_sh_rehearses_the_install_path_from_a_tree_without_git(tmp_path):
    """The script as the device runs it: a copy of the tree with no .git, a `git` that fails, stand-in wheels carried
    in .whl; stage 0 alone (`--install`) installs them and checks the import chain (CPU: SGLang beside the shims)."""
    export = tmp_path / "tree"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (export / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, export / rel)
    gpu_wheels.standin(export / ".whl")
    trap = tmp_path / "trap"
    out = tmp_path / "out"
    env = git_trap(trap)
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "--device", "cpu", "--install", "--wheels", ".whl",
                           "--site", str(tmp_path / "site"), "--out", str(out), "--work", str(tmp_path / "work")],
                          cwd=export, env=env, capture_output=True, text=True, timeout=300)
    assert not (trap / "called").exists(), (trap / "called").read_text()
    session = json.loads((out / "session.json").read_text())
    (stage,) = session["stages"]
    assert stage["key"] == "install" and stage["status"] == "passed", (stage, proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    assert [r["what"] for r in stage["table"]["rows"]] == ["started", "install", "imports"]
    assert "sglang " in stage["table"]["rows"][2]["note"]  # the versions the import chain found
    assert (tmp_path / "site" / "sglang-0.5.17.dist-info").is_dir()


# ---------------------------------------------------------------------------------------------- verdicts from figures
def test_a_session_never_reads_passed_over_a_failure_or_a_skip():
    from dflash_sglang.bench.gpu.context import StageResult
    from dflash_sglang.bench.gpu.session import verdict_line

    ok = StageResult(1, "kernels", "t", "passed", 1, 1)
    assert verdict_line([ok]) == "**verdict: passed**"
    assert "FAILED** (stages 2 identity)" in verdict_line([ok, StageResult(2, "identity", "t", "failed", 1, 1)])
    assert "FAILED" in verdict_line([ok, StageResult(0, "install", "t", "error", 1, 1)])
    assert "slower than the builtin in stages 3 throughput" in verdict_line([StageResult(3, "throughput", "t",
                                                                                          "slower", 1, 1)])
    assert "not run in full: stages 4 experimental" in verdict_line([ok, StageResult(4, "experimental", "t",
                                                                                      "skipped", 0, 1)])
    t = Table("t", ["verdict"])
    t.add(verdict="slower: 0.61x builtin")
    assert t.status() == "slower"
    t.add(note="a row a stage forgot to judge")
    assert t.status() == "failed"


def test_a_cells_timeout_keeps_the_later_stages_reserve():
    clock = Clock()
    b = Budget(300, clock)
    assert b.timeout(60, 100) == 200  # what is left beyond the reserve
    clock.t = 250
    assert b.timeout(30, 100) == 30  # its own estimate when the reserve would leave less
    assert b.timeout(80, 100) == 50  # never more than is left
    clock.t = 299
    assert b.timeout(5) == 10.0


def test_optional_stages_get_no_reserve(tmp_path):
    clock, seen = Clock(), []
    optional = _stage(3, 10, 400, clock, seen)
    stages = [_stage(1, 10, 10, clock, seen), _stage(2, 10, 10, clock, seen),
              Stage(**{**optional.__dict__, "optional": True})]
    session, _ = _session(tmp_path, stages, 100, clock)
    out = session.run()
    assert [s[1] for s in seen] == [10.0, 0.0]  # stage 1 keeps stage 2's minimum, nothing for the optional stage 3
    assert out[2].status == "skipped"


def _junit(tmp_path: Path, cases: list[str]) -> Path:
    xml = tmp_path / "r.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest">' + "".join(cases)
                   + "</testsuite></testsuites>")
    return xml


def _case(name: str, inner: str = "") -> str:
    return f'<testcase classname="tests.test_ops_gpu" name="{name}" time="0.1">{inner}</testcase>'


def test_stage_1_passes_only_on_gpu_cases_that_ran(tmp_path):
    from dflash_sglang.bench.gpu.stages import GPU_LACKS, junit_cases, kernel_verdict, ran_by_test

    ran = [_case("test_block[1-2]"), _case("test_block[99-7]"), _case("test_tree[1]")]
    cases = junit_cases(_junit(tmp_path, ran))
    assert kernel_verdict(cases, 0) == "pass" and ran_by_test(cases) == "test_block x2, test_tree x1"
    lacking = _case("test_fp8[e4m3]", f'<skipped message="{GPU_LACKS} fp8 (sm80)"/>')
    assert kernel_verdict(junit_cases(_junit(tmp_path, ran + [lacking])), 0) == "pass"
    all_skipped = [_case(f"test_block[{i}]", '<skipped message="needs a CUDA GPU and flashinfer"/>') for i in range(3)]
    verdict = kernel_verdict(junit_cases(_junit(tmp_path, all_skipped)), 0)
    assert verdict.startswith("FAIL: 3 GPU cases skipped for no missing GPU feature") and "flashinfer" in verdict
    assert kernel_verdict(junit_cases(_junit(tmp_path, ran + all_skipped[:1])), 0).startswith("FAIL: 1 GPU cases")
    assert kernel_verdict(junit_cases(_junit(tmp_path, [lacking])), 0) == "FAIL: every GPU case was skipped"
    failed = _case("test_tree[2]", '<failure message="AssertionError: mismatch">tb</failure>')
    assert kernel_verdict(junit_cases(_junit(tmp_path, ran + [failed])), 1).startswith("FAIL: 1 failed (test_ops_gpu")
    assert kernel_verdict([], 5).startswith("FAIL: no GPU case ran")
    assert kernel_verdict(cases, 3).startswith("FAIL: pytest exited 3")
    assert kernel_verdict(cases, "timeout").startswith("FAIL")


def test_every_kernel_file_has_gpu_cases_and_only_they_are_selected():
    from dflash_sglang.bench.gpu.stages import KERNEL_TESTS

    for _, path, _ in KERNEL_TESTS:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p",
                              "no:cacheprovider", path], cwd=REPO, capture_output=True, text=True, timeout=300)
        ids = [line for line in out.stdout.splitlines() if "::" in line]
        assert ids and " deselected" in out.stdout or "test_ops_gpu" in path, (path, out.stdout[-2000:])
        assert not any("host_sync" in i for i in ids)  # CPU (meta-tensor) tests beside them stay out


def test_stage_2_fails_on_differing_greedy_or_sampled_figures(tmp_path):
    from dflash_sglang.bench.gpu.identity import judge, two_sample_pvalue
    from dflash_sglang.bench.gpu.targets import tests_importable

    tests_importable()
    import test_sglang_e2e as e2e

    rng = random.Random(0)
    n = len(e2e.greedy_prompts())
    greedy = [{"ids": [rng.randrange(8) for _ in range(e2e.GREEDY_NEW)],
               "meta": {"completion_tokens": e2e.GREEDY_NEW, "spec_verify_ct": e2e.GREEDY_NEW // 3}}
              for _ in range(n)]

    def draws(weights, count, seed):
        r = random.Random(seed)
        return [list(r.choices([(1, 2, 3), (2, 2, 2), (3, 1, 0), (4, 4, 4)], weights)[0]) for _ in range(count)]

    key = e2e.SAMPLED[0][0]
    plain = {"greedy": greedy, "timings": {"a": 1.0}, f"sampled_{key}": draws([4, 3, 2, 1], 1000, 1)}
    same = {**plain, f"sampled_{key}": draws([4, 3, 2, 1], 1000, 2)}
    cuda = Context("cuda", tmp_path, tmp_path, Budget(100, Clock()))
    assert judge(cuda, same, plain, tmp_path)["verdict"] == "pass"
    shifted = {**plain, f"sampled_{key}": draws([4, 3, 1, 2], 1000, 2)}  # 10% of the mass moved
    assert two_sample_pvalue(shifted[f"sampled_{key}"], plain[f"sampled_{key}"]) < 1e-4
    assert "differs from plain's samples" in judge(cuda, shifted, plain, tmp_path)["verdict"]
    wrong = [dict(g, ids=[(t + 1) % 8 for t in g["ids"]]) for g in greedy]
    cpu = Context("cpu", tmp_path, tmp_path, Budget(100, Clock()))
    verdict = judge(cpu, {"greedy": wrong, "timings": {}}, plain, tmp_path)["verdict"]
    assert verdict == f"FAIL: greedy: {n} requests differ from plain"
    unaccepted = [dict(g, meta={"completion_tokens": e2e.GREEDY_NEW, "spec_verify_ct": e2e.GREEDY_NEW}) for g in greedy]
    assert "no draft was accepted" in judge(cpu, {"greedy": unaccepted, "timings": {}}, plain, tmp_path)["verdict"]


def test_stage_5_fails_on_a_run_that_did_not_train():
    from dflash_sglang.bench.gpu.stages import training_verdict

    assert training_verdict(0, True, [5.0, 4.0, 3.5]) == "pass"
    assert training_verdict(1, True, [5.0]).startswith("FAIL: train exited 1")
    assert training_verdict(0, False, [5.0]).startswith("FAIL: train exited 0 without its summary")
    assert training_verdict(0, True, []) == "FAIL: no optimizer step was logged"
    assert training_verdict(0, True, [5.0, float("nan")]).startswith("FAIL: the loss went non-finite")
    assert training_verdict(0, True, [5.0] * 25).startswith("FAIL: the loss did not fall over 25 steps")


def test_jit_time_is_read_from_ninja_logs_and_new_artefacts(tmp_path):
    from dflash_sglang.bench.gpu.jit import jit_since

    build = tmp_path / "flashinfer" / "mod"
    build.mkdir(parents=True)
    old, new = build / "old.o", build / "new.o"
    old.write_text("")
    os.utime(old, (1000, 1000))
    new.write_text("")
    (build / "mod.so").write_text("")
    (build / ".ninja_log").write_text("# ninja log v5\n0\t2000\t0\told.o\tx\n500\t12500\t0\tnew.o\ty\n")
    use = jit_since(time.time() - 60, [tmp_path])
    assert (use.jobs, use.job_s, use.shared_objects) == (1, 12.0, 1)
    assert "1 compile jobs (12 s of compile-job time)" in use.describe()
    assert jit_since(time.time() + 60, [tmp_path]).describe() == "nothing compiled"


def test_the_plan_puts_the_8b_headline_inside_the_first_call():
    """By the estimates, a first call on CUDA ends within 9 minutes with stage 0, the kernels, the identity stage and
    the throughput stage's must part (the Qwen3-8B-shaped headline at tau 4) planned; the optional stages run on what
    is left."""
    from dflash_sglang.bench.gpu.session import BUDGET_S, plan

    planned = {s.key: spend for s, spend in plan(list(STAGES), BUDGET_S, "cuda")}
    assert sum(v or 0 for v in planned.values()) <= 9 * 60 and BUDGET_S <= 9 * 60
    for key in ("install", "kernels", "identity", "throughput"):
        assert planned[key] is not None and planned[key] >= next(s for s in STAGES if s.key == key).min_s["cuda"]
    cpu = {s.key: spend for s, spend in plan(list(STAGES), 420, "cpu")}
    assert cpu["kernels"] is None and all(cpu[k] is not None for k in ("install", "identity", "throughput"))
