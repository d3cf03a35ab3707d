"""Tests for ``torchspan bench``: RATIO parsing, goals, the table, with a fake benchmarks folder."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchspan.cli import main
from torchspan.commands import bench


def write(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


@pytest.fixture()
def fake_benchmarks(tmp_path: Path) -> Path:
    d = tmp_path / "benchmarks"
    d.mkdir()
    write(
        d,
        "pipeline_fake.py",
        """
        import sys
        quick = "--quick" in sys.argv
        print("some log line")
        print(f"RATIO step_time_vs_torchgpipe {0.5 if quick else 0.7} <=0.8 torchgpipe 0.0.7, 2 stages")
        print("RATIO step_time_vs_plain 1.25 <=1.1 plain loop")
        """,
    )
    write(d, "quality_fake.py", "print('RATIO throughput_vs_best_baseline 1.4 >=1.3 greedy fill')\n")
    write(d, "_helper.py", "raise SystemExit('helpers must not run')\n")
    return d


def test_goal_met_and_parse():
    assert bench.goal_met(0.7, "<=0.8") is True
    assert bench.goal_met(0.9, "<=0.8") is False
    assert bench.goal_met(1.3, ">=1.3") is True and bench.goal_met(1.3, ">1.3") is False
    assert bench.goal_met(5.0, "-") is None
    with pytest.raises(ValueError, match="goal='about 1'"):
        bench.goal_met(1.0, "about 1")
    ratios = bench.parse_ratios(
        "noise\nRATIO a 0.5 <=1 anchor words here\n  RATIO b 2 - \nRATIOS are fun? no\n"
    )
    assert [(r.name, r.value, r.goal, r.anchor) for r in ratios][:2] == [
        ("a", 0.5, "<=1", "anchor words here"),
        ("b", 2.0, "-", ""),
    ]
    with pytest.raises(ValueError, match="is not 'RATIO <name>"):
        bench.parse_ratios("RATIO lonely")
    with pytest.raises(ValueError, match="'fast' is not a number"):
        bench.parse_ratios("RATIO x fast <=1")


def test_find_scripts_skips_helpers_and_filters(fake_benchmarks: Path):
    names = [p.name for p in bench.find_scripts(fake_benchmarks)]
    assert names == ["pipeline_fake.py", "quality_fake.py"]
    assert [p.stem for p in bench.find_scripts(fake_benchmarks, ["quality_fake"])] == ["quality_fake"]
    with pytest.raises(ValueError, match="--only nope: no such benchmark"):
        bench.find_scripts(fake_benchmarks, ["nope"])


def test_bench_quick_prints_table(fake_benchmarks: Path, capsys):
    rc = main(["bench", "--quick", "--dir", str(fake_benchmarks)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "step_time_vs_torchgpipe" in out and "0.500" in out  # --quick reached the script
    assert "1.250" in out and "no" in out  # a missed goal is shown as missed
    assert "throughput_vs_best_baseline" in out and "1.400" in out
    assert "machine:" in out and "torch" in out


def test_bench_json_and_failures(tmp_path: Path, capsys):
    d = tmp_path / "benchmarks"
    d.mkdir()
    write(d, "broken.py", "import sys\nprint('RATIO x 1 <=2')\nsys.exit(3)\n")
    write(d, "silent.py", "print('done, but no ratios')\n")
    write(d, "ok.py", "print('RATIO fine 0.9 <=1 anchor')\n")
    rc = main(["bench", "--dir", str(d), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 1
    by = {r["script"]: r for r in data["results"]}
    assert by["broken"]["returncode"] == 3 and not by["broken"]["ok"]
    assert by["silent"]["ratios"] == [] and not by["silent"]["ok"]
    assert by["ok"]["ok"] and by["ok"]["ratios"][0]["met"] is True
    assert data["quick"] is False and data["machine"]


def test_run_benchmarks_with_fake_runner_and_timeout(tmp_path: Path):
    script = write(tmp_path, "slow.py", "")
    seen: list[list[str]] = []

    def fake(cmd, cwd, timeout):
        seen.append(cmd)
        if len(seen) == 1:
            raise subprocess.TimeoutExpired(cmd, timeout)
        return subprocess.CompletedProcess(cmd, 0, stdout="RATIO r 1.0 >=1 a\n", stderr="")

    timed_out, fine = bench.run_benchmarks([script, script], quick=True, timeout=5, runner=fake)
    assert seen[0] == [sys.executable, str(script), "--quick"]
    assert timed_out.returncode == 124 and "timed out after 5 s" in timed_out.tail
    assert fine.ok and fine.ratios[0].met is True


def test_bench_bad_arguments(tmp_path: Path, capsys):
    assert main(["bench", "--dir", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["bench", "--dir", str(tmp_path / "empty")]) == 2
    assert "no benchmark scripts" in capsys.readouterr().err
    assert main(["bench", "--dir", str(tmp_path / "empty"), "--timeout", "0"]) == 2


def test_a_comparison_skipped_for_a_missing_anchor_is_shown(tmp_path: Path, capsys):
    # issue 10: `bench --quick` said nothing when torchgpipe was missing; scripts print SKIP lines, the table
    # shows them
    d = tmp_path / "benchmarks"
    d.mkdir()
    write(
        d,
        "anchorless.py",
        "print('RATIO a/plain 0.9 <=1.1 plain loop')\nprint('SKIP a/torchgpipe torchgpipe is not "
        "installed')\n",
    )
    assert bench.parse_skips("x\nSKIP a/b b is not installed\n") == {"a/b": "b is not installed"}
    assert main(["bench", "--quick", "--dir", str(d)]) == 0
    out = capsys.readouterr().out
    assert "a/torchgpipe" in out and "skipped" in out and "torchgpipe is not installed" in out
    assert main(["bench", "--quick", "--dir", str(d), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["skipped"] == {
        "a/torchgpipe": "torchgpipe is not installed"
    }


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_benchmark_script_takes_quick() -> None:
    # issue 19: five scripts rejected --quick (argparse: unrecognized arguments) and `torchspan bench --quick`
    # exited 1
    missing = [
        p.name
        for p in bench.find_scripts(BENCHMARKS)
        if "add_quick(" not in p.read_text() and '"--quick"' not in p.read_text()
    ]
    assert missing == []


@pytest.mark.slow
def test_bench_quick_runs_every_benchmark_for_real(capsys: pytest.CaptureFixture[str]) -> None:
    """Every script in benchmarks/ in its --quick form, as a new user runs it: exit 0, ratios from each (about
    2 minutes on 2 shared cores)."""
    rc = main(["bench", "--quick", "--json", "--dir", str(BENCHMARKS), "--timeout", "300"])
    data = json.loads(capsys.readouterr().out)
    failed = {r["script"]: f"exit {r['returncode']}: {r['tail']}" for r in data["results"] if not r["ok"]}
    assert failed == {} and rc == 0
    assert [r["script"] for r in data["results"]] == [p.stem for p in bench.find_scripts(BENCHMARKS)]


@pytest.mark.slow
def test_pipeline_ranks_hooks_profiles_nothing_with_zero_profile_steps() -> None:
    # issue 19: --profile-steps 0 died with ZeroDivisionError after the timed rounds
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "pipeline_ranks_hooks.py"),
            "--quick",
            "--skip-hf",
            "--profile-steps",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RATIO pipeline_ranks_hooks/mlp/" in proc.stdout and "profile of (b)" not in proc.stdout


def _benchmark(name: str):  # type: ignore[no-untyped-def]
    """A benchmark script imported as a module (its helpers, not its run)."""
    import importlib

    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))  # after everything else: a script never shadows a module
    return importlib.import_module(name)


def test_pipeline_bench_puts_every_variant_in_every_position() -> None:
    # issue 21: many variants share a round; each must run first, last and in between as often as the others
    dp = _benchmark("distributed_pipeline")
    names = [
        "torchspan gpipe",
        "torchspan 1f1b",
        "torch Schedule1F1B",
        "torch ScheduleGPipe",
        "torch ScheduleZBVZeroBubble",
    ]
    seen: dict[str, set[int]] = {n: set() for n in names}
    for r in range(2 * len(names)):
        order = dp._order(names, r)
        assert sorted(order) == sorted(names)
        for i, n in enumerate(order):
            seen[n].add(i)
    assert all(s == set(range(len(names))) for s in seen.values())


def test_pipeline_bench_virtual_stages_in_torchs_order() -> None:
    # looped schedules hold stages 0,2 | 1,3 on 2 ranks; the V-shaped ones (ZBV, DualPipeV) 0,3 | 1,2
    dp = _benchmark("distributed_pipeline")
    assert [dp._stage_ids("Interleaved1F1B", r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]
    assert [dp._stage_ids("ZBVZeroBubble", r, 2, 2) for r in range(2)] == [[0, 3], [1, 2]]
    assert [dp._stage_ids("1F1B", r, 2, 1) for r in range(2)] == [[0], [1]]
    utils = pytest.importorskip("torch.distributed.pipelining._utils")
    for kind, style in (("InterleavedZeroBubble", "loop"), ("DualPipeV", "v")):
        mapping = utils.generate_rank_to_stage_mapping(2, 4, style=style)
        assert [dp._stage_ids(kind, r, 2, 2) for r in range(2)] == [sorted(mapping[0]), sorted(mapping[1])]


def test_pipeline_bench_report_ratios_best_and_skips() -> None:
    # the printed form: a RATIO per variant against Schedule1F1B (median of per-round ratios), torchspan's
    # best against torch's best among the variants with the same gradients, SKIP lines for what did not run
    dp = _benchmark("distributed_pipeline")
    times = {
        "torchspan gpipe": [1.2, 1.2, 1.2],
        "torchspan 1f1b": [0.8, 0.9, 1.0],
        "torch Schedule1F1B": [1.0, 1.0, 1.0],
        "torch ScheduleInterleaved1F1B": [0.9, 0.9, 0.9],
        "torch ScheduleGPipe": [0.5, 0.5, 0.5],  # fastest, but its gradients differ: not torch's best
    }
    same = {k: (k != "torch ScheduleGPipe", 0.0 if k != "torch ScheduleGPipe" else 1e-2) for k in times}
    lines = dp._report(
        "small",
        dp.SIZES["small"],
        times,
        same,
        ["torch ScheduleDualPipeV: needs more micro-batches"],
        {k: 2 if "Interleaved" in k else 1 for k in times},
    )
    text = "\n".join(lines)
    ratios = {r.name: r for r in bench.parse_ratios(text)}
    assert ratios["pipeline_2ranks/small/torchspan_1f1b_vs_Schedule1F1B"].value == pytest.approx(0.9)
    assert ratios["pipeline_2ranks/small/torchspan_1f1b_vs_Schedule1F1B"].goal == "<=0.9"
    assert ratios["pipeline_2ranks/small/torch_Interleaved1F1B_vs_Schedule1F1B"].goal == "-"
    assert "NOT the same gradients" in ratios["pipeline_2ranks/small/torch_GPipe_vs_Schedule1F1B"].anchor
    assert ratios["pipeline_2ranks/small/best_torchspan_vs_best_torch"].value == pytest.approx(0.9 / 0.9)
    assert (
        "torchspan 1f1b vs torch ScheduleInterleaved1F1B"
        in ratios["pipeline_2ranks/small/best_torchspan_vs_best_torch"].anchor
    )
    assert bench.parse_skips(text) == {
        "pipeline_2ranks/small/torch_DualPipeV_vs_Schedule1F1B": "needs more micro-batches"
    }
    assert " no (max |diff| 1.0e-02)" in text and "(reference)" in text


@pytest.mark.slow
def test_pipeline_bench_quick_times_every_schedule_on_the_same_gradients() -> None:
    """``distributed.py --pipeline --quick``: every torchspan schedule of SCHEDULES and torch's Schedule1F1B,
    each variant's gradients compared before timing (torch's, on the same layers, must equal torchspan's)."""
    from torchspan.schedule import SCHEDULES

    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "distributed.py"), "--pipeline", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = {r.name for r in bench.parse_ratios(proc.stdout)} | set(bench.parse_skips(proc.stdout))
    for schedule in SCHEDULES:
        assert f"pipeline_2ranks/small/torchspan_{schedule}_vs_Schedule1F1B" in names
    assert "pipeline_2ranks/small/best_torchspan_vs_best_torch" in names
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("  torch Schedule")]
    assert rows and all(" yes (max |diff|" in ln for ln in rows), rows


def test_cluster_bench_fit_reads_no_bandwidth_from_noise() -> None:
    # bench --quick failed now and then: three small all-reduces whose times fell with size gave a negative
    # bandwidth
    fit = _benchmark("plan_cluster").fit
    assert fit({4096: 1.0e-3, 65536: 0.9e-3, 1 << 20: 0.8e-3}) is None
    bw, lat = fit({4096: 1e-4, 65536: 2e-4, 1 << 20: 1e-3})
    assert bw > 0 and lat >= 0
