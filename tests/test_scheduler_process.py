"""configure_scheduler_process and run_scheduler_process: identity, in-child placement, readiness reports."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from sglang.srt.scheduler_launch.mp import run_ranks_mp
from sglang.srt.environ import envs
from sglang.srt.scheduler_rank import child as scheduler
from sglang.srt.scheduler_rank.child import run_scheduler_process, scheduler_log_prefix
from sglang.srt.scheduler_rank.common import RankResult
from sglang.srt.placement.types import RankIdentity
from sglang.srt.placement.engine_args import EngineArgs

from mp_launch_targets import exec_placement, identity_target, in_process_placement, unbound_placement


@pytest.mark.parametrize(
    ("sizes", "ranks", "expected"),
    [
        (dict(), dict(tp_rank=0), ""),
        (dict(tp_size=4), dict(tp_rank=3), " TP3"),
        (dict(tp_size=2, pp_size=2), dict(tp_rank=1, pp_rank=1), " PP1 TP1"),
        (dict(tp_size=2, pp_size=2, dp_size=2), dict(tp_rank=0, pp_rank=1, dp_rank=1), " DP1 PP1 TP0"),
        (dict(tp_size=1, dp_size=2), dict(tp_rank=0, dp_rank=0), " DP0"),
    ],
)
def test_log_prefix_follows_upstream_order(sizes, ranks, expected):
    assert scheduler_log_prefix(EngineArgs(**sizes), **ranks) == expected


def test_log_prefix_includes_expert_rank_when_expert_parallel():
    class WithEp:
        tp_size, pp_size, ep_size = 2, 1, 2

    assert scheduler_log_prefix(WithEp(), tp_rank=1, moe_ep_rank=1) == " TP1 EP1"


def test_child_title_and_log_prefix():
    server_args = EngineArgs(tp_size=2, pp_size=1, dp_size=2)
    placements = [exec_placement(0, 0).replace(dp_rank=1, tp_rank=1)]
    ranks = [RankIdentity(dp_rank=1, pp_rank=0, tp_rank=1, gpu_id=3, global_rank=3)]
    (result,) = run_ranks_mp(server_args, target=identity_target, placements=placements, ranks=ranks, timeout_s=120)
    assert isinstance(result, RankResult)
    assert result.rank.global_rank == 3
    title = "sglang::scheduler_DP1_TP1"
    # Without setproctitle only the kernel's 15-character comm can be set.
    assert result.info["comm"] in (title, title[:15])
    assert result.info["log_format"] == "[%(asctime)s DP1 TP1] %(message)s"


def test_in_process_placement_is_applied_in_the_child():
    (result,) = run_ranks_mp(EngineArgs(), target=identity_target, placements=[in_process_placement(0, 1)], timeout_s=120)
    assert result.info["cpus"] == "1"
    assert (result.info["policy"], result.info["policy_nodes"]) == ("bind", [0])


def test_v1_placement_binds_with_the_legacy_call():
    placement = exec_placement(0, 0).replace(strategy="v1", numactl_args=())
    (result,) = run_ranks_mp(EngineArgs(), target=identity_target, placements=[placement], timeout_s=120)
    # bind_legacy_v1: run on the node's CPUs, prefer the node's memory (upstream's V1).
    assert (result.info["policy"], result.info["policy_nodes"]) == ("preferred", [0])


def test_legacy_switch_binds_in_child_without_a_placement():
    server_args = EngineArgs(numa_node=[0])
    with envs.SGLANG_NUMA_BIND_V2.override(False):
        (legacy,) = run_ranks_mp(server_args, target=identity_target, placements=[None],
                                 ranks=[RankIdentity(0, 0, 0, gpu_id=0)], timeout_s=120)
    (v2,) = run_ranks_mp(server_args, target=identity_target, placements=[None],
                         ranks=[RankIdentity(0, 0, 0, gpu_id=0)], timeout_s=120)
    assert legacy.info["policy"] == "preferred"
    assert v2.info["policy"] == "default"


# ----------------------------------------------------------------- run_scheduler_process's reports, in this process


@pytest.fixture
def quiet_child_setup(monkeypatch):
    # Title and logging belong to a real child; keep them off the test runner.
    monkeypatch.setattr(scheduler, "configure_scheduler_process", lambda *a, **k: "")


class _Ready:
    def __init__(self, info):
        self.info = info
        self.loops = 0

    def ready_info(self):
        return self.info

    def event_loop(self):
        self.loops += 1


def _run(target):
    reader, writer = multiprocessing.Pipe(duplex=False)
    exit_code = 0
    try:
        run_scheduler_process(
            server_args=EngineArgs(), placement_json=unbound_placement(0).to_json(),
            rank=RankIdentity(0, 0, 0, gpu_id=0), target=target, pipe_writer=writer,
        )
    except SystemExit as exc:
        exit_code = exc.code
    messages = []
    while reader.poll(0):
        try:
            messages.append(reader.recv())
        except EOFError:
            break
    return exit_code, messages


def test_ready_then_done(quiet_child_setup):
    made = []

    def target(*, server_args, placement, rank):
        made.append((placement.strategy, rank.label))
        return _Ready({"max_total_num_tokens": 128})

    code, messages = _run(target)
    assert code == 0
    binding = messages[0].pop("binding")
    assert messages == [{"status": "ready", "info": {"max_total_num_tokens": 128}}, {"status": "done"}]
    # The read-back rides with readiness: this process, as the kernel reports it, and no mismatch.
    assert (binding["pid"], binding["mismatches"]) == (os.getpid(), [])
    assert binding["observed"]["cpus"]
    assert made == [("none", "DP0 PP0 TP0")]


def test_target_without_ready_info_or_loop(quiet_child_setup):
    code, messages = _run(lambda **kw: object())
    assert code == 0
    messages[0].pop("binding")
    assert messages == [{"status": "ready", "info": {}}, {"status": "done"}]


@pytest.mark.parametrize(
    ("info", "error"),
    [(["not", "a", "dict"], "TypeError: ready_info() returned list"), ({"x": object()}, "TypeError: Object of type object")],
)
def test_unusable_ready_info_is_an_error(quiet_child_setup, info, error):
    code, messages = _run(lambda **kw: _Ready(info))
    assert code == 1
    (message,) = messages
    assert message["status"] == "error" and message["stage"] == "start"
    assert message["error"].startswith(error)
    assert "Traceback" in message["traceback"]


def test_configure_failure_is_reported(monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("sched_setaffinity: Invalid argument")

    monkeypatch.setattr(scheduler, "configure_scheduler_process", broken)
    code, messages = _run(lambda **kw: _Ready({}))
    assert code == 1
    assert messages[0]["error"] == "OSError: sched_setaffinity: Invalid argument"
