"""common/wire/routes.py is the one table of the RL Service's routes: held here to the RL Service app (every route
has an entry, every entry a route) and to the gateway app (each route flagged as proxied is proxied, with the key
it is flagged for, and nothing else is), and its derived rules (retry, leader relay) keep their meaning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from openjiuwen.agent_evolving.agent_rl.common.wire import routes as rl_routes
from openjiuwen.agent_evolving.agent_rl.common.wire.routes import Gateway, Route, idempotent, leader_only
from tests.support.apps import endpoints, gateway_app, service_app

Served = dict[tuple[str, str], Any]  # (method, path) → route


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return {(m, p): r for m, p, r in endpoints(service_app(tmp_path_factory.mktemp("wire-service")).routes)}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Served:
    return {(m, p): r for m, p, r in endpoints(gateway_app(tmp_path_factory.mktemp("wire-gateway")).routes)}


def table_problems(served: set[tuple[str, str]], table: tuple[Route, ...]) -> list[str]:
    listed = {(r.method, r.path) for r in table}
    problems = []
    if served - listed:
        problems.append(f"served by the RL Service, no entry in common/wire/routes.py: {sorted(served - listed)}")
    if listed - served:
        problems.append(f"in common/wire/routes.py, not served by the RL Service: {sorted(listed - served)}")
    if len(listed) != len(table):
        problems.append("common/wire/routes.py lists a route twice")
    return problems


def _how_served(route: Any) -> Gateway:
    """How the gateway serves a route: proxied for the operator key, for an agent key, or by its own handler."""
    from openjiuwen.agent_evolving.agent_rl.gateway.routes import control
    from openjiuwen.agent_evolving.agent_rl.gateway.routes.deps import agent_signed, api_signed_body

    guards = {d.dependency for d in route.dependencies}
    if route.endpoint is control.proxied and guards == {api_signed_body}:
        return Gateway.OPERATOR
    if route.endpoint is control.agent_proxied and guards == {agent_signed}:
        return Gateway.AGENT
    return Gateway.OWN


def gateway_problems(gateway: Served, table: tuple[Route, ...]) -> list[str]:
    from openjiuwen.agent_evolving.agent_rl.gateway.routes import control

    flags = {(r.method, r.path): r.gateway for r in table}
    problems = []
    for r in table:
        if r.gateway is None:
            continue
        served = gateway.get((r.method, r.path))
        if served is None:
            problems.append(f"{r.method} {r.path}: flagged {r.gateway}, not served by the gateway")
        elif _how_served(served) is not r.gateway:
            problems.append(f"{r.method} {r.path}: flagged {r.gateway}, served as {_how_served(served)}")
    for (method, path), route in gateway.items():
        if route.endpoint in (control.proxied, control.agent_proxied) and flags.get((method, path)) not in (
            Gateway.OPERATOR, Gateway.AGENT
        ):
            problems.append(f"{method} {path}: proxied by the gateway, not flagged so in common/wire/routes.py")
    return problems


def test_every_service_route_has_one_entry_and_every_entry_a_route(service: Served) -> None:
    assert len(service) >= 30, "the RL Service app lost its routes: update this test"
    assert table_problems(set(service), rl_routes.RL_API) == []


def test_the_gateway_serves_each_flagged_route_as_flagged(gateway: Served) -> None:
    assert rl_routes.proxied(Gateway.OPERATOR) and rl_routes.proxied(Gateway.AGENT)
    assert gateway_problems(gateway, rl_routes.RL_API) == []


def test_the_checks_can_fail(service: Served, gateway: Served) -> None:
    # A route the service serves but the table lacks, and an entry no route matches, are both named.
    stale = Route("GET", "/v1/rl/nothing")
    problems = table_problems(set(service), (*rl_routes.RL_API[1:], stale))
    assert len(problems) == 2 and "/health" in problems[0] and "/v1/rl/nothing" in problems[1]
    # A proxied route flagged for the wrong key, or not flagged at all, and a flagged route the gateway lacks.
    wrong = tuple(Route(r.method, r.path, Gateway.AGENT) if r is rl_routes.RUN_LIST else r
                  for r in rl_routes.RL_API if r is not rl_routes.POLICIES)
    problems = gateway_problems(gateway, (*wrong, Route("POST", "/v1/rl/nothing", Gateway.OPERATOR)))
    assert len(problems) == 3, problems
    assert any("/v1/rl/training/runs" in p and "served as operator" in p for p in problems)
    assert any("/v1/rl/policies" in p and "not flagged" in p for p in problems)
    assert any("/v1/rl/nothing" in p and "not served" in p for p in problems)


@pytest.mark.parametrize("method, path, expected", [
    ("GET", "/v1/rl/anything", True),
    ("HEAD", "/v1/rl/tasks", True),
    ("POST", "/v1/rl/tasks/start", True),
    ("POST", "/v1/rl/tasks/t1/stop", True),
    ("POST", "/v1/rl/tasks/t1/reward", True),
    ("POST", "/v1/rl/tasks/a%2Fb/stop", True),  # an escaped `/` stays inside its segment
    ("POST", "/v1/rl/tasks/a/b/stop", False),
    ("POST", "/v1/rl/training/runs", False),
    ("POST", "/v1/rl/trajectories/rewards", False),
    ("POST", "/v1/rl/tasks/t1/stop/", False),
])
def test_the_retry_rule_is_that_of_the_flags(method: str, path: str, expected: bool) -> None:
    assert idempotent(method, path) is expected


def test_the_leader_routes_are_the_runner_the_rollout_controller_and_the_lineage_lifecycle() -> None:
    flagged = {(r.method, r.path) for r in rl_routes.LEADER_ROUTES}
    assert flagged == {
        ("POST", "/v1/rl/training/runs"), ("POST", "/v1/rl/training/runs/{training_run_id}/stop"),
        ("POST", "/v1/rl/rollout/promote"), ("POST", "/v1/rl/rollout/rollback"), ("POST", "/v1/rl/rollout/pause"),
        ("POST", "/v1/rl/rollout/resume"), ("POST", "/v1/rl/loras/activate"),
        ("POST", "/v1/rl/lineages/{lineage}/archive"), ("POST", "/v1/rl/lineages/{lineage}/restore"),
        ("POST", "/v1/rl/lineages/{lineage}/delete"),
    }
    assert leader_only("POST", "/v1/rl/rollout/pause") and not leader_only("POST", "/v1/rl/rollout/status")
    assert not leader_only("POST", "/v1/rl/lineages/x/pause") and leader_only("POST", "/v1/rl/lineages/x/delete")


def test_fill_keeps_each_value_one_segment() -> None:
    assert rl_routes.TASK_ABORT.fill("t1") == "/internal/v1/rl/tasks/t1:abort"
    assert rl_routes.TASK_EVENTS.fill("a/b?c") == "/v1/rl/tasks/a%2Fb%3Fc/events"
    assert rl_routes.TRAJECTORY.fill("s:0") == "/v1/rl/trajectories/s:0"


def test_no_wire_name_is_spelled_outside_common() -> None:
    """The gateway and the RL Service spell no RL API path, wire header or wire env name themselves (docstrings
    and comments aside): they import them from common/wire."""
    import ast

    from openjiuwen.agent_evolving.agent_rl.common.wire import env, headers

    package = Path(rl_routes.__file__).resolve().parents[2]
    generic = {rl_routes.HEALTH.path, rl_routes.METRICS.path, rl_routes.OPENAPI.path}  # every server has its own
    names = {r.path for r in rl_routes.RL_API} - generic
    names |= {v for k, v in vars(headers).items() if k.isupper()} | {v for k, v in vars(env).items() if k.isupper()}
    spelled = []
    for part in ("gateway", "online"):
        for path in sorted((package / part).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value in names or node.value.lower() in names
                ):
                    spelled.append(f"{path.relative_to(package)}:{node.lineno} {node.value!r}")
    assert spelled == []


def test_the_relay_of_every_served_route_follows_the_flag_it_is_declared_with(service: Served) -> None:
    """One flag, no second list: the follower's relay (workers/forward.py asks `leader_only`) decides each route
    of the RL Service app exactly as the wire Route its router is declared with is flagged."""
    declared = {(r.method, r.path): r for r in rl_routes.RL_API}
    relayed = set()
    for method, path in service:
        route = declared[(method, path)]
        concrete = route.fill(*["x-1"] * path.count("{"))
        assert leader_only(method, concrete) is route.leader_only, (method, path)
        relayed |= {(method, path)} if route.leader_only else set()
    assert relayed == {(r.method, r.path) for r in rl_routes.LEADER_ROUTES} != set()


def test_header_names_are_shown_as_the_contract_writes_them():
    from openjiuwen.agent_evolving.agent_rl.common.wire import headers

    assert [headers.display(h) for h in (headers.SESSION_ID, headers.TASK_ID, headers.POLICY_NAME,
                                         headers.POLICY_MODEL, headers.AGENT_KEY, headers.LINEAGE)] == [
        "X-Agent-Session-Id", "X-AIGW-RL-Task-Id", "X-AIGW-RL-Policy-Name", "X-AIGW-RL-Policy-Model",
        "X-AIGW-RL-Agent-Key", "X-AIGW-RL-Lineage"]


def _spelled_paths(path: Path) -> list[str]:
    """The RL paths a module spells as string literals (an f-string's literal parts are string constants too)."""
    import ast

    return [f"{path.name}:{node.lineno}: {node.value}"
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.startswith(("/v1/rl", "/internal/"))]


CLIENTS = ("cli", "demo")


@pytest.mark.parametrize("client", CLIENTS)
def test_no_client_spells_an_rl_path(client: str) -> None:
    # Every client builds its calls from the table (Route.at / Route.fill; issue 39 item 4), so a route that moves
    # moves for all of them; a spelled path fails here.
    package = Path(rl_routes.__file__).resolve().parents[2] / client
    assert [s for p in sorted(package.rglob("*.py")) for s in _spelled_paths(p)] == []


def test_the_spelling_check_sees_plain_and_f_strings(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('a = "/v1/rl/tasks"\nb = f"/v1/rl/tasks/{a}/stop"\nc = f"GET /v1/rl/tasks answered {a}"\n')
    assert [s.split(": ", 1)[1] for s in _spelled_paths(probe)] == ["/v1/rl/tasks", "/v1/rl/tasks/"]


def test_the_gateway_control_routes_are_served(gateway: Served) -> None:
    assert [(r.method, r.path) for r in rl_routes.GATEWAY_CONTROL if (r.method, r.path) not in gateway] == []
