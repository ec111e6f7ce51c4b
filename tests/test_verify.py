"""verify: ranks started through the real launchers report their binding from inside."""

from __future__ import annotations

import json

import pytest

from sglang.srt.environ import envs
from sglang.srt.scheduler_launch.verify_runners import RUNNERS
from sglang.srt.placement.verify import (
    format_verify_rows,
    page_ratio_difference,
    probe_target,
    verify_ranks,
)
from sglang.srt.placement.engine_args import EngineArgs

from mp_launch_targets import exec_placement, in_process_placement, unbound_placement

PLAN_FIELDS = ("dp_rank", "pp_rank", "tp_rank", "gpu_id", "pci", "numa_node", "cpus", "mem_policy", "strategy", "reasons")
OBSERVED_FIELDS = ("launcher", "observed_cpus", "observed_mems", "observed_policy", "local_page_ratio", "ok", "differences")


def test_mp_ranks_are_where_the_plan_says():
    placements = [exec_placement(0, 0), in_process_placement(1, 1), unbound_placement(2)]
    rows = verify_ranks(EngineArgs(tp_size=3), launcher="mp", placements=placements, timeout_s=120,
                        runners=RUNNERS)
    json.dumps({"ranks": rows})
    assert [set(PLAN_FIELDS + OBSERVED_FIELDS) <= set(row) for row in rows] == [True] * 3
    assert [row["ok"] for row in rows] == [True] * 3, [row["differences"] for row in rows]
    assert [row["launcher"] for row in rows] == ["mp"] * 3
    assert [row["observed_cpus"] for row in rows[:2]] == ["0", "1"]
    assert [row["observed_policy"] for row in rows] == ["bind:0", "bind:0", "default"]
    assert rows[0]["local_page_ratio"] >= 0.99 and rows[1]["local_page_ratio"] >= 0.95
    assert rows[2]["local_page_ratio"] is None
    lines = format_verify_rows(rows).splitlines()
    assert len(lines) == 3
    assert lines[0] == (
        "[DP0 PP0 TP0] mp GPU 0 node 0 via exec: cpus 0 (plan 0), mems 0, policy bind:0 (plan bind:0), "
        f"local pages {rows[0]['local_page_ratio']:.1%}: OK"
    )
    assert lines[2].startswith("[DP0 PP0 TP2] mp GPU 2 node - via none: cpus ")


def test_a_rank_off_its_plan_is_reported():
    # The plan says CPU 1 but numactl is told CPU 0: what the rank observes differs from the plan.
    wrong = exec_placement(0, 0).replace(cpus=frozenset({1}))
    (row,) = verify_ranks(EngineArgs(), launcher="mp", placements=[wrong], timeout_s=120,
                            runners=RUNNERS)
    assert row["ok"] is False
    assert row["differences"] == ["cpus 0 observed, 1 planned"]
    assert format_verify_rows([row]).endswith(": MISMATCH: cpus 0 observed, 1 planned")


def test_mp_plans_this_host_when_no_placements_are_given():
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("0|1"):
        rows = verify_ranks(EngineArgs(device="cpu", tp_size=2), launcher="mp", timeout_s=120, plan_kwargs={},
                            runners=RUNNERS)
    assert [(row["strategy"], row["observed_cpus"], row["ok"]) for row in rows] == [("exec", "0", True), ("exec", "1", True)]


def test_page_ratio_thresholds():
    exec_rank = exec_placement(0, 0)
    assert page_ratio_difference(exec_rank, 0.995) is None
    assert page_ratio_difference(exec_rank, 0.98) == (
        "98.0% of the rank's resident anonymous memory is on node(s) 0, at least 99% expected for strategy exec"
    )
    assert page_ratio_difference(in_process_placement(0, 0), 0.96) is None
    assert page_ratio_difference(in_process_placement(0, 0), 0.90) is not None
    assert page_ratio_difference(exec_rank.replace(mem_policy="preferred"), 0.5) is None
    assert page_ratio_difference(exec_rank, None) is None


def test_launcher_choice_is_checked():
    with pytest.raises(ValueError, match="--launcher='slurm' is not valid"):
        verify_ranks(EngineArgs(), launcher="slurm", runners=RUNNERS)


def test_both_runs_each_launcher_with_the_same_probe():
    calls = []

    def fake_runner(name):
        def run(server_args, *, placements, timeout_s, plan_kwargs):
            calls.append((name, placements is None, plan_kwargs))
            return []
        return run

    rows = verify_ranks(EngineArgs(), launcher="both", runners={"mp": fake_runner("mp"), "ray": fake_runner("ray")},
                        plan_kwargs={"gpus": ["0000:81:00.0"]})
    assert rows == []
    assert calls == [("mp", True, {"gpus": ["0000:81:00.0"]}), ("ray", True, {"gpus": ["0000:81:00.0"]})]
    assert probe_target(server_args=None, placement=None, rank=None).ready_info()["differences"] == []


@pytest.mark.ray
def test_ray_ranks_report_their_binding(ray_cluster):
    with envs.SGLANG_CPU_OMP_THREADS_BIND.override("0|1"):
        rows = verify_ranks(EngineArgs(device="cpu", tp_size=2), launcher="ray", timeout_s=120, runners=RUNNERS)
    assert [row["launcher"] for row in rows] == ["ray", "ray"]
    assert [row["observed_cpus"] for row in rows] == ["0", "1"]
    assert all(row["ok"] for row in rows), [row["differences"] for row in rows]
