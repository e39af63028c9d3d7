"""The import picture matches the process diagram: the gateway, the RL Service and the agent library are peers that
talk over HTTP only, so none of the three packages imports another; all three stand on `common/`, which imports none
of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "openjiuwen" / "agent_evolving" / "agent_rl"
ROOT_NAME = "openjiuwen.agent_evolving.agent_rl"
PEERS = ("gateway", "online", "rail")


def _imported_packages(path: Path, package: Path = PACKAGE) -> set[str]:
    """The top-level sub-packages of agent_rl that `path` imports (relative and absolute imports, anywhere)."""
    here = path.relative_to(package.parent).with_suffix("").parts  # ('agent_rl', 'gateway', 'app')
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - node.level])
                parts = base + (node.module.split(".") if node.module else [])
                if not node.module:  # `from .. import x`: each name may be a sub-package
                    candidates = [parts + [alias.name] for alias in node.names]
                else:
                    candidates = [parts]
            else:
                if not (node.module or "").startswith(ROOT_NAME):
                    continue
                candidates = [["agent_rl", *node.module[len(ROOT_NAME):].strip(".").split(".")]]
            for parts in candidates:
                if len(parts) >= 2 and parts[0] == "agent_rl" and parts[1]:
                    found.add(parts[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(ROOT_NAME + "."):
                    found.add(alias.name[len(ROOT_NAME) + 1:].split(".")[0])
    return found


def _modules(package: str) -> list[Path]:
    return sorted((PACKAGE / package).rglob("*.py"))


@pytest.mark.parametrize("package", PEERS)
def test_a_peer_package_imports_no_other_peer(package: str) -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(_imported_packages(path) & (set(PEERS) - {package}))
        for path in _modules(package)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_common_imports_nothing_above_it() -> None:
    above = {"gateway", "online", "rail", "cli", "demo", "models"}
    offenders = {str(p.relative_to(PACKAGE)): sorted(_imported_packages(p) & above) for p in _modules("common")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_checker_sees_relative_and_absolute_imports(tmp_path: Path) -> None:
    # The guard must be able to fail: a gateway module importing online/ and rail/ in three spellings is caught.
    probe = tmp_path / "agent_rl" / "gateway" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from ..online.ids import x\nimport openjiuwen.agent_evolving.agent_rl.rail.agent_rail\n"
                     "from .. import common\nfrom ..common.ids import y\n")
    assert _imported_packages(probe, tmp_path / "agent_rl") == {"online", "rail", "common"}


def _module_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in it (TYPE_CHECKING blocks and function bodies too: a
    deferred import is still an edge a reader has to follow)."""
    names = {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = own_package.split(".")[: len(own_package.split(".")) - (node.level - 1)]
                target = ".".join(base + (node.module.split(".") if node.module else []))
                for alias in node.names:  # `from . import x` names a module; `from .m import f` names m
                    graph[name].add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in names else target)
    return {name: {t for t in targets if t in names and t != name} for name, targets in graph.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while (w := stack.pop()) != v:
                part.append(w)
            if part:
                found.append(sorted([v, *part]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_import_circle() -> None:
    # A circle makes a reader follow modules round and round (issue 39 item 7: the demo's lineage rounds named the
    # driver that built them).
    assert _circles(_module_graph(PACKAGE)) == []


def test_the_circle_finder_sees_a_deferred_import(tmp_path: Path) -> None:
    pkg = tmp_path / "agent_rl"
    (pkg / "demo").mkdir(parents=True)
    (pkg / "demo" / "run.py").write_text("from .lineages import Two\n")
    (pkg / "demo" / "lineages.py").write_text("def f():\n    from . import run\n")
    (pkg / "demo" / "leaf.py").write_text("from .run import x\n")
    assert _circles(_module_graph(pkg)) == [["agent_rl.demo.lineages", "agent_rl.demo.run"]]


def test_the_store_imports_no_package_above_it() -> None:
    # online/store/ is the RL Service's ground floor (issue 39 item 3): what it needs of rewards and metrics is
    # handed in (store/reward_view.py, store/sample_metrics.py), the fence lives beside tx.py, the listing backfill
    # is a leader job beside leader_duties.py. Only the service-wide base modules (errors, transitions) are allowed.
    online = PACKAGE / "online"
    graph = _module_graph(PACKAGE)
    store = {name for name in graph if name.startswith("agent_rl.online.store")}
    allowed = {"agent_rl.online.errors", "agent_rl.online.transitions"}
    upward = {name: sorted(t for t in graph[name] if t.startswith("agent_rl.online.") and t not in store
                           and t not in allowed) for name in store}
    assert online.is_dir() and {k: v for k, v in upward.items() if v} == {}
