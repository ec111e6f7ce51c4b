"""The project's modules only point down: host facts and placement, then a rank's side, then the launchers, then the CLI.

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
    if rest[:2] == ["placement", "__main__"]:
        return "placement.__main__"
    if rest[0] in ("placement", "scheduler_launch", "scheduler_rank", "distributed"):
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
                return path[path.index(nxt):] + [nxt]
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


def test_placement_imports_no_launcher_and_a_rank_imports_no_launcher():
    edges = import_graph()
    assert edges["placement"] <= {"environ"}, edges["placement"]
    assert "scheduler_launch" not in edges["scheduler_rank"]
    assert "scheduler_launch" not in edges["ray.scheduler_actor"]
    assert "scheduler_launch" not in edges["distributed"]
