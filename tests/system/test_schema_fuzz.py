"""Schema-driven fuzzing of the RL Service over a real socket (CONTRACT §2.1, §9 "fuzzed bodies and headers").

schemathesis reads the service's own `/openapi.json` (request shapes from `api/openapi.py`) and generates, per
operation, requests that fit the schema (positive) and requests that break it in the body, headers, path or query
(negative). Each goes to the service running as a real process against the session's private Redis; the answer must
never be a 5xx and every error must be exactly the envelope. Ids in generated requests are sometimes pointed at the
seeded Tasks so that the fuzzing reaches past "unknown Task" into the capture and reward logic; Redis is restored
from a DUMP snapshot before each example, so every example starts from the same state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import Redis as SyncRedis
from schemathesis import GenerationMode

from tests.conftest import load_fixture
from tests.support.fake_gateway import FakeGateway
from tests.support.fake_judge import FakeJudge
from tests.support.fuzzing import RedisSnapshot, assert_envelope
from tests.support.service_app import start_headers
from tests.support.service_process import ServiceProcess

pytestmark = pytest.mark.system

EXAMPLES = 25  # per operation and mode: (OPERATIONS + VIOLABLE) × 25 requests
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
REQUEST = load_fixture("chat_request.json")
RESPONSE = load_fixture("chat_response.json")
INJECTED = dict(REQUEST, logprobs=True, top_logprobs=0, return_token_ids=True)

# Every operation the service publishes; a new route must be added here (and so gets fuzzed).
OPERATIONS = [
    "GET /health",
    "POST /v1/rl/tasks/start",
    "GET /v1/rl/tasks/{rl_task_id}",
    "POST /v1/rl/tasks/{rl_task_id}/stop",
    "POST /v1/rl/tasks/{rl_task_id}/reward",
    "POST /internal/v1/completions:before",
    "POST /internal/v1/completions:after",
    "POST /internal/v1/completions:discard",
    "POST /internal/v1/rl/tasks/{rl_task_id}:finish",
    "POST /internal/v1/rl/tasks/{rl_task_id}:abort",
    "GET /v1/rl/trajectories/stats",
    "GET /v1/rl/trajectories",
    "GET /v1/rl/trajectories/{trajectory_id}",
    "POST /v1/gateway/upload/batch",
    "POST /v1/rl/training/runs",
    "GET /v1/rl/training/runs/{training_run_id}",
    "POST /v1/rl/training/runs/{training_run_id}/stop",
    "GET /v1/rl/tasks",
    "GET /v1/rl/tasks/{rl_task_id}/events",
    "GET /v1/rl/training/runs",
    "GET /v1/rl/training/runs/{training_run_id}/events",
    "GET /v1/rl/policies",
    "POST /v1/rl/trajectories/rewards",
    "POST /v1/rl/trajectories/{trajectory_id}/rewards",
    # Rollout (docs/rollout.md): the fuzzed service has no rollout, so these answer 409 / 404 / 400, never a 5xx.
    "GET /v1/rl/rollout",
    "POST /v1/rl/rollout/promote",
    "POST /v1/rl/rollout/rollback",
    "POST /v1/rl/rollout/pause",
    "POST /v1/rl/rollout/resume",
    "GET /v1/rl/rollout/{rollout_id}/events",
    "POST /v1/rl/loras/activate",
    # Lineages (docs/training.md, docs/lineages.md): the registered ones page by page; `default` answers its view,
    # an unregistered name 404 `lineage_not_found`.
    "GET /v1/rl/lineages",
    "GET /v1/rl/lineages/{lineage}",
    "POST /v1/rl/lineages/{lineage}/pause",
    "POST /v1/rl/lineages/{lineage}/resume",
    # The lifecycle (docs/lineages.md "Lifecycle"): no lineage is registered here, so `default` answers 400
    # `lineage_protected` and every other name 404.
    "POST /v1/rl/lineages/{lineage}/archive",
    "POST /v1/rl/lineages/{lineage}/restore",
    "POST /v1/rl/lineages/{lineage}/delete",
    # Exclusion of a vLLM instance's samples (docs/security.md row 17).
    "POST /v1/rl/trajectories/exclude",
]
# Operations whose schema constrains a body, header or query parameter: the others (no body, free-form path ids) have
# nothing a negative case could break; hostile path ids are fuzzed in test_fuzz_routes.py and test_hostile_input.py.
VIOLABLE = [op for op in OPERATIONS if op.startswith("POST") and "/training/runs/" not in op] + [
    "GET /v1/rl/trajectories", "GET /v1/rl/tasks", "GET /v1/rl/training/runs", "GET /v1/rl/lineages",
    "GET /v1/rl/policies"]
TASK_IDS = ["t1", "t2", "t3", "t4"]  # active with an open capture, rewarded, empty, delayed with a committed turn
CAPTURE_IDS = ["c1", "c2", "c3", "c4"]
TURN_IDS = ["u1", "u2", None]
SESSIONS = ["s1", "s2", "s5"]


class Service:
    def __init__(self, svc: ServiceProcess, schema: Any, snapshot: RedisSnapshot) -> None:
        self.svc, self.schema, self.snapshot = svc, schema, snapshot
        self.http = requests.Session()
        self.strategies: dict[tuple[str, GenerationMode], Any] = {}

    def strategy(self, label: str, mode: GenerationMode) -> Any:
        if (label, mode) not in self.strategies:
            self.strategies[label, mode] = self.schema.find_operation_by_label(label).as_strategy(generation_mode=mode)
        return self.strategies[label, mode]


def _seed(client: httpx.Client) -> None:
    def ok(resp: httpx.Response, status: int) -> httpx.Response:
        assert resp.status_code == status, resp.text
        return resp

    def capture(t: str, c: str, turn: str | None = None, commit: bool = True) -> None:
        body = {"rl_task_id": t, "capture_id": c, "agent_turn_id": turn, "request": REQUEST}
        injected = ok(client.post("/internal/v1/completions:before", json=body), 200).json()["request"]
        if commit:
            ok(client.post("/internal/v1/completions:after", json=dict(body, request=injected, response=RESPONSE)), 204)

    start = "/v1/rl/tasks/start"
    ok(client.post(start, json={"reward_mode": "terminal"}, headers=start_headers("s1", "t1")), 201)
    capture("t1", "c1")
    capture("t1", "c2", commit=False)
    ok(client.post(start, json={"reward_mode": "terminal"}, headers=start_headers("s2", "t2")), 201)
    capture("t2", "c3")
    ok(client.post("/v1/rl/tasks/t2/stop"), 200)
    ok(client.post("/v1/rl/tasks/t2/reward", json={"reward": 0.5}), 200)
    ok(client.post(start, json={"reward_mode": "terminal"}, headers=start_headers("s3", "t3")), 201)
    ok(client.post(start, json={"reward_mode": "delayed_feedback"}, headers=start_headers("s4", "t4")), 201)
    capture("t4", "c4", turn="u1")


@pytest.fixture(scope="module")
def service(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("schema-fuzz")
    redis = SyncRedis.from_url(redis_url)
    snapshot = RedisSnapshot(redis)
    snapshot.clear()
    # The default minimum of 32 samples keeps run starts at 409: a run training in the background would race the
    # snapshot restores.
    with FakeJudge() as judge, FakeGateway(model_id="tiny") as gateway, ServiceProcess(
        tmp, redis_url, judge_endpoint=judge.url, judge_model="judge", judge_retries=0, judge_timeout=5.0,
        turn_publish_timeout_seconds=1.0, aigw_endpoint=gateway.url, trainer_backend="scripted",
    ) as svc:
        with httpx.Client(base_url=svc.url, timeout=30) as client:
            _seed(client)
        snapshot.take()
        schema = schemathesis.openapi.from_url(svc.url + "/openapi.json")
        service = Service(svc, schema, snapshot)
        yield service
        service.http.close()
        # The catch-all logs every unhandled exception: none may have happened, even if answered in time.
        assert "unhandled error" not in svc.log(), svc.log()[-3000:]
    snapshot.clear()
    redis.close()


def test_every_route_is_published_with_its_request_shape(service: Service) -> None:
    labels = {op.ok().label for op in service.schema.get_all_operations()}
    assert labels == set(OPERATIONS)
    raw = service.schema.raw_schema["paths"]
    assert raw["/v1/rl/tasks/start"]["post"]["requestBody"]["content"]["application/json"]["schema"]["required"] == [
        "reward_mode"]
    names = {p["name"] for p in raw["/v1/rl/tasks/start"]["post"]["parameters"]}
    assert names == {"X-Agent-Session-Id", "X-AIGW-RL-Task-Id", "X-AIGW-RL-Policy-Name", "X-AIGW-RL-Policy-Model"}


def _retarget(case: Any, data: st.DataObject) -> None:
    """Sometimes point generated ids at the seeded Tasks and captures, so a request can reach the domain logic."""
    if not data.draw(st.booleans(), label="retarget"):
        return
    if case.path_parameters and "rl_task_id" in case.path_parameters:
        case.path_parameters["rl_task_id"] = data.draw(st.sampled_from(TASK_IDS))
    if case.path_parameters and "trajectory_id" in case.path_parameters:
        case.path_parameters["trajectory_id"] = data.draw(st.sampled_from(CAPTURE_IDS))
    if isinstance(case.body, dict):
        if "rl_task_id" in case.body:
            case.body["rl_task_id"] = data.draw(st.sampled_from(TASK_IDS))
        for key, pool in (("capture_id", CAPTURE_IDS), ("agent_turn_id", TURN_IDS), ("session_id", SESSIONS)):
            if key in case.body and data.draw(st.booleans()):
                case.body[key] = data.draw(st.sampled_from(pool))
        if "request" in case.body and data.draw(st.booleans()):
            # The recorded request, as `:before` takes it or as it returned it (what `:after` must repeat).
            case.body["request"] = data.draw(st.sampled_from([REQUEST, INJECTED]))
        if "response" in case.body and data.draw(st.booleans()):
            case.body["response"] = RESPONSE
    if case.headers and "X-AIGW-RL-Task-Id" in case.headers:
        case.headers["X-AIGW-RL-Task-Id"] = data.draw(st.sampled_from([*TASK_IDS, "t9"]))


def _run(service: Service, label: str, mode: GenerationMode, data: st.DataObject) -> None:
    case = data.draw(service.strategy(label, mode), label="case")
    _retarget(case, data)
    service.snapshot.restore()
    response = case.call(base_url=service.svc.url, session=service.http, timeout=30)
    where = f"{label} [{mode.value}]: {case.as_curl_command(base_url=service.svc.url)}"
    assert_envelope(response.status_code, response.content, where)


@pytest.mark.parametrize("label", OPERATIONS)
@SETTINGS
@given(data=st.data())
def test_schema_conforming_requests(service: Service, label: str, data: st.DataObject) -> None:
    _run(service, label, GenerationMode.POSITIVE, data)


@pytest.mark.parametrize("label", VIOLABLE)
@SETTINGS
@given(data=st.data())
def test_schema_violating_requests(service: Service, label: str, data: st.DataObject) -> None:
    _run(service, label, GenerationMode.NEGATIVE, data)


def test_openapi_document_does_not_change_validation(service: Service) -> None:
    """A body the published schema forbids still gets the route's own contract code (the schema only documents)."""
    service.snapshot.restore()
    with httpx.Client(base_url=service.svc.url, timeout=10) as client:
        r = client.post("/v1/rl/tasks/start", json={"reward_mode": "x"}, headers=start_headers("s9", "t9"))
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_reward_mode")
        r = client.post("/v1/rl/tasks/t2/reward", json={"reward": True})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_reward")
