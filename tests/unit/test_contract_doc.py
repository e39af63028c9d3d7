"""docs/contract.md is kept true by the code: where the text and the code could drift, this compares them.

- routes: the rows `| METHOD | `/path` | …` of CONTRACT §2.2 equal the RL Service app's route table, and those of
  §3.3 the gateway app's (both built in-process as the service and `openjiuwen-rl gateway` build them; nothing is
  served, nothing connects);
- error codes: the codes of the §9 table equal every code the source of both processes can put in an envelope,
  found statically (calls of the envelope and error constructors, domain-error codes, envelope dict literals);
- config keys: the keys of §8 equal the fields of `RLServiceConfig` (nested `reward_policy` included), those of
  §3.1 the AIGW-shaped aliases of `GatewayConfig`;
- metrics: the `rl_*` series of §2.3 equal those `online/metrics.py` declares;
- Redis keys: the key shapes of §5.2 equal the ones `online/store/keys.py` builds, and the invariant checker
  (`tests/support/invariants.py`) knows every one of them.

Each failure names what is missing and where, so that whoever adds a route, code, setting or key knows which row to
write (or which stale row to remove).
"""

from __future__ import annotations

import ast
import inspect
import re
import types
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from openjiuwen.agent_evolving.agent_rl.online.store import keys
from tests.support.apps import endpoints, gateway_app, service_app

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "contract.md"
PACKAGE = ROOT / "openjiuwen" / "agent_evolving" / "agent_rl"
# The two processes whose answers carry the envelope (the CLI, rail uploader and demo are clients of it).
SERVER_SOURCES = (PACKAGE / "online", PACKAGE / "gateway", PACKAGE / "common")  # common/: both processes
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
CODE_RE = re.compile(r"[a-z][a-z0-9_]*")
# Keyword arguments that carry a contract code wherever they appear (`domain_errors(not_found=…, conflict=…)`,
# `Conflict(…, code=…)`).
CODE_KEYWORDS = frozenset({"code", "not_found", "conflict", "invalid"})


# ------------------------------------------------------------------------------------------------ the document


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def section(text: str, number: str) -> str:
    """The body of the section headed `## <number>.` or `### <number>` up to the next heading of its level or above."""
    lines = text.splitlines()
    head = re.compile(rf"^(#{{2,3}}) {re.escape(number)}[. ]")
    for i, line in enumerate(lines):
        match = head.match(line)
        if match is None:
            continue
        level = len(match.group(1))
        body = []
        for follow in lines[i + 1:]:
            hashes = len(follow) - len(follow.lstrip("#"))
            if 0 < hashes <= level and follow[hashes:hashes + 1] == " ":
                break
            body.append(follow)
        return "\n".join(body)
    raise AssertionError(f"docs/contract.md has no section {number} (a heading '## {number}.' or '### {number} ')")


def table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or re.fullmatch(r"\|[\s|:-]*", line):
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def doc_routes(number: str) -> set[tuple[str, str]]:
    routes = set()
    for cells in table_rows(section(doc_text(), number)):
        if len(cells) >= 2 and cells[0] in METHODS:
            paths = ticked(cells[1])
            assert len(paths) == 1, f"docs/contract.md §{number}: row {cells[:2]} must name one path in backticks"
            routes.add((cells[0], paths[0]))
    return routes


def first_cell_names(number: str) -> set[str]:
    names: set[str] = set()
    for cells in table_rows(section(doc_text(), number)):
        names.update(ticked(cells[0]))
    return names


def describe(items: Iterable[Any]) -> str:
    return ", ".join(" ".join(i) if isinstance(i, tuple) else str(i) for i in sorted(items))


# ------------------------------------------------------------------------------------------------ routes


def app_routes(routes: Iterable[Any]) -> Iterator[tuple[str, str]]:
    """(method, path) of every endpoint, through included routers; `{name:converter}` written as `{name}`."""
    for method, path, _ in endpoints(routes):
        yield method, path


@pytest.fixture(scope="module")
def service_routes(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    return set(app_routes(service_app(tmp_path_factory.mktemp("contract-service")).routes))


@pytest.fixture(scope="module")
def gateway_routes(tmp_path_factory: pytest.TempPathFactory) -> set[tuple[str, str]]:
    return set(app_routes(gateway_app(tmp_path_factory.mktemp("contract-gateway")).routes))


def compare_routes(served: set[tuple[str, str]], documented: set[tuple[str, str]], app: str, where: str) -> None:
    undocumented, unserved = served - documented, documented - served
    problems = []
    if undocumented:
        problems.append(f"served by the {app} but missing from docs/contract.md {where}: {describe(undocumented)}")
    if unserved:
        problems.append(f"listed in docs/contract.md {where} but not served by the {app}: {describe(unserved)}")
    assert not problems, "; ".join(problems)


def test_service_routes_match_contract_2_2(service_routes: set[tuple[str, str]]) -> None:
    documented = doc_routes("2.2")
    assert len(documented) >= 20, "docs/contract.md §2.2 lost its route table"
    compare_routes(service_routes, documented, "RL Service app", "§2.2")


def test_gateway_routes_match_contract_3_3(gateway_routes: set[tuple[str, str]]) -> None:
    documented = doc_routes("3.3")
    assert len(documented) >= 20, "docs/contract.md §3.3 lost its route table"
    compare_routes(gateway_routes, documented, "gateway app", "§3.3")


def test_service_metric_names_match_contract_2_3() -> None:
    documented = {re.sub(r"\{.*", "", name) for name in ticked(section(doc_text(), "2.3")) if name.startswith("rl_")}
    source = (PACKAGE / "online" / "metrics.py").read_text(encoding="utf-8")
    declared = set(re.findall(r'"(rl_[a-z0-9_]+)"', source))
    assert declared, "online/metrics.py declares no rl_* series any more: update this test"
    problems = []
    if declared - documented:
        problems.append(
            f"series in online/metrics.py missing from docs/contract.md §2.3: {describe(declared - documented)}"
        )
    if documented - declared:
        problems.append(f"series in docs/contract.md §2.3 that online/metrics.py does not declare: "
                        f"{describe(documented - declared)}")
    assert not problems, "; ".join(problems)


# ------------------------------------------------------------------------------------------------ error codes


def _module_constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(
            node.value, ast.Constant
        ) and isinstance(node.value.value, str):
            out[node.target.id] = node.value.value
    return out


def _strings(node: ast.AST | None, constants: dict[str, str]) -> list[str]:
    """The string values an expression can take, as far as they are written in the source (`a or "x"`, `NAME`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in constants:
        return [constants[node.id]]
    if isinstance(node, ast.BoolOp):
        return [s for value in node.values for s in _strings(value, constants)]
    if isinstance(node, ast.IfExp):
        return _strings(node.body, constants) + _strings(node.orelse, constants)
    return []  # a pass-through (`exc.code`): the code was counted where it was written


def _callee(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _sources() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text(encoding="utf-8"), str(path)))
            for root in SERVER_SOURCES for path in sorted(root.rglob("*.py"))]


def code_positions(trees: list[tuple[Path, ast.Module]]) -> dict[str, set[int]]:
    """Callable name → positional index of its `code` parameter, for every function and exception class of the two
    processes that takes a code positionally (`envelope(status, code, message)`, `ApiError(status, code, message)`,
    `InvalidInput(code, message)`, …). Derived from the definitions, so a new constructor is found by itself."""
    positions: dict[str, set[int]] = {}
    for _, tree in trees:
        for node in ast.walk(tree):
            classes = [node] if isinstance(node, ast.ClassDef) else []
            functions = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
            for cls in classes:
                for item in cls.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == "__init__":
                        names = [a.arg for a in item.args.posonlyargs + item.args.args][1:]  # without self
                        if "code" in names:
                            positions.setdefault(cls.name, set()).add(names.index("code"))
            for fn in functions:
                if fn.name == "__init__":
                    continue
                names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
                if names[:1] in (["self"], ["cls"]):
                    names = names[1:]
                if "code" in names:
                    positions.setdefault(fn.name, set()).add(names.index("code"))
    return positions


def emitted_codes() -> dict[str, set[str]]:
    """Every error code the RL Service and gateway sources can answer with → the files that write it."""
    trees = _sources()
    positions = code_positions(trees)
    found: dict[str, set[str]] = {}

    def add(values: list[str], path: Path) -> None:
        for value in values:
            if CODE_RE.fullmatch(value):
                found.setdefault(value, set()).add(str(path.relative_to(ROOT)))

    for path, tree in trees:
        constants = _module_constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for index in positions.get(_callee(node) or "", ()):
                    if index < len(node.args):
                        add(_strings(node.args[index], constants), path)
                for keyword in node.keywords:
                    if keyword.arg in CODE_KEYWORDS:
                        add(_strings(keyword.value, constants), path)
            elif isinstance(node, ast.ClassDef):  # `class RewardConflict(Conflict): code = "reward_conflict"`
                for item in node.body:
                    if isinstance(item, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == "code" for t in item.targets
                    ):
                        add(_strings(item.value, constants), path)
            elif isinstance(node, ast.Dict):  # a hand-written envelope `{"code": "…", "message": …}`
                for key, value in zip(node.keys, node.values):
                    if isinstance(key, ast.Constant) and key.value == "code":
                        add(_strings(value, constants), path)
    return found


def test_scanner_finds_the_known_constructors() -> None:
    """The static scan is only as good as its view of the constructors: it must see the ones in use today."""
    positions = code_positions(_sources())
    for name, index in (("envelope", 1), ("ApiError", 1), ("LoraError", 0), ("InvalidInput", 0),
                        ("_send_error", 2), ("envelope_bytes", 0)):
        assert index in positions.get(name, set()), f"the code scanner no longer sees {name}(…code…)"
    found = emitted_codes()
    for code in ("invalid_request", "internal_error", "payload_too_large", "reward_conflict", "insufficient_samples",
                 "invalid_rail_batch", "upstream_unavailable", "invalid_signature"):
        assert code in found, f"the code scanner no longer finds {code!r}"


def test_error_codes_match_contract_9() -> None:
    documented = first_cell_names("9")
    assert len(documented) >= 30, "docs/contract.md §9 lost its error-code table"
    found = emitted_codes()
    undocumented = {code: sorted(files) for code, files in found.items() if code not in documented}
    stale = documented - set(found)
    problems = []
    if undocumented:
        problems.append("error codes the code can answer with but missing from the table of docs/contract.md §9: "
                        + "; ".join(f"{code} (in {', '.join(files)})" for code, files in sorted(undocumented.items())))
    if stale:
        problems.append(f"error codes listed in docs/contract.md §9 that no code emits: {describe(stale)}")
    assert not problems, "; ".join(problems)


# ------------------------------------------------------------------------------------------------ config keys


def _models_in(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """('model' | 'list' | 'dict', Model) when the field holds a nested model, directly or in a list or dict."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "model", annotation
    if origin is typing.Annotated:
        return _models_in(args[0])
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            found = _models_in(arg)
            if found is not None:
                return found
        return None
    if origin is list and args:
        inner = _models_in(args[0])
        return ("list", inner[1]) if inner is not None else None
    if origin is dict and len(args) == 2:
        inner = _models_in(args[1])
        return ("dict", inner[1]) if inner is not None else None
    return None


def config_keys(model: type[BaseModel], *, by_alias: bool, prefix: str = "") -> tuple[set[str], set[str]]:
    """(leaf keys, section keys) of a config model as written in its file: `a.b`, `list[].field`, `dict.<name>.f`."""
    leaves: set[str] = set()
    sections: set[str] = set()
    for name, field in model.model_fields.items():
        key = prefix + ((field.alias or name) if by_alias else name)
        nested = _models_in(field.annotation)
        if nested is None:
            leaves.add(key)
            continue
        kind, inner = nested
        sections.add(key)
        child = {"model": key + ".", "list": key + "[].", "dict": key + ".<name>."}[kind]
        sub_leaves, sub_sections = config_keys(inner, by_alias=by_alias, prefix=child)
        leaves |= sub_leaves
        sections |= sub_sections
    return leaves, sections


def compare_keys(leaves: set[str], sections: set[str], documented: set[str], what: str, where: str) -> None:
    problems = []
    if leaves - documented:
        problems.append(f"{what} keys missing from docs/contract.md {where}: {describe(leaves - documented)}")
    if documented - leaves - sections:
        problems.append(f"keys in docs/contract.md {where} that {what} does not have: "
                        f"{describe(documented - leaves - sections)}")
    assert not problems, "; ".join(problems)


def test_service_config_keys_match_contract_8() -> None:
    from openjiuwen.agent_evolving.agent_rl.online.config import RLServiceConfig

    leaves, sections = config_keys(RLServiceConfig, by_alias=False)
    assert "reward_policy.sources.<name>.weight" in leaves  # nested sections are walked
    compare_keys(leaves, sections, first_cell_names("8"), "RLServiceConfig", "§8")


def test_gateway_config_keys_match_contract_3_1() -> None:
    from openjiuwen.agent_evolving.agent_rl.gateway.config import GatewayConfig

    leaves, sections = config_keys(GatewayConfig, by_alias=True)
    assert "onlineRL.hookTimeout" in leaves and "instances[].instanceIp" in leaves  # the AIGW (alias) names
    compare_keys(leaves, sections, first_cell_names("3.1"), "GatewayConfig", "§3.1")


# ------------------------------------------------------------------------------------------------ Redis keys

# A valid sample value for each builder parameter; the shape replaces it by `{parameter}` again.
_SAMPLE_ARGS: dict[str, Any] = {
    "t": "Tq7task", "s": "Sq7session", "c": "Cq7capture", "u": "Uq7turn", "r": "run-0123456789ab",
    "sample_id": "Xq7sample", "owner": "Oq7owner", "version": "Vq7version", "trajectory_id": "Jq7traj",
    "step": 987654321, "digest_hex": "0123456789abcdef0123456789abcdef", "source": "srcq7",
    "ro": "ro-0123456789ab", "lineage": "lq7lineage", "policy_version": "Pq7policy",
}
_STATUS_SAMPLES = ("active", "pending")  # `tasks_by_status` takes Task statuses, `traj_index` sample statuses


def _shape(builder: Any) -> str:
    params = list(inspect.signature(builder).parameters)
    unknown = [p for p in params if p not in _SAMPLE_ARGS and p != "status"]
    assert not unknown, (f"keys.{builder.__name__} has parameters {unknown} this test has no sample value for: "
                         "add them to _SAMPLE_ARGS")
    for status in _STATUS_SAMPLES:
        args = {p: (status if p == "status" else _SAMPLE_ARGS[p]) for p in params}
        try:
            key = builder(**args)
        except (ValueError, TypeError):
            if "status" in params:
                continue
            raise
        for name, value in args.items():
            key = key.replace(str(value), "{" + name + "}")
        return key
    raise AssertionError(f"keys.{builder.__name__} accepts none of the sample statuses {_STATUS_SAMPLES}")


def code_key_shapes() -> dict[str, str]:
    """Key shape → the name in `online/store/keys.py` that builds it (constants and builder functions)."""
    shapes = {}
    for name, value in vars(keys).items():
        if name.startswith("_"):
            continue
        if isinstance(value, str) and value.startswith(keys.PREFIX) and value != keys.PREFIX:
            shapes[value] = name
        elif inspect.isfunction(value) and value.__module__ == keys.__name__:
            shape = _shape(value)
            if shape.startswith(keys.PREFIX):
                shapes[shape] = f"{name}()"
    return shapes


def test_redis_keys_match_contract_5_2() -> None:
    documented = {k for k in first_cell_names("5.2") if k.startswith(keys.PREFIX)}
    assert len(documented) >= 25, "docs/contract.md §5.2 lost its key table"
    built = code_key_shapes()
    undocumented = {shape: name for shape, name in built.items() if shape not in documented}
    stale = documented - set(built)
    problems = []
    if undocumented:
        problems.append("Redis keys built in online/store/keys.py but missing from docs/contract.md §5.2: "
                        + ", ".join(f"{shape} (keys.{name})" for shape, name in sorted(undocumented.items())))
    if stale:
        problems.append(f"Redis keys in docs/contract.md §5.2 that online/store/keys.py does not build: "
                        f"{describe(stale)}")
    assert not problems, "; ".join(problems)


def test_invariant_checker_knows_every_documented_key() -> None:
    """tests/support/invariants.py refuses keys of unknown shape: every key of §5.2 must have one there."""
    from tests.support.invariants import classify_key

    unknown = []
    for shape in first_cell_names("5.2"):
        if not shape.startswith(keys.PREFIX):
            continue
        key = shape
        for name, value in {**_SAMPLE_ARGS, "status": "pending" if "traj_idx" in shape else "active"}.items():
            key = key.replace("{" + name + "}", str(value))
        if classify_key(key) is None:
            unknown.append(shape)
    assert not unknown, f"keys of docs/contract.md §5.2 that tests/support/invariants.py KEY_SHAPES lacks: {unknown}"
