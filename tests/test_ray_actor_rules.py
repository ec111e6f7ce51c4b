"""A Ray actor's placement follows the rules a spawned rank's does, on a fake host.

Without a cluster: one interpreter on a fake host of two NUMA nodes (4 cores each,
GPUs 0 and 1 on node 0; this machine's two CPUs are node 0's first two) asks
``resolve_placement`` for a spawned rank (``CUDA_VISIBLE_DEVICES`` unset) and for a
Ray actor, as ``bind_scheduler_process`` does in the actor, under what Ray gives an
actor by default: ``CUDA_VISIBLE_DEVICES`` narrowed to its one GPU.
"""

from __future__ import annotations

import json
import os

import fakehost
import fakesys
import pytest

HOST = fakesys.Shape(sockets=2, cores_per_node=4, gpus_per_node=2)
_CODE = """
import json, os, sys
sys.path.insert(0, {tests!r})
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import numa_utils

def place(gpu, *, ray, affinity=True, **kwargs):
    args = ServerArgs(model_path={model!r}, tp_size=2, device="cuda", **kwargs)
    os.environ["SGLANG_SET_CPU_AFFINITY"] = str(int(affinity))
    if ray:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # Ray's, for Ray GPU gpu
    try:
        placement = numa_utils.resolve_placement(args, gpu, ray_actor=ray)
        return [placement.strategy, placement.node, list(placement.cpus)]
    except Exception as error:
        return [type(error).__name__, str(error)]
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)

print(json.dumps({{
    "share": {{kind: [place(g, ray=kind == "ray") for g in (0, 1)]
               for kind in ("spawned", "ray")}},
    "missing_node": {{
        f"{{kind}} {{affinity}}": place(
            0, ray=kind == "ray", affinity=affinity, numa_node=[5, 5]
        )
        for kind in ("spawned", "ray") for affinity in (False, True)
    }},
}}))
"""


@pytest.fixture(scope="module")
def placed() -> dict:
    tests = os.path.dirname(os.path.abspath(__file__))
    code = _CODE.format(tests=tests, model=os.path.join(tests, "data", "tiny_llama"))
    env = fakehost.gpu_env(HOST.gpu_addresses)
    done = fakehost.python(HOST, code, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_spawned_rank_gets_its_gpus_share_of_the_node(placed):
    # SGLANG_SET_CPU_AFFINITY=1. Node 0's cores this process may use are 0 and 1:
    # one per GPU of the node.
    assert placed["share"]["spawned"] == [["exec", 0, [0]], ["exec", 0, [1]]]


def test_set_cpu_affinity_gives_a_narrowed_actor_the_share_a_spawned_rank_gets(
    placed,
):
    spawned = [cpus for _, _, cpus in placed["share"]["spawned"]]
    assert [cpus for _, _, cpus in placed["share"]["ray"]] == spawned


def test_a_numa_node_the_host_lacks_is_the_same_error_for_an_actor(placed):
    outcomes = placed["missing_node"]
    for affinity in (False, True):
        spawned = outcomes[f"spawned {affinity}"]
        assert spawned[0] == "ValueError" and "--numa-node 5 5" in spawned[1]
        assert outcomes[f"ray {affinity}"] == spawned
