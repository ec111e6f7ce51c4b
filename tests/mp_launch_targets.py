"""Scheduler targets and hand-built placements for the launcher tests (imported by the spawned children too).

Kept apart from the test modules so a child imports only this and the package, not pytest.
"""

from __future__ import annotations

import os
import threading

from sglang.srt.placement.types import ProcessPlacement



def _status(key: str) -> str:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return line.split(":", 1)[1].strip()
    raise KeyError(key)


class _Reporter:
    def __init__(self, rank):
        self.rank = rank
        self.ran = False

    def ready_info(self):
        from sglang.srt.placement.observe import read_mempolicy

        policy, nodes = read_mempolicy()
        return {
            "pid": os.getpid(),
            "tp_rank": self.rank.tp_rank,
            "cpus": _status("Cpus_allowed_list"),
            "policy": policy,
            "policy_nodes": sorted(nodes),
        }

    def event_loop(self):
        self.ran = True


def report_target(*, server_args, placement, rank):
    return _Reporter(rank)


def raising_target(*, server_args, placement, rank):
    def build_scheduler_that_fails():
        raise ValueError(f"model weights missing for {rank.label}")

    return build_scheduler_that_fails()


def exiting_target(*, server_args, placement, rank):
    os._exit(3)


class _HangingReady:
    def ready_info(self):
        threading.Event().wait()


def hanging_target(*, server_args, placement, rank):
    return _HangingReady()


class _FailingLoop:
    def ready_info(self):
        return {}

    def event_loop(self):
        raise RuntimeError("event loop lost its socket")


def failing_loop_target(*, server_args, placement, rank):
    return _FailingLoop()




def exec_placement(tp_rank: int, cpu: int, *, membind: int = 0) -> ProcessPlacement:
    return ProcessPlacement(
        dp_rank=0, pp_rank=0, tp_rank=tp_rank, gpu_id=tp_rank, pci=None, numa_node=0,
        cpus=frozenset({cpu}), mem_nodes=frozenset({membind}), mem_policy="bind", strategy="exec",
        reasons=("test",), numactl_args=(f"--physcpubind={cpu}", f"--membind={membind}"),
    )


def in_process_placement(tp_rank: int, cpu: int) -> ProcessPlacement:
    return exec_placement(tp_rank, cpu).replace(strategy="in-process", numactl_args=())


def unbound_placement(tp_rank: int) -> ProcessPlacement:
    return ProcessPlacement(
        dp_rank=0, pp_rank=0, tp_rank=tp_rank, gpu_id=tp_rank, pci=None, numa_node=None,
        cpus=frozenset(), mem_nodes=frozenset(), mem_policy="none", strategy="none", reasons=("test: unbound",),
    )


class _IdentityReporter(_Reporter):
    def ready_info(self):
        import logging

        info = super().ready_info()
        with open("/proc/self/comm") as f:
            info["comm"] = f.read().strip()
        handler = logging.getLogger().handlers[0]
        info["log_format"] = handler.formatter._fmt
        return info


def identity_target(*, server_args, placement, rank):
    return _IdentityReporter(rank)


def affinity_report(conn) -> None:
    """A plain ``multiprocessing`` target (not the launcher protocol): send this process's CPUs and exit."""
    conn.send(_status("Cpus_allowed_list"))
    conn.close()


class _SleepingLoop(_Reporter):
    def event_loop(self):
        import time

        time.sleep(SLEEPING_LOOP_S)
        self.ran = True


SLEEPING_LOOP_S = 1.5


def sleeping_loop_target(*, server_args, placement, rank):
    """Ready at once; its event loop runs for SLEEPING_LOOP_S, then returns."""
    return _SleepingLoop(rank)
