"""The project's modules only point down: placement, then the glue sglang's launchers call, then the tools.

``placement`` (host facts, the pure decision, the ways to apply it) imports
nothing of the project's but ``environ``, and within it ``settings`` sits below the
decision and device discovery; ``utils.numa_utils`` is the glue sglang's own
launchers call; the owned ``ray.scheduler_actor`` and upstream's modules sit above
it; ``placement_tools`` (plan, verify, capture and the read-back) drives sglang's
launch path, so it sits on top, and nothing imports it.

Read from the source (every import, function-level ones included), not from
what happens to be loaded, so a lazy import cannot hide a circle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRT = Path(__file__).resolve().parents[1] / "python" / "sglang" / "srt"


def layer(module: str) -> str | None:
    """The top-level part of the package a module belongs to (upstream modules by their own name)."""
    parts = module.split(".")
    if parts[:2] != ["sglang", "srt"] or len(parts) < 3:
        return None
    rest = parts[2:]
    if rest[0] in ("placement", "placement_tools", "distributed"):
        return rest[0]
    return ".".join(rest[:2])


def import_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in SRT.rglob("*.py"):
        rel = path.relative_to(SRT.parents[1]).with_suffix("")
        source = layer(".".join(p for p in rel.parts if p != "__init__"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                target = layer(name)
                if target and target != source:
                    edges[source].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, path)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return []

    for start in sorted(edges):
        if start not in state:
            found = visit(start, [])
            if found:
                return found
    return []


def test_no_import_circle_between_the_packages_parts():
    assert find_cycle(import_graph()) == []


def test_placement_imports_only_environ_and_the_glue_imports_no_actor_nor_tools():
    edges = import_graph()
    # ServerArgs is named for type hints only (under TYPE_CHECKING).
    assert edges["placement"] <= {"environ", "server_args"}, edges["placement"]
    assert "ray.scheduler_actor" not in edges["utils.numa_utils"]
    assert "placement" in edges["utils.numa_utils"]
    # Nothing but the tools themselves imports the tools.
    assert [s for s, t in edges.items() if "placement_tools" in t] == []
    # The tools drive sglang's own launch path.
    assert "ray.engine" in edges["placement_tools"]
    assert edges["placement_tools"] & {"utils", "utils.numa_utils"}


def test_settings_sit_below_the_decision_and_device_discovery():
    tree = ast.parse((SRT / "placement" / "settings.py").read_text(encoding="utf-8"))
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    placement = {m for m in imported if m.startswith("sglang.srt.placement.")}
    assert placement <= {
        "sglang.srt.placement.cpulist",
        "sglang.srt.placement.types",
    }, placement


def test_no_module_names_the_removed_launchers():
    removed = (
        "scheduler_launch",
        "scheduler_rank",
        "run_ranks_ray",
        "ray_launcher",
        "lifeline",
        "ray_plan",
        "py_executable",
        "scheduler_actor_class",
    )
    root = SRT.parents[2]
    found = []
    for path in [*SRT.rglob("*.py"), *(root / "scripts").glob("*")]:
        text = path.read_text(encoding="utf-8")
        found += [
            f"{path.relative_to(root)}: {name}" for name in removed if name in text
        ]
    assert found == []
