"""CPU test of what the RL demo and its peer run decide and print (vmstash/demo/common.py):
the memory and speed verdicts at their edges, the switch lines, the per-direction summary
with its outliers, the timeline plot, and the run's verdict with its peers (the same
criteria for a peer's switches as for vmstash's; which peers decide it)."""
import importlib
import json
import os
import sys
import tempfile
import types
import xml.etree.ElementTree as ET

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vmstash.demo import common as c  # noqa: E402

GiB = 1 << 30


def approx(expected):
    """unittest's assertAlmostEqual: equal to 7 decimal places."""
    return pytest.approx(expected, rel=0, abs=5e-8)


def record(label="rollout", freed=10 * GiB, reserved=10 * GiB, time_s=0.15, pause=None, resume=None, sync=None):
    # 4 GiB backed up at 40 GiB/s and 1 GiB restored at 50 GiB/s: bound 0.1 + 0.02 + 0.01 = 0.13 s.
    return c.switch_record(label, ["optimizer"], ["weights"], reserved, freed, 4 * GiB, 1 * GiB, 40 * GiB, 50 * GiB,
                           time_s, pause, resume, sync_s=sync)


def direction(times, label="rollout"):
    _, out = c.summarize("vmstash", [record(label, time_s=t) for t in times], {})
    return out


# --- Verdict --------------------------------------------------------------------------
def test_bound_is_bytes_over_bandwidth_plus_10_ms():
    assert record()["bound"] == approx(0.13)


def test_host_rate_is_an_error_not_an_exception_where_it_cannot_be_measured(monkeypatch):
    # The measuring process cannot run here (no torch, or torch without CUDA): its reason
    # comes back, the peer's bound falls back to the link, nothing raises.
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.setenv("LD_PRELOAD", "/nonexistent/libvmstash_preload.so")  # dropped for the child
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for it, also on a GPU machine
    out = c.host_rate(0, gib=0.0625, timeout=120)
    assert set(out) == {"error"}, out
    assert "torch" in out["error"].lower() or "cuda" in out["error"].lower(), out


def test_host_rate_reads_the_childs_line_and_names_what_it_printed_otherwise(monkeypatch):
    import subprocess
    seen = {}

    def fake(stdout, stderr="", rc=0):
        def run(cmd, env=None, **kw):
            seen.update(cmd=cmd, env=env)
            return subprocess.CompletedProcess(cmd, rc, stdout, stderr)
        return run
    monkeypatch.setenv("LD_PRELOAD", "/x/libvmstash_preload.so")
    monkeypatch.setattr(subprocess, "run", fake('noise\n{"inline": 3.0, "staged": 4.0, "rate": 4.0}\n'))
    assert c.host_rate(1) == {"inline": 3.0, "staged": 4.0, "rate": 4.0}
    assert "LD_PRELOAD" not in seen["env"] and seen["cmd"][-4:] == ["--device", "1", "--gib", "4"]
    monkeypatch.setattr(subprocess, "run", fake("", "Segmentation fault", rc=-11))
    assert c.host_rate() == {"error": "vmstash.demo.host_rate printed no result: Segmentation fault"}
    monkeypatch.setattr(subprocess, "run", fake('{"something": 1}'))
    assert "printed no result" in c.host_rate()["error"]


def test_host_rate_refuses_sizes_it_cannot_measure(capsys):
    from vmstash.demo import host_rate
    assert host_rate.main(["--gib", "0.01"]) == 1
    assert "at least 64 MiB" in json.loads(capsys.readouterr().out)["error"]


def test_memory_released_edge():
    assert c.memory_failures(record(freed=0.95 * 10 * GiB)) == []
    failures = c.memory_failures(record(freed=0.94 * 10 * GiB))
    assert len(failures) == 1
    assert "95%" in failures[0]


def test_speed_fails_only_on_the_median_past_the_margin():
    assert c.SPEED_MARGIN == 1.5
    assert c.speed_failures(direction([0.15, 0.19, 0.195])) == []  # median 1.46x
    failures = c.speed_failures(direction([0.15, 0.196, 0.2]))  # median 1.51x
    assert len(failures) == 1
    assert "to rollout" in failures[0]
    assert "1.5 x bound 130.0 ms" in failures[0]
    assert "median switch 196.0 ms (1.51x)" in failures[0]
    assert "p90 200.0 ms, max 200.0 ms, 3 switches" in failures[0]


def test_one_slow_switch_is_named_not_failed():
    times = [0.12] * 9 + [0.5]  # one switch at 3.8x its bound on a busy machine
    out = direction(times)
    assert c.speed_failures(out) == []
    assert out["directions"]["rollout"]["outliers"] == [(10, 500.0)]
    lines, _ = c.summarize("vmstash", [record(time_s=t) for t in times], {})
    assert "over 1.1x bound: #10 500.0 ms" in lines[0]


def test_each_direction_is_judged_on_its_own():
    switches = [record("training", time_s=0.12)] * 3 + [record("rollout", time_s=0.3)] * 3
    _, out = c.summarize("vmstash", switches, {})
    failures = c.speed_failures(out)
    assert len(failures) == 1
    assert "to rollout" in failures[0]


# --- Line -----------------------------------------------------------------------------
def test_a_switch_reports_its_own_time_and_both_directions():
    line = c.switch_line(record(time_s=0.15, sync=0.0011))
    for part in ("switch to rollout", "out optimizer (4.00 GiB backed up)", "in weights (1.00 GiB restored)",
                 "(100.0%)", "150.0 ms vs bound 130.0 ms (1.15x)", "one switch() transaction",
                 "33.3 GiB/s both ways together", "weight sync 1.1 ms"):
        assert part in line
    assert "resume" not in line  # no side of a transaction is made up


def test_sequential_sides_have_their_own_times_and_rates():
    line = c.switch_line(record(time_s=0.15, pause=0.1, resume=0.05))
    assert "150.0 ms vs bound" in line
    assert "pause 100.0 ms (40.0 GiB/s) then resume 50.0 ms (20.0 GiB/s)" in line


def test_no_rate_without_bytes_or_time():
    r = c.switch_record("rollout", ["kv"], [], GiB, GiB, 0, 0, 40 * GiB, 50 * GiB, 0.001, 0.001, 0.0)
    line = c.switch_line(r)
    assert "pause 1.0 ms (-) then resume 0.0 ms (-)" in line
    assert "GiB/s)" not in line


# --- Summary --------------------------------------------------------------------------
def test_per_direction_median_p90_max():
    switches = [record("rollout", time_s=t) for t in (0.11, 0.12, 0.14, 0.10, 0.13)]
    switches.append(record("training", freed=9.6 * GiB, time_s=0.07))
    lines, out = c.summarize("vmstash", switches, {"rollout": 3 * GiB, "training": 18 * GiB})
    r = out["directions"]["rollout"]
    assert r["switches"] == 5
    assert r["median_ms"] == approx(120.0)
    assert r["p90_ms"] == approx(140.0)
    assert r["max_ms"] == approx(140.0)
    assert r["outliers"] == []
    assert out["directions"]["training"]["min_freed_share"] == approx(0.96)
    assert len(lines) == 3
    assert "median 120.0 ms (0.92x bound), p90 140.0 ms, max 140.0 ms vs bound 130.0 ms" in lines[0]
    assert "over 1.1x bound: none" in lines[0]
    assert "rollout 3.00 GiB, training 18.00 GiB" in lines[-1]


def test_percentile_is_nearest_rank():
    assert c.percentile([5], 0.9) == 5
    assert c.percentile(list(range(1, 11)), 0.9) == 9
    assert c.percentile(list(range(1, 21)), 0.9) == 18
    assert c.percentile([3, 1, 2], 1.0) == 3


# --- Speedup --------------------------------------------------------------------------
def test_switch_against_the_sequential_path_per_direction():
    switches = [record("rollout", time_s=t) for t in (0.10, 0.12, 0.11)]
    switches += [record("rollout (sequential)", time_s=0.1 + r, pause=0.1, resume=r) for r in (0.05, 0.06, 0.07)]
    switches.append(record("training", time_s=0.1))  # no sequential cycle: left out
    out = c.switch_speedups(switches)
    assert set(out) == {"rollout"}
    seq_ms, sw_ms = out["rollout"]
    assert seq_ms == approx(160.0)
    assert sw_ms == approx(110.0)


# --- Timeline -------------------------------------------------------------------------
def test_svg_is_xml_with_one_point_per_phase():
    t = c.Timeline.__new__(c.Timeline)
    t.points = []
    for k in range(3):
        at = 20.0 + k
        t.points += [(at, 3.8, f"rollout {k}"), (at + 0.2, 1.6, "switched to training"),
                     (at + 0.5, 18.8, f"train {k}"), (at + 0.9, 3.0, "switched to rollout")]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.svg")
        t.svg(path)
        root = ET.parse(path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}circle")) == 6
    xs = [float(p.split(",")[0]) for p in root.find(f"{ns}polyline").get("points").split()]
    assert len(xs) == 12
    assert xs[0] == approx(60.0)  # time starts at the first mark, not at the set-up
    assert xs == sorted(xs)



# --- The run's verdict with its peers ---------------------------------------------------
def log(times_to_training, times_to_rollout, freed_share=1.0):
    """A switch log with both of the demo's directions (bound 130 ms each)."""
    return ([record("training", freed=freed_share * 10 * GiB, time_s=t) for t in times_to_training] +
            [record("rollout", freed=freed_share * 10 * GiB, time_s=t) for t in times_to_rollout])


FAST = [0.12] * 10
SLOW = [2.6] * 10  # 20x the 130 ms bound: torch_memory_saver 0.0.10's order of magnitude


def peer(name, switches, failures=(), exit_code=None, **extra):
    """What run_peer hands back: the child's JSON (here through json, as it is read) and its exit code."""
    out = {"name": name, "switch_log": switches, "failures": list(failures), **extra}
    out = json.loads(json.dumps(out))
    out["exit_code"] = exit_code if exit_code is not None else (
        0 if c.judge(name, switches, failures, checks=c.PEER_CHECKS)["passed"] else 1)
    return out


def run_verdict(peers, judge_foreign=False, own_switches=None, own_failures=()):
    """The verdict as report() decides it; checked to be JSON as --json writes it."""
    own = c.judge("vmstash", log(FAST, FAST) if own_switches is None else own_switches, own_failures)
    verdicts = [c.peer_verdict(p, judge_foreign) for p in peers]
    lines, code, out = c.final_verdict(own, verdicts)
    json.dumps({"verdict": out, "peers": verdicts})
    return lines, code, out, verdicts


DROPIN = "vmstash.compat.torch_memory_saver"
TMS = "torch_memory_saver"


def test_vmstash_and_a_peer_are_judged_by_one_function():
    """The same switch log gives the same misses, whoever switched it."""
    switches = log(FAST, SLOW, freed_share=0.9)
    mine = c.judge("vmstash", switches)
    theirs = c.peer_verdict(peer(DROPIN, switches))
    for key in ("memory", "speed", "outliers"):
        assert json.dumps(mine[key]) == json.dumps(theirs[key])
    assert not mine["passed"] and not theirs["passed"]
    assert len(mine["memory"]) == 20  # every switch released 90% < 95%
    assert [s.split(":")[0] for s in mine["speed"]] == ["to rollout"]


def test_a_peer_within_the_criteria_passes():
    lines, code, out, (v,) = run_verdict([peer(DROPIN, log(FAST, FAST + [0.5]))])
    assert code == 0 and out["passed"] and v["passed"] and v["judged"]
    assert lines[-1] == "PASSED"
    assert lines[1].startswith(f"verdict peer {DROPIN} (vmstash's own code path, judged): meets the criteria")
    assert "1 switches over 1.1x their bound (named, not failed on)" in lines[1]


def test_the_dropin_missing_the_bound_fails_the_run():
    lines, code, out, (v,) = run_verdict([peer(DROPIN, log(FAST, SLOW))])
    assert code == 1 and not out["passed"]
    assert v["judged"] and v["vmstash"] and not v["passed"]
    final = lines[-1]
    assert final.startswith("FAILED: ")
    for part in (f"peer {DROPIN}", "to rollout", "median switch 2600.0 ms (20.00x)", "> 1.5 x bound 130.0 ms",
                 "p90 2600.0 ms, max 2600.0 ms"):
        assert part in final
    assert "to training" not in final  # the direction within the criteria is not named
    assert out["failures"] == [f"peer {DROPIN}: " + v["speed"][0]]
    assert "MISSED the criteria" in lines[1]
    assert "speed (every direction's median within 1.5x its bound: no: " in lines[1]
    assert len(lines) == 3  # one failure: no list above the final line


def test_the_dropin_wheel_under_torch_memory_savers_name_is_judged():
    """The drop-in wheel installs vmstash's module as torch_memory_saver: judged like vmstash's."""
    dropin = types.SimpleNamespace(served_by="vmstash")
    assert c.served_by_vmstash(TMS, dropin)
    real = types.SimpleNamespace(torch_memory_saver=types.SimpleNamespace())  # its class lives elsewhere
    assert not c.served_by_vmstash(TMS, real)
    assert not c.served_by_vmstash(TMS) and not c.served_by_vmstash("vmstashx")
    assert c.served_by_vmstash(DROPIN) and c.served_by_vmstash("vmstash")
    _, code, _, (v,) = run_verdict([peer(TMS, log(SLOW, FAST), vmstash=True)])
    assert code == 1 and v["judged"]


def test_a_foreign_peer_missing_is_reported_and_the_run_passes():
    lines, code, out, (v,) = run_verdict([peer(TMS, log(SLOW, SLOW))])
    assert code == 0 and out["passed"] and out["failures"] == []
    assert not v["passed"] and not v["judged"] and len(v["speed"]) == 2
    assert out["not_judged_missed"] == [TMS]
    assert lines[1].startswith(f"verdict peer {TMS} (another module: a comparison, not judged; --judge-peer judges "
                               f"it): MISSED the criteria")
    assert "to rollout: median switch 2600.0 ms (20.00x) > 1.5 x bound 130.0 ms" in lines[1]
    assert lines[-1] == f"PASSED ({TMS}: missed the criteria, a comparison, not judged)"


def test_a_foreign_peer_missing_fails_when_asked_to_judge_it():
    lines, code, out, (v,) = run_verdict([peer(TMS, log(SLOW, FAST))], judge_foreign=True)
    assert code == 1 and v["judged"] and "(--judge-peer)" in v["role"]
    assert lines[-1].startswith(f"FAILED: peer {TMS}: to training: median switch 2600.0 ms (20.00x) > 1.5 x bound")


def test_data_mismatch_in_the_dropin_fails_even_when_fast():
    bad = "to rollout: tag weights piece 0 changed across pause/resume"
    lines, code, out, (v,) = run_verdict([peer(DROPIN, log(FAST, FAST), failures=[bad])])
    assert code == 1 and v["data"] == [bad] and v["speed"] == []
    assert lines[-1] == f"FAILED: peer {DROPIN}: {bad}"
    assert "data (backup bytes across every switch, memory released: 1 failures: " in lines[1]


def test_data_mismatch_in_a_foreign_peer_is_its_result_unless_judged():
    bad = "to training: tag adam piece 3 changed across pause/resume"
    _, code, out, (v,) = run_verdict([peer(TMS, log(FAST, FAST), failures=[bad])])
    assert code == 0 and not v["passed"] and out["not_judged_missed"] == [TMS]
    _, code, _, _ = run_verdict([peer(TMS, log(FAST, FAST), failures=[bad])], judge_foreign=True)
    assert code == 1


def test_a_peer_releasing_too_little_misses_as_vmstash_would():
    _, code, out, (v,) = run_verdict([peer(DROPIN, log(FAST, FAST, freed_share=0.9))])
    assert code == 1 and len(v["memory"]) == 20
    assert "released" in out["failures"][0] and "95%" in out["failures"][0]


def test_a_dropin_that_cannot_run_fails_a_foreign_one_is_reported():
    err = "cannot start: No module named 'torch_memory_saver'"
    lines, code, _, (v,) = run_verdict([{"name": DROPIN, "error": "the child exited with -11 before writing its "
                                         "figures"}])
    assert code == 1 and v["errors"] and lines[-1].startswith(f"FAILED: peer {DROPIN}: the child exited with -11")
    lines, code, _, (v,) = run_verdict([{"name": TMS, "error": err}])
    assert code == 0 and not v["passed"] and lines[1].endswith(f"MISSED the criteria: {err}")


def test_a_child_crashing_after_its_figures_is_an_error():
    _, code, out, (v,) = run_verdict([peer(DROPIN, log(FAST, FAST), exit_code=-6)])
    assert code == 1 and v["errors"] == ["the child exited with -6"]
    _, code, _, _ = run_verdict([peer(DROPIN, log(FAST, FAST), exit_code=1)])  # 1 but within the criteria
    assert code == 1


def test_vmstash_missing_fails_with_or_without_peers():
    lines, code, out, _ = run_verdict([], own_switches=log(FAST, SLOW))
    assert code == 1 and lines[-1].startswith("FAILED: vmstash: to rollout: median switch 2600.0 ms")
    lines, code, out, _ = run_verdict([], own_failures=["cycle 2 decode 3: replay differs from eager by 0.5"])
    assert code == 1 and lines[-1] == "FAILED: vmstash: cycle 2 decode 3: replay differs from eager by 0.5"
    assert lines[0].startswith("verdict vmstash: MISSED the criteria: data (replays, backup bytes across every "
                               "switch, addresses, memory released: 1 failures")
    _, code, _, _ = run_verdict([], own_switches=[])
    assert code == 1  # no switch recorded is no pass


def test_many_failures_are_listed_and_the_final_line_stays_short():
    lines, code, out, _ = run_verdict([peer(DROPIN, log(SLOW, SLOW, freed_share=0.5))])
    assert code == 1 and len(out["failures"]) == 22
    assert lines[-2].startswith("failures (22):") and lines[-2].count("\n  ") == 20  # the list, up to 20
    assert lines[-1].endswith("; +19 more")
    assert sum(line.startswith(("PASSED", "FAILED")) for line in "\n".join(lines).split("\n")) == 1


@pytest.fixture
def demo(monkeypatch):
    """vmstash.demo.rl_phase_switch imported over a stubbed torch (report() only names the
    device); afterwards the module (and the package's attribute) are as they were, so no
    stubbed torch is left behind for other tests."""
    fake = types.ModuleType("torch")
    fake.nn = types.ModuleType("torch.nn")
    fake.nn.functional = types.ModuleType("torch.nn.functional")
    fake.cuda = types.SimpleNamespace(get_device_name=lambda i=0: "a test device")
    for name, module in (("torch", fake), ("torch.nn", fake.nn), ("torch.nn.functional", fake.nn.functional)):
        monkeypatch.setitem(sys.modules, name, module)
    import vmstash.demo as package
    name, attr = "vmstash.demo.rl_phase_switch", "rl_phase_switch"
    saved_module, saved_attr = sys.modules.pop(name, None), package.__dict__.get(attr)
    try:
        yield importlib.import_module(name)
    finally:
        sys.modules.pop(name, None)
        package.__dict__.pop(attr, None)
        if saved_module is not None:
            sys.modules[name] = saved_module
        if saved_attr is not None:
            setattr(package, attr, saved_attr)


def test_the_demo_reports_every_verdict_and_exits_with_the_runs(demo, tmp_path, capsys):
    """rl_phase_switch.report() end to end: the last line, the exit code, the JSON."""
    verifier = types.SimpleNamespace(failures=[], checks=494, exact=494)
    switcher = types.SimpleNamespace(switches=log(FAST, FAST))
    timeline = types.SimpleNamespace(points=[(0.0, 1.0, "rollout 0")])
    out = tmp_path / "demo.json"

    def report(argv, peers):
        args = demo.parse_args(argv + ["--json", str(out), "--sequential-cycles", "0"])
        code = demo.report(args, verifier, switcher, {"rollout": GiB}, peers, (40 * GiB, 50 * GiB), [], timeline)
        return code, capsys.readouterr().out.rstrip().split("\n")[-1], json.loads(out.read_text())

    code, last, data = report(["--peer", DROPIN, "--peer", TMS],
                              [peer(DROPIN, log(FAST, SLOW), vmstash=True), peer(TMS, log(SLOW, SLOW), vmstash=False)])
    assert code == 1 and last.startswith(f"FAILED: peer {DROPIN}: to rollout: median switch 2600.0 ms")
    assert data["verdict"]["exit_code"] == 1 and data["verdict"]["not_judged_missed"] == [TMS]
    assert data["vmstash"]["verdict"]["passed"] and not data["judge_peer"]
    assert [(p["verdict"]["judged"], p["verdict"]["passed"]) for p in data["peers"]] == [(True, False), (False, False)]

    code, last, data = report(["--peer", TMS], [peer(TMS, log(SLOW, SLOW), vmstash=False)])
    assert code == 0 and last == f"PASSED ({TMS}: missed the criteria, a comparison, not judged)"
    code, last, data = report(["--peer", TMS, "--judge-peer"], [peer(TMS, log(SLOW, SLOW), vmstash=False)])
    assert code == 1 and data["judge_peer"] and last.startswith(f"FAILED: peer {TMS}: to rollout: ")


def test_speed_not_judged_reports_the_miss_and_still_fails_on_data():
    """--speed-not-judged (the CTest run): a speed miss is reported, not failed on, for
    vmstash and the drop-in alike; wrong bytes still fail; the child's exit status is still
    held against every criterion (the child judges speed)."""
    own = c.judge("vmstash", log(FAST, SLOW), judge_speed=False)
    assert own["passed"] and not own["met"] and own["speed"] and own["failures"] == []
    slow_dropin = peer(DROPIN, log(FAST, SLOW), exit_code=0)  # the child was told too: 0
    v = c.peer_verdict(slow_dropin, judge_speed=False)
    assert v["passed"] and v["errors"] == [] and v["speed"], v
    crashed = c.peer_verdict(peer(DROPIN, log(FAST, SLOW), exit_code=1), judge_speed=False)
    assert not crashed["passed"] and not crashed["met"], crashed  # 1 means a failure there
    assert crashed["errors"] == ["the child exited with 1"]
    lines, code, out = c.final_verdict(own, [v])
    assert code == 0 and lines[-1] == "PASSED"
    assert lines[0].startswith("verdict vmstash: meets the judged criteria: "), lines[0]
    assert ("no: " + own["speed"][0] + "; reported, not judged)") in lines[0], lines[0]
    bad = "to rollout: tag weights piece 0 changed across pause/resume"
    v = c.peer_verdict(peer(DROPIN, log(FAST, SLOW), failures=[bad]), judge_speed=False)
    _, code, out = c.final_verdict(own, [v])
    assert code == 1 and out["failures"] == [f"peer {DROPIN}: {bad}"]
    wrong_exit = peer(DROPIN, log(FAST, FAST), exit_code=1)  # within every criterion, yet exited 1
    assert c.peer_verdict(wrong_exit, judge_speed=False)["errors"] == ["the child exited with 1"]
