"""The overlay as a patch series for review: one idea per patch, in an order where each builds on the last.

``overlay.py --series OUT DIR`` (DIR a pristine sglang package, left untouched)
writes ``OUT/series`` (the patch names in order) and ``OUT/NNNN-<slug>.patch``.
Each patch is a short header (``Subject:``, what and why, the tests that cover
it, what an operator notices) and a unified diff with ``--diff``'s paths, so
``git apply -p1`` from DIR's parent applies them in order, and after the last
the package is what ``overlay.py DIR`` makes.

Every changed file of the overlay belongs to exactly one patch, at its final
content, except a file listed in ``Partial``: a patch takes it first to an
intermediate state (upstream's module with some top-level definitions
replaced, added or removed), a later patch to its final content. The patches
are checked as they are made: no file is left out or given twice, and no patch
changes more than ``MAX_CHANGED_LINES`` lines.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

MAX_CHANGED_LINES = 800


@dataclass(frozen=True)
class Partial:
    """An intermediate state of an upstream module: ``upstream`` with these top-level names changed."""

    rel: str
    replace: Tuple[str, ...] = ()
    """Definitions taken from the final module in place of upstream's."""
    add_before: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    """name -> definitions of the final module inserted before it (names upstream lacks)."""
    remove: Tuple[str, ...] = ()
    imports: Tuple[str, ...] = ()
    """Import lines added after upstream's last top-level import."""


@dataclass(frozen=True)
class Patch:
    slug: str
    title: str
    why: str
    tests: str
    operators: str
    files: Tuple[str, ...] = ()
    partial: Tuple[Partial, ...] = ()


P = "srt/placement/"
G = "srt/scheduler_placement/"
D = "srt/distributed/"
T = "srt/placement_tools/"
NUMA = "srt/utils/numa_utils.py"

SERIES: Tuple[Patch, ...] = (
    Patch(
        "placement-value",
        "placement: the ProcessPlacement value, its policy and settings",
        "A frozen, JSON-serialisable placement per scheduler rank (node, CPUs, memory "
        "policy, strategy and the reasons), the policy that decides it, and the new "
        "settings (SGLANG_NUMA_AFFINITY_MODE, SGLANG_CPU_OMP_THREADS_BIND, "
        "SGLANG_SYSFS_ROOT) in envs, each checked where it is read.",
        "tests/test_resolve.py (policy, settings), tests/test_input_bounds.py (cpulists)",
        "Nothing yet: no caller uses it.",
        files=(
            "srt/environ.py",
            P + "cpulist.py",
            P + "types.py",
            P + "settings.py",
            P + "policy.py",
        ),
    ),
    Patch(
        "topology",
        "placement: host topology read once from a sysfs root, and its capture",
        "Sparse node ids, memory-only nodes, offline CPUs, PCI numa_node -1, kernels "
        "without NUMA, and a restricted process, read into frozen values from /sys or "
        "a snapshot; capture saves the files it reads.",
        "tests/test_topology.py, tests/test_capture.py",
        "Nothing yet.",
        files=(P + "topology.py",),
    ),
    Patch(
        "devices",
        "placement: which physical device, and PCI address, a logical index names",
        "CUDA_VISIBLE_DEVICES (indices, UUIDs, prefixes), Ray's ids and "
        "ZE_AFFINITY_MASK (in Level Zero's order) to a PCI address; NVML optional.",
        "tests/test_devices.py",
        "Nothing yet.",
        files=(P + "devices.py",),
    ),
    Patch(
        "bind-in-process",
        "placement: binding a running process with libnuma",
        "Every thread's CPUs, the memory policy (bind, then preferred, then CPU only) "
        "and the pages touched before the bind, with upstream's failure policy.",
        "tests/test_libnuma.py, tests/test_apply_inprocess.py, tests/test_vm_inprocess.py",
        "Nothing yet.",
        files=(P + "libnuma.py", P + "apply.py"),
    ),
    Patch(
        "numactl-ladder",
        "placement: numactl's probe ladder picks how a placement is applied",
        "--membind, then --preferred, then CPU only, each option set probed once, "
        "with upstream's warning wording; in-process only where the rank can bind "
        "itself.",
        "tests/test_resolve.py (ladder)",
        "Nothing yet.",
        files=(P + "numactl.py", P + "strategy.py"),
    ),
    Patch(
        "resolve",
        "placement: the pure decision, on sglang's own rank arithmetic",
        "Where one rank runs from host facts and policy alone (node, socket, "
        "exclusive and core-complex modes, a GPU's share of its node from sysfs "
        "alone); the engine's and the data-parallel controller's gpu_id formulas "
        "in one place.",
        "tests/test_resolve.py",
        "Nothing yet.",
        files=(P + "resolve.py", P + "ranks.py"),
    ),
    Patch(
        "place-gpu-id",
        "placement: the placement of the rank a GPU id names",
        "Identifies only that device, under the CUDA_VISIBLE_DEVICES in force; CPU "
        "ranks from SGLANG_CPU_OMP_THREADS_BIND as bootstrap reads it (router mode "
        "included); every local rank as sglang's launchers will start it.",
        "tests/test_resolve.py, tests/test_plan_cli.py",
        "Nothing yet.",
        files=(P + "plan.py", P + "cpu_groups.py", P + "__init__.py"),
    ),
    Patch(
        "spawn-hook",
        "scheduler_placement: start a spawned scheduler under its placement",
        "A thread-local wrapper of multiprocessing.util.spawnv_passfds puts numactl in "
        "front of a spawned child's command line only (by its structure), survives "
        "other wrappers, writes no file; the failure policy acts before the spawn.",
        "tests/test_spawn_hook.py, tests/test_spawn_path.py",
        "Nothing yet: configure_subprocess uses it in the next patches.",
        files=(G + "__init__.py", G + "spawn.py"),
    ),
    Patch(
        "numa-utils-discovery",
        "numa_utils: find a GPU's node through placement's device identity",
        "_query_numa_node_for_gpu names the node of the device's PCI address, found "
        "through the visibility variable in force (NVML optional); upstream's XPU "
        "helpers give way to placement's, in Level Zero's order.",
        "tests/upstream/registered/utils/test_numa_utils.py (_query_numa_node_for_gpu), "
        "tests/upstream/registered/utils/test_numa_utils_xpu.py",
        "get_numa_node_if_available answers from the PCI numa_node, without NVML's "
        "memory-affinity mask.",
        partial=(
            Partial(
                NUMA,
                replace=("_query_numa_node_for_gpu",),
                add_before={
                    "_query_numa_node_for_gpu": ("_platform_flag", "_host_topology")
                },
                remove=(
                    "_list_xpu_pci_addresses",
                    "_is_integrated_xpu",
                    "_xpu_pci_sort_key",
                    "_xpu_visible_device_indices",
                    "_xpu_visible_pci_addresses",
                    "_xpu_pci_address",
                    "_read_pci_numa_node",
                    "_query_numa_node_for_xpu",
                ),
                imports=("from sglang.srt.placement import settings",),
            ),
        ),
    ),
    Patch(
        "configure-subprocess",
        "numa_utils: configure_subprocess, numa_bind_to_node, init_threads_binding on the placement",
        "Each spawn inside configure_subprocess(server_args, gpu_id) starts under the "
        "placement of that GPU id (CPU-device ranks too); numa_bind_to_node moves "
        "every thread; init_threads_binding reads the setting as plan does.",
        "tests/test_spawn_path.py, tests/test_numa_utils.py, tests/upstream/, "
        "tests/test_vm_spawn.py, tests/test_upstream_shapes.py",
        "CPU-device ranks start under numactl (SGLANG_NUMA_BIND_V2=0 restores "
        "upstream); a rank less bound than intended gets one WARNING, or an error "
        "before any child starts under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.",
        files=(NUMA,),
    ),
    Patch(
        "ray-actor",
        "ray: scheduler actors bind themselves to their own GPU's node",
        "Each SchedulerActor places the GPU Ray gave it, by Ray's id, with the spawn "
        "path's place_gpu_id, and binds in-process before its Scheduler exists: every "
        "thread, the memory policy, the pages touched so far. _create_scheduler_actor "
        "stays as upstream wrote it.",
        "tests/test_ray_actors.py, tests/test_upstream_shapes.py (Ray), "
        "tests/test_vm_inprocess.py",
        "Ray scheduler actors on nodes with several GPUs are bound to their own GPU's "
        "node, all threads, pages moved (they were unbound, or bound to the wrong "
        "node, from one thread).",
        files=(G + "ray_rank.py", "srt/ray/scheduler_actor.py"),
    ),
    Patch(
        "shm-namespace",
        "distributed: an explicit ShmNamespace for the CPU collective's segments",
        "An engine's /dev/shm segment names from its own init address, never from "
        "MASTER_ADDR/MASTER_PORT; bounded, validated, errors that show the value.",
        "tests/test_bootstrap.py, tests/test_shm_hardening.py",
        "Nothing yet.",
        files=(D + "shm_namespace.py",),
    ),
    Patch(
        "shm-bootstrap",
        "bootstrap: per-engine segment names, unlinked once every rank has mapped them",
        "_init_cpu_threads_env hands the kernel an explicit namespace per pipeline "
        "stage (LOCAL_SIZE stays as upstream sets it); another user's file under its "
        "names, a full or read-only /dev/shm are errors naming the path and the fix; "
        "_init_parallel_groups unlinks the names after a barrier on the TP group.",
        "tests/test_bootstrap_engines.py, tests/test_bootstrap.py, "
        "tests/test_shm_errors.py, tests/test_upstream_shapes.py (bootstrap)",
        "Co-located CPU engines and pipeline stages no longer share segments, and a "
        "killed engine leaves nothing in /dev/shm.",
        files=(D + "shm_collective.py", "srt/distributed/bootstrap.py"),
    ),
    Patch(
        "tools-plan",
        "placement_tools: python -m sglang.srt.placement_tools plan",
        "One line per rank saying what sglang's launch path will do and why, or JSON; "
        "bounded input. A package on top: nothing below imports it.",
        "tests/test_plan_cli.py, tests/test_cli_fuzz.py, tests/test_input_bounds.py",
        "A new command.",
        files=(T + "__init__.py", T + "__main__.py", T + "plan_args.py"),
    ),
    Patch(
        "tools-capture-read-back",
        "placement_tools: capture a host's topology, read a rank's binding back",
        "capture saves the sysfs files placement reads, for plan --sysfs-root; the "
        "read-back gives CPUs, allowed memory nodes, memory policy and where the "
        "pages are, compared with the placement.",
        "tests/test_capture.py, tests/test_observe.py",
        "plan for another host from its snapshot.",
        files=(T + "capture.py", T + "observe.py"),
    ),
    Patch(
        "tools-verify",
        "placement_tools: verify through sglang's own launchers",
        "Probe ranks started inside configure_subprocess and through "
        "_create_scheduler_actor report their binding from inside.",
        "tests/test_verify.py, tests/test_ray_verify.py, tests/test_ray_verify_cli.py",
        "verify says, rank by rank, whether the launch path bound each rank as planned.",
        files=(T + "verify.py", T + "verify_ray.py"),
    ),
)


# --------------------------------------------------------------------------- intermediate states


def _spans(source: str) -> Dict[str, Tuple[int, int]]:
    """Top-level definition name -> (first line, last line), 1-based, decorators included."""
    spans = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            spans[node.name] = (first, node.end_lineno)
    return spans


def intermediate(upstream: str, final: str, partial: Partial) -> str:
    """``upstream`` with ``partial``'s definitions taken from ``final``, removed, or added."""
    ours, theirs = _spans(final), _spans(upstream)
    final_lines = final.splitlines(keepends=True)
    lines = upstream.splitlines(keepends=True)

    def block(name: str) -> List[str]:
        first, last = ours[name]
        return final_lines[first - 1 : last] + ["\n", "\n"]

    edits: List[Tuple[int, int, List[str]]] = []  # (start, end) 0-based half-open
    for name in partial.remove:
        first, last = theirs[name]
        edits.append((first - 1, _gap_end(lines, last), []))
    for name in partial.replace:
        first, last = theirs[name]
        added = [
            line for extra in partial.add_before.get(name, ()) for line in block(extra)
        ]
        edits.append((first - 1, _gap_end(lines, last), added + block(name)))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = new
    text = "".join(lines).rstrip("\n") + "\n"
    if partial.imports:
        tree = ast.parse(text)
        last_import = max(
            n.end_lineno
            for n in tree.body
            if isinstance(n, (ast.Import, ast.ImportFrom))
        )
        out = text.splitlines(keepends=True)
        out[last_import:last_import] = [line + "\n" for line in partial.imports]
        text = "".join(out)
    return text


def _gap_end(lines: Sequence[str], last: int) -> int:
    """The index after definition line ``last`` and the blank lines that follow it."""
    end = last
    while end < len(lines) and not lines[end].strip():
        end += 1
    return end


# --------------------------------------------------------------------------- building


def _count(diff: Sequence[str]) -> int:
    return sum(
        1
        for line in diff
        if (line.startswith("+") and not line.startswith("+++ "))
        or (line.startswith("-") and not line.startswith("--- "))
    )


def build(
    changes: Sequence,
    *,
    change_type: Callable,
    unified_diff: Callable,
    refuse: Callable[[str], Exception],
) -> List[Tuple[Patch, List[str], int]]:
    """(patch, its diff lines, lines changed) for each patch of ``SERIES``, from the overlay's
    changes to a pristine package (``change_type`` builds one, ``unified_diff`` prints one).
    """
    by_rel = {c.rel: c for c in changes}
    if any(
        c.old is not None and c.kind not in ("replaced", "rewrote") for c in changes
    ):
        raise refuse(
            "--series needs a pristine sglang package (this one holds an earlier overlay)"
        )
    state = {rel: c.old for rel, c in by_rel.items()}
    claimed: Dict[str, str] = {}
    out = []
    for patch in SERIES:
        diff: List[str] = []
        for partial in patch.partial:
            change = _take(by_rel, partial.rel, patch, refuse)
            new = intermediate(
                change.old.decode(), change.new.decode(), partial
            ).encode()
            diff += _diff_of(change, state[partial.rel], new, change_type, unified_diff)
            state[partial.rel] = new
        for rel in patch.files:
            if rel in claimed:
                raise refuse(f"{rel} is in patches {claimed[rel]} and {patch.slug}")
            claimed[rel] = patch.slug
            change = _take(by_rel, rel, patch, refuse)
            diff += _diff_of(change, state[rel], change.new, change_type, unified_diff)
            state[rel] = change.new
        lines = _count(diff)
        if lines > MAX_CHANGED_LINES:
            raise refuse(
                f"patch {patch.slug} changes {lines} lines, more than {MAX_CHANGED_LINES}"
            )
        out.append((patch, diff, lines))
    left = sorted(set(by_rel) - set(claimed))
    if left:
        raise refuse(
            f"no patch of the series holds {', '.join(left)}: add it to SERIES"
        )
    return out


def _take(by_rel, rel, patch, refuse):
    if rel not in by_rel:
        raise refuse(
            f"patch {patch.slug} names {rel}, which the overlay does not change"
        )
    return by_rel[rel]


def _diff_of(change, old, new, change_type, unified_diff) -> List[str]:
    kind = "added" if old is None else "replaced"
    text, _, _ = unified_diff(
        change_type(change.rel, old, new, change.mode, kind, change.area)
    )
    return text


def header(patch: Patch, index: int, total: int) -> str:
    body = "\n".join(_wrap(patch.why))
    return (
        f"Subject: [PATCH {index}/{total}] {patch.title}\n\n{body}\n\n"
        f"Tests: {patch.tests}\nOperators notice: {patch.operators}\n---\n"
    )


def _wrap(text: str, width: int = 72) -> List[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + ([line] if line else [])


def write(out: Path, built: Sequence[Tuple[Patch, List[str], int]]) -> List[str]:
    """Write the series into ``out`` (new, or an empty directory); returns one line per patch."""
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; give a new or empty directory")
    names, summary = [], []
    for index, (patch, diff, lines) in enumerate(built, 1):
        name = f"{index:04d}-{re.sub(r'[^a-z0-9-]', '-', patch.slug)}.patch"
        (out / name).write_text(header(patch, index, len(built)) + "".join(diff))
        names.append(name)
        summary.append(f"{name}  {lines:4d} lines  {patch.title}")
    (out / "series").write_text("".join(f"{n}\n" for n in names))
    return summary
