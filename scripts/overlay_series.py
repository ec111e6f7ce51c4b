"""The overlay as a patch series for review: one idea per patch, in an order where each builds on the last.

``overlay.py --series OUT CHECKOUT`` (a pristine sglang checkout: ``python/sglang``
and ``test/``, left untouched) writes ``OUT/series`` (the patch names in order)
and ``OUT/NNNN-<slug>.patch``. Each patch is a short header (``Subject:``, what
and why, the tests it adds, what an operator notices) and a unified diff with
paths relative to the checkout, so ``git apply -p1`` at its root applies them in
order, and after the last the checkout is what ``overlay.py CHECKOUT`` makes.
``--series OUT PACKAGE_DIR`` writes the same series for a package dir (paths
``sglang/...``, applied from its parent) without the test files: a package has
no ``test/``.

``SERIES`` names every file by its path in a checkout. Each file belongs to
exactly one patch, at its final content, except that ``Partial`` states may come
first. Every patch that changes ``python/`` adds tests in upstream's layout
(``test/registered/<area>/test_*.py``: ``unittest``, ``register_cpu_ci``), says
what an operator notices, and changes at most ``MAX_CHANGED_LINES`` lines, its
tests included; the series is refused (naming the patch) otherwise.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

MAX_CHANGED_LINES = 800


@dataclass(frozen=True)
class Partial:
    """An intermediate state of a file, which a later patch brings to its final content.

    Either ``keep``: the final file's statements that define no name (docstring,
    imports, calls such as ``register_cpu_ci(...)``, ``if __name__`` blocks) and
    the top-level definitions and assignments named, in the final file's order.
    The base is not read, so a new module (or test file) can grow patch by patch.
    Or edits of upstream's module, the rest of which stays as upstream has it:
    ``replace``, ``add_before``, ``remove`` and ``imports``.
    """

    path: str
    keep: Tuple[str, ...] = ()
    replace: Tuple[str, ...] = ()
    """Definitions taken from the final module in place of upstream's."""
    add_before: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    """name -> definitions of the final module inserted before it (names upstream lacks)."""
    remove: Tuple[str, ...] = ()
    imports: Tuple[str, ...] = ()
    """``from X import ...`` lines: each replaces upstream's import from X, or is added where isort puts it."""


@dataclass(frozen=True)
class Patch:
    slug: str
    title: str
    why: str
    operators: str
    """What an operator notices once this patch is in: never "Nothing yet"."""
    files: Tuple[str, ...] = ()
    """Checkout paths (python/sglang/..., test/registered/...) this patch brings to their final content."""
    partial: Tuple[Partial, ...] = ()


PY = "python/sglang/"
TEST = "test/"
P = PY + "srt/placement/"
G = PY + "srt/scheduler_placement/"
D = PY + "srt/distributed/"
T = PY + "srt/placement_tools/"
NUMA = PY + "srt/utils/numa_utils.py"
UT = TEST + "registered/utils/"
PT = TEST + "registered/placement/"
DT = TEST + "registered/distributed/"
RT = TEST + "registered/ray/"
TT = TEST + "registered/placement_tools/"
LATER = "Launches are unchanged until numa_utils uses it (numa-utils-discovery on); "

#: numa_utils in steps: each state is upstream's module with these definitions
#: taken from the final one, and the ported tests that pass on it.
NUMA_DISCOVERY = Partial(
    NUMA,
    replace=("_query_numa_node_for_gpu",),
    add_before={"_query_numa_node_for_gpu": ("_platform_flag", "_host_topology")},
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
)
NUMA_BIND = dataclasses.replace(
    NUMA_DISCOVERY,
    replace=NUMA_DISCOVERY.replace
    + (
        "get_libnuma",
        "numa_bind_to_node",
        "_node_cpus",
        "_handle_numa_bind_failure",
        "_can_set_mempolicy",
        "_is_numa_available",
        "get_numa_node_if_available",
    ),
    add_before={
        **NUMA_DISCOVERY.add_before,
        "_node_cpus": ("_node_exists",),
    },
    remove=NUMA_DISCOVERY.remove + ("_Bitmask",),
    imports=NUMA_DISCOVERY.imports + ("from typing import Any, Optional",),
)
NUMA_TESTS = UT + "test_numa_utils.py"
TESTS_DISCOVERY = (
    "NUMA_UTILS_LOGGER",
    "SPAWN_LOGGER",
    "NVIDIA",
    "GPU_CLASS",
    "MEMBIND_REFUSED",
    "CPU_REFUSED",
    "_cpulist",
    "write_sysfs",
    "write_numactl",
    "numactl_calls",
    "probes",
    "start_spawned_child",
    "_HostCase",
    "_nvml_standin",
    "_live_pci_device",
    "TestQueryNumaNodeForGpu",
)
TESTS_BIND = TESTS_DISCOVERY + (
    "TestIsNumaAvailable",
    "TestIsNumaAvailableSysfsRoot",
    "TestGetNumaNodeIfAvailable",
    "_get_gpu_info",
    "_gpu_name",
    "_query_single_numa_node_for_gpu",
    "TestGraceBlackwellNumaTopology",
    "TestB200NumaTopology",
    "TestStripMemoryArgs",
)

SERIES: Tuple[Patch, ...] = (
    Patch(
        "placement-value",
        "placement: the ProcessPlacement value, its policy and settings",
        "A frozen, JSON-serialisable placement per scheduler rank (node, CPUs, memory "
        "policy, strategy and the reasons), the policy that decides it, and the new "
        "settings (SGLANG_NUMA_AFFINITY_MODE, SGLANG_CPU_OMP_THREADS_BIND, "
        "SGLANG_SYSFS_ROOT) in envs, each checked where it is read.",
        "sglang's envs list SGLANG_NUMA_AFFINITY_MODE, SGLANG_CPU_OMP_THREADS_BIND "
        "and SGLANG_SYSFS_ROOT; launches read them from numa-utils-discovery on.",
        files=(
            PY + "srt/environ.py",
            P + "cpulist.py",
            P + "types.py",
            P + "settings.py",
            P + "policy.py",
            PT + "test_placement_settings.py",
        ),
    ),
    Patch(
        "topology",
        "placement: host topology read once from a sysfs root",
        "Sparse node ids, memory-only nodes, offline CPUs, PCI numa_node -1, kernels "
        "without NUMA, and a restricted process, read into frozen values from /sys or "
        "a snapshot.",
        LATER + "a bad SGLANG_SYSFS_ROOT tree is then reported by file.",
        files=(P + "topology.py", PT + "test_topology.py"),
    ),
    Patch(
        "devices",
        "placement: which physical device, and PCI address, a logical index names",
        "CUDA_VISIBLE_DEVICES (indices, UUIDs, prefixes), Ray's ids and "
        "ZE_AFFINITY_MASK (in Level Zero's order) to a PCI address; NVML optional.",
        LATER + "GPUs named by UUID in CUDA_VISIBLE_DEVICES are then found.",
        files=(P + "devices.py", PT + "test_devices.py"),
    ),
    Patch(
        "bind-in-process",
        "placement: binding a running process with libnuma",
        "Every thread's CPUs, the memory policy (bind, then preferred, then CPU only) "
        "and the pages touched before the bind, with upstream's failure policy.",
        "numa_bind_to_node moves every thread once numa_utils uses this (numa-bind-to-node).",
        files=(P + "libnuma.py", P + "apply.py", PT + "test_bind_in_process.py"),
    ),
    Patch(
        "numactl-ladder",
        "placement: numactl's probe ladder picks how a placement is applied",
        "--membind, then --preferred, then CPU only, each option set probed once, "
        "with upstream's warning wording; in-process only where the rank can bind "
        "itself.",
        LATER + "a node without memory then gets --preferred, not a failed start.",
        files=(P + "numactl.py", P + "strategy.py", PT + "test_numactl_ladder.py"),
    ),
    Patch(
        "resolve",
        "placement: the pure decision, on sglang's own rank arithmetic",
        "Where one rank runs from host facts and policy alone (node, socket and "
        "exclusive modes); the engine's and the data-parallel controller's gpu_id "
        "formulas in one place.",
        LATER
        + "SGLANG_NUMA_AFFINITY_MODE=exclusive then splits a node among its GPUs.",
        files=(P + "resolve.py", P + "ranks.py", PT + "test_resolve.py"),
    ),
    Patch(
        "place-gpu-id",
        "placement: the placement of the rank a GPU id names",
        "Identifies only that device, under the CUDA_VISIBLE_DEVICES in force; CPU "
        "ranks from SGLANG_CPU_OMP_THREADS_BIND as bootstrap reads it (router mode "
        "included); every local rank as sglang's launchers will start it.",
        LATER + "CPU-device ranks then get the CPUs SGLANG_CPU_OMP_THREADS_BIND gives.",
        files=(
            P + "plan.py",
            P + "cpu_groups.py",
            P + "__init__.py",
            PT + "test_place_gpu_id.py",
        ),
    ),
    Patch(
        "spawn-hook",
        "scheduler_placement: start a spawned scheduler under its placement",
        "A thread-local wrapper of multiprocessing.util.spawnv_passfds puts numactl in "
        "front of a spawned child's command line only (by its structure), survives "
        "other wrappers, writes no file; the failure policy acts before the spawn.",
        "Launches are unchanged until configure_subprocess uses it; only "
        "the scheduler child, never a helper process, then starts under numactl.",
        files=(
            G + "__init__.py",
            G + "spawn_hook.py",
            G + "spawn.py",
            PT + "test_spawn_hook.py",
        ),
    ),
    Patch(
        "numa-utils-discovery",
        "numa_utils: find a GPU's node through placement's device identity",
        "_query_numa_node_for_gpu names the node of the device's PCI address, found "
        "through the visibility variable in force (NVML optional); upstream's XPU "
        "helpers give way to placement's, in Level Zero's order.",
        "get_numa_node_if_available answers from the PCI numa_node, without NVML's "
        "memory-affinity mask.",
        partial=(NUMA_DISCOVERY, Partial(NUMA_TESTS, keep=TESTS_DISCOVERY)),
    ),
    Patch(
        "numa-bind-to-node",
        "numa_utils: numa_bind_to_node moves every thread, through placement's helpers",
        "numa_bind_to_node, _node_cpus, _can_set_mempolicy and the failure policy "
        "read the host through placement (SGLANG_SYSFS_ROOT) and bind with one "
        "libnuma loader; the numactl probe ladder's tests move to placement's.",
        "numa_bind_to_node (the legacy V1 path, Ray actors, the diffusion worker) "
        "moves every thread of the process, not only the calling one.",
        files=(UT + "test_numa_utils_xpu.py",),
        partial=(NUMA_BIND, Partial(NUMA_TESTS, keep=TESTS_BIND)),
    ),
    Patch(
        "configure-subprocess",
        "numa_utils: configure_subprocess and init_threads_binding on the placement",
        "Each spawn inside configure_subprocess(server_args, gpu_id) starts under the "
        "placement of that GPU id (CPU-device ranks too); init_threads_binding reads "
        "the setting as plan does.",
        "CPU-device ranks start under numactl (SGLANG_NUMA_BIND_V2=0 restores "
        "upstream); a rank less bound than intended gets one WARNING, or an error "
        "before any child starts under SGLANG_CRASH_ON_NUMA_BIND_FAILURE=1.",
        files=(NUMA, NUMA_TESTS),
    ),
    Patch(
        "ray-node-plan",
        "scheduler_placement: the values and node tasks of Ray's planning round",
        "Where each bundle is, which GPU ids it holds, and each node's placement for "
        "them, resolved on the node; the py_executable string checked token by token.",
        "Ray launches are unchanged until the next patch; a numactl command line "
        "with anything but its options and a path is then refused.",
        files=(G + "ray_plan.py", RT + "test_ray_plan.py"),
    ),
    Patch(
        "ray-actor",
        "ray: scheduler actors start under the placement planned on their node",
        "_create_scheduler_actor plans the placement group on its nodes (keyed by all "
        "it depends on) and starts each actor under numactl or binds it in-process, "
        "then reads its binding back, every thread included; SchedulerActor keeps "
        "upstream's contract.",
        "Ray scheduler actors are bound (they were silently unbound).",
        files=(
            G + "ray_rank.py",
            G + "ray_actors.py",
            PY + "srt/ray/scheduler_actor.py",
            PY + "srt/ray/engine.py",
            RT + "test_scheduler_actor.py",
        ),
    ),
    Patch(
        "shm-namespace",
        "distributed: an explicit ShmNamespace, and errors an operator can act on",
        "An engine's /dev/shm segment names from its own init address, never from "
        "MASTER_ADDR/MASTER_PORT; a full or read-only /dev/shm and a held lock named "
        "with the file and the fix.",
        "CPU engines are unchanged until shm-bootstrap uses it; an init address too long "
        "for a /dev/shm name is then refused with the setting to change.",
        files=(
            D + "shm_namespace.py",
            D + "shm_errors.py",
            DT + "test_shm_namespace.py",
        ),
    ),
    Patch(
        "shm-owners",
        "distributed: owner records of shared-memory segments",
        "A flock per segment, the sweep of dead owners' segments, release at exit, "
        "no trust in what another user made.",
        "CPU engines are unchanged until shm-bootstrap uses it; segments a crashed engine "
        "left in /dev/shm are then removed at the next start.",
        files=(D + "shm_segments.py", DT + "test_shm_segments.py"),
    ),
    Patch(
        "shm-bootstrap",
        "bootstrap: the CPU collective's segments named by the engine's init address",
        "_init_cpu_threads_env hands the kernel an explicit namespace per pipeline "
        "stage; LOCAL_SIZE stays as upstream sets it.",
        "Co-located CPU engines no longer share segments; pipeline stages get their own.",
        files=(
            D + "shm_collective.py",
            PY + "srt/distributed/bootstrap.py",
            DT + "test_shm_collective.py",
        ),
    ),
    Patch(
        "tools-plan",
        "placement_tools: python -m sglang.srt.placement_tools plan",
        "One line per rank saying what sglang's launch path will do and why, or JSON; "
        "bounded input. A package on top: nothing below imports it.",
        "A new command.",
        files=(
            T + "__init__.py",
            T + "__main__.py",
            T + "plan_args.py",
            TT + "test_plan.py",
        ),
    ),
    Patch(
        "tools-capture-read-back",
        "placement_tools: capture a host's topology, read a rank's binding back",
        "capture saves the sysfs files placement reads, for plan --sysfs-root; the "
        "read-back gives CPUs, allowed memory nodes, memory policy and where the "
        "pages are, compared with the placement.",
        "plan for another host from its snapshot.",
        files=(T + "capture.py", T + "observe.py", TT + "test_capture.py"),
    ),
    Patch(
        "tools-verify",
        "placement_tools: verify through sglang's own launchers",
        "Probe ranks started inside configure_subprocess and through "
        "_create_scheduler_actor report their binding from inside.",
        "verify says, rank by rank, whether the launch path bound each rank as planned.",
        files=(T + "verify.py", T + "verify_ray.py", TT + "test_verify.py"),
    ),
)


# --------------------------------------------------------------------------- intermediate states


def _names(node: ast.stmt) -> Tuple[str, ...]:
    """The top-level names a statement defines; () for imports, calls and the like."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return (node.name,)
    targets = {
        ast.Assign: lambda n: n.targets,
        ast.AnnAssign: lambda n: [n.target],
        ast.AugAssign: lambda n: [n.target],
    }.get(type(node), lambda n: [])(node)
    return tuple(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))


def kept(final: str, keep: Sequence[str]) -> str:
    """``final``'s unnamed statements and those naming one of ``keep``, spaced as black spaces them.

    Each statement carries the comments above it; two blank lines go around a
    def or class, other statements keep their own spacing, or that of the
    statements dropped before them (at most two).
    """
    lines = final.splitlines(keepends=True)
    out: List[str] = []
    previous = None
    end = 0
    dropped = 0  # the blank lines before the statements dropped since the last kept
    for node in ast.parse(final).body:
        chunk, end = lines[end : node.end_lineno], node.end_lineno
        body = list(chunk)
        while body and not body[0].strip():
            body.pop(0)
        blank = len(chunk) - len(body)
        names = _names(node)
        if names and not set(names) & set(keep):
            dropped = max(dropped, blank)
            continue
        if previous is not None and (_is_def(node) or _is_def(previous)):
            blank = 2
        out += ["\n"] * (0 if previous is None else min(max(blank, dropped), 2))
        out += body
        previous, dropped = node, 0
    return "".join(out).rstrip("\n") + "\n"


def _is_def(node: ast.stmt) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))


def _spans(source: str) -> Dict[str, Tuple[int, int]]:
    """Top-level name -> (first line, last line) of what defines it, 1-based, decorators included."""
    spans = {}
    for node in ast.parse(source).body:
        decorators = getattr(node, "decorator_list", [])
        first = min([node.lineno, *(d.lineno for d in decorators)])
        spans.update((name, (first, node.end_lineno)) for name in _names(node))
    return spans


def edited(upstream: str, final: str, partial: Partial) -> str:
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
    for line in partial.imports:
        text = _with_import(text, line)
    return text


def _with_import(text: str, line: str) -> str:
    """``text`` with the ``from X import ...`` statement ``line`` where isort puts it:
    in place of upstream's import from X, else before the first import from a module
    of X's package that sorts after X, else after the last import."""
    module = ast.parse(line).body[0].module
    lines = text.splitlines(keepends=True)
    imports = [
        n for n in ast.parse(text).body if isinstance(n, (ast.Import, ast.ImportFrom))
    ]
    from_imports = [n for n in imports if isinstance(n, ast.ImportFrom) and not n.level]
    same = [n for n in from_imports if n.module == module]
    later = [
        n
        for n in from_imports
        if n.module.split(".")[0] == module.split(".")[0]
        and n.module.lower() > module.lower()
    ]
    if same:
        start, end = same[0].lineno - 1, same[0].end_lineno
    elif later:
        start = end = later[0].lineno - 1
    else:
        start = end = imports[-1].end_lineno
    lines[start:end] = [line + "\n"]
    return "".join(lines)


def _gap_end(lines: Sequence[str], last: int) -> int:
    """The index after definition line ``last`` and the blank lines that follow it."""
    end = last
    while end < len(lines) and not lines[end].strip():
        end += 1
    return end


def intermediate(
    old: str | None, final: str, partial: Partial, where: str
) -> Tuple[str, List[str]]:
    """The state ``partial`` names, or ("", [what is wrong with it])."""
    final_names = {n for node in ast.parse(final).body for n in _names(node)}
    edits = (*partial.replace, *partial.remove, partial.imports, partial.add_before)
    named = [*partial.keep, *partial.replace]
    named += [n for names in partial.add_before.values() for n in names]
    problems = [
        f"{where} names {n}, which the final {partial.path} does not define"
        for n in named
        if n not in final_names
    ]
    if partial.keep and any(edits):
        problems.append(f"{where} both keeps and edits {partial.path}")
    elif not partial.keep and old is None:
        problems.append(
            f"{where} edits {partial.path}, which is new: name what it keeps instead"
        )
    elif not partial.keep:
        upstream_names = set(_spans(old))
        problems += [
            f"{where} replaces or removes {n}, which upstream's {partial.path} lacks"
            for n in (*partial.replace, *partial.remove)
            if n not in upstream_names
        ]
    if problems:
        return "", problems
    if partial.keep:
        return kept(final, partial.keep), []
    return edited(old, final, partial), []


# --------------------------------------------------------------------------- building


def _count(diff: Sequence[str]) -> int:
    return sum(
        1
        for line in diff
        if (line.startswith("+") and not line.startswith("+++ "))
        or (line.startswith("-") and not line.startswith("--- "))
    )


def path_of(change) -> str:
    """A change's path in a checkout, whichever form the overlay ran in."""
    return f"{TEST if change.area == 'test' else PY}{change.rel}"


def build(
    changes: Sequence,
    *,
    with_tests: bool,
    change_type: Callable,
    unified_diff: Callable,
    refuse: Callable[[str], Exception],
    series: Sequence[Patch] = SERIES,
) -> List[Tuple[Patch, List[str], int]]:
    """(patch, its diff lines, lines changed) for each patch of ``series``, from the overlay's
    changes to a pristine package or checkout (``change_type`` builds one,
    ``unified_diff`` prints one); test files are left out unless ``with_tests``.
    """
    by_path = {path_of(c): c for c in changes}
    if any(
        c.old is not None and c.kind not in ("replaced", "rewrote") for c in changes
    ):
        raise refuse(
            "--series needs a pristine sglang package (this one holds an earlier overlay)"
        )
    state = {path: c.old for path, c in by_path.items()}
    claimed: Dict[str, str] = {}
    out = []
    for index, patch in enumerate(series, 1):
        where = f"patch {index} ({patch.slug})"
        _check_header(patch, where, refuse)
        diff: List[str] = []
        steps = [(p.path, p) for p in patch.partial] + [(f, None) for f in patch.files]
        for path, partial in steps:
            if path in claimed:
                raise refuse(f"{path} is in patches {claimed[path]} and {where}")
            if partial is None:
                claimed[path] = where
            if path.startswith(TEST) and not with_tests:
                continue
            if path not in by_path:
                raise refuse(f"{where} names {path}, which the overlay does not change")
            change = by_path[path]
            new = change.new
            if partial is not None:
                text, problems = intermediate(
                    change.old and change.old.decode(), new.decode(), partial, where
                )
                if problems:
                    raise refuse("; ".join(problems))
                new = text.encode()
            kind = "added" if state[path] is None else "replaced"
            text, _, _ = unified_diff(
                change_type(
                    change.rel, state[path], new, change.mode, kind, change.area
                )
            )
            diff += text
            state[path] = new
        lines = _count(diff)
        if lines > MAX_CHANGED_LINES:
            raise refuse(
                f"{where} changes {lines} lines, more than {MAX_CHANGED_LINES}: split it"
            )
        out.append((patch, diff, lines))
    left = sorted(set(by_path) - set(claimed))
    if left:
        raise refuse(
            f"no patch of the series holds {', '.join(left)}: add it to SERIES"
        )
    return out


def _check_header(patch: Patch, where: str, refuse: Callable) -> None:
    paths = [*patch.files, *(p.path for p in patch.partial)]
    if any(p.startswith(PY) for p in paths) and not any(
        p.startswith(TEST) for p in paths
    ):
        raise refuse(
            f"{where} changes python/ but adds no test: give it a "
            f"{TEST}registered/<area>/test_*.py"
        )
    if not patch.operators.strip() or "nothing yet" in patch.operators.lower():
        raise refuse(
            f"{where}: its Operators notice says nothing an operator notices "
            f"({patch.operators!r}); make the patch change something they do"
        )


def header(patch: Patch, index: int, total: int) -> str:
    body = "\n".join(_wrap(patch.why))
    paths = [*patch.files, *(p.path for p in patch.partial)]
    tests = ", ".join(sorted({p for p in paths if p.startswith(TEST)}))
    return (
        f"Subject: [PATCH {index}/{total}] {patch.title}\n\n{body}\n\n"
        f"Tests: {tests}\nOperators notice: {patch.operators}\n---\n"
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
