"""Schema-driven fuzzing of the reference gateway's public routes over a real socket (CONTRACT §3.2, §3.3, §3.5).

schemathesis generates requests from the contract's description of the public routes (tests/support/gateway_schema.py)
— bodies, headers, path ids and query parameters that fit it (positive) or break it (negative) — and sends them to
the gateway running as a real process with its RL Service child, a fake vLLM and a fake Judge. Each signed request
is signed correctly, or not at all, with a forged signature, a stale or future timestamp, or replayed: everything
but the correct signature must be exactly 401 `invalid_signature`, and nothing may ever be a 5xx. Chat requests are
sometimes sent with the session of an active Task, so the capture path is fuzzed too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from requests.auth import AuthBase
from schemathesis import GenerationMode

from openjiuwen.agent_evolving.agent_rl.gateway.auth.hmac_auth import SKEW_MS
from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import sign_request
from tests.support.fake_judge import FakeJudge
from tests.support.fake_vllm import FakeVLLM, Reply
from tests.support.fuzzing import assert_envelope
from tests.support.gateway_process import API_KEY, INS_KEY, GatewayProcess
from tests.support.gateway_schema import REGISTER_PATH, UNSIGNED, gateway_schema

pytestmark = pytest.mark.system

EXAMPLES = 12
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
SCHEMA = schemathesis.openapi.from_dict(gateway_schema())
OPERATIONS = sorted(op.ok().label for op in SCHEMA.get_all_operations())
REGISTER_SCHEMA = schemathesis.openapi.from_dict(gateway_schema(with_register=True))
SIGNING = ["valid", "valid", "valid", "missing", "no_signature", "forged", "instance_key", "stale", "future",
           "replay"]
SESSIONS = ["fz-terminal", "fz-delayed"]


class Signer(AuthBase):
    """Signs the prepared request's exact method, target and body bytes according to `mode`."""

    last_ms = 0  # strictly increasing: two identical bodies signed in one millisecond would be a replay

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        body = r.body or b""
        body = body.encode() if isinstance(body, str) else body
        for name in ("X-Timestamp", "X-Signature", "X-Signature-Version"):
            r.headers.pop(name, None)
        if self.mode == "missing":
            return r
        Signer.last_ms = max(int(time.time() * 1000), Signer.last_ms + 1)
        key = {"forged": b"f" * 32, "instance_key": INS_KEY}.get(self.mode, API_KEY)
        offset = {"stale": -SKEW_MS - 60_000, "future": SKEW_MS + 60_000}.get(self.mode, 0)
        # Version 3, over the method, the path and query and the session header exactly as requests will send them.
        r.headers.update(sign_request(key, r.method or "GET", r.path_url, body, now_ms=Signer.last_ms + offset,
                                      session_id=r.headers.get("X-Agent-Session-Id")))
        if self.mode == "no_signature":
            del r.headers["X-Signature"]
        return r


class Gateway:
    def __init__(self, gw: GatewayProcess) -> None:
        self.gw = gw
        self.http = requests.Session()
        self.tasks: dict[str, str] = {}  # session -> its latest rl_task_id
        self.strategies: dict[tuple[str, str, GenerationMode], Any] = {}

    def strategy(self, schema: Any, label: str, mode: GenerationMode) -> Any:
        key = (id(schema), label, mode)
        if key not in self.strategies:
            self.strategies[key] = schema.find_operation_by_label(label).as_strategy(generation_mode=mode)
        return self.strategies[key]

    def ensure_task(self, session: str) -> str:
        """An active Task for `session` (a fuzzed request may have ended the previous one)."""
        mode = "delayed_feedback" if session == "fz-delayed" else "terminal"
        r = self.gw.start_task(session, mode)
        assert r.status_code in (200, 201), r.text
        self.tasks[session] = r.json()["rl_task_id"]
        return self.tasks[session]


@pytest.fixture(scope="module")
def gateway(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    tmp = tmp_path_factory.mktemp("gateway-fuzz")
    with FakeVLLM(served_model="tiny", name="vllm-fuzz") as vllm, FakeJudge() as judge:
        vllm.reply = Reply(content="fuzzed")
        # A Training Run never starts (409): one training and activating in the background is not what is fuzzed.
        with GatewayProcess(tmp, redis_url, instances=[vllm], judge_url=judge.url,
                            rl_overrides={"min_samples_for_training": 100_000,
                                          "max_samples_per_run": 100_000}) as gw:
            gw.start_service()
            gateway = Gateway(gw)
            for session in SESSIONS:
                gateway.ensure_task(session)
            yield gateway
            gateway.http.close()
            status = gw.signed("GET", "/v1/rl/service").json()
            assert status["status"] == "running", status  # nothing fuzzed took the RL Service down
            for log in (gw.dir / "rl-service.log", gw.dir / "gateway.stderr.log"):
                text = log.read_text(errors="replace") if log.exists() else ""
                assert "unhandled error" not in text, text[-3000:]


def _retarget(gateway: Gateway, case: Any, data: st.DataObject) -> None:
    if not data.draw(st.booleans(), label="retarget"):
        return
    if case.path in ("/v1/chat/completions", "/v1/messages"):
        session = data.draw(st.sampled_from(SESSIONS))
        gateway.ensure_task(session)
        case.headers = {**(case.headers or {}), "X-Agent-Session-Id": session}
        if isinstance(case.body, dict):
            case.body["model"] = "tiny"
    if case.path_parameters and "rl_task_id" in case.path_parameters:
        case.path_parameters["rl_task_id"] = gateway.tasks[data.draw(st.sampled_from(SESSIONS))]
    if case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = "tiny"


def _send(gateway: Gateway, schema: Any, label: str, mode: GenerationMode, data: st.DataObject) -> None:
    case = data.draw(gateway.strategy(schema, label, mode), label="case")
    _retarget(gateway, case, data)
    signed = case.path not in UNSIGNED
    signing = data.draw(st.sampled_from(SIGNING), label="signing") if signed else "valid"
    auth = Signer("valid" if signing == "replay" else signing) if signed else None
    url = gateway.gw.url
    response = case.call(base_url=url, session=gateway.http, auth=auth, timeout=30)
    where = f"{label} [{mode.value}, {signing}]: {case.as_curl_command(base_url=url)}"
    content_type = (response.headers.get("content-type") or [""])[0]
    assert_envelope(response.status_code, response.content, where, content_type=content_type, upstream=not signed)
    if signing == "replay":  # the very same request again, headers included
        replayed = gateway.http.send(response.request, timeout=30)
        assert (replayed.status_code, replayed.json()["error"]["code"]) == (401, "invalid_signature"), where
    elif signed and signing != "valid" and not (signing == "instance_key" and case.path == REGISTER_PATH):
        assert response.status_code == 401, where
        assert response.content.startswith(b'{"error":{"code":"invalid_signature"'), where


@pytest.mark.parametrize("label", OPERATIONS)
@SETTINGS
@given(data=st.data())
def test_schema_conforming_requests(gateway: Gateway, label: str, data: st.DataObject) -> None:
    _send(gateway, SCHEMA, label, GenerationMode.POSITIVE, data)


# Operations with a body, a header or a query parameter a negative case can break (free-form path ids alone give
# nothing to violate; hostile path ids are in test_hostile_input.py).
VIOLABLE = ["POST /v1/chat/completions", "POST /v1/messages", "POST /v1/rl/tasks/start",
            "POST /v1/rl/tasks/{rl_task_id}/reward", "POST /v1/rl/tasks/{rl_task_id}/stop",
            "POST /v1/rl/training/runs", "POST /v1/gateway/upload/batch", "GET /v1/rl/trajectories"]


@pytest.mark.parametrize("label", VIOLABLE)
@SETTINGS
@given(data=st.data())
def test_schema_violating_requests(gateway: Gateway, label: str, data: st.DataObject) -> None:
    _send(gateway, SCHEMA, label, GenerationMode.NEGATIVE, data)


# ------------------------------------------------------------------------- regressions found by this fuzzing


def test_escaped_characters_in_a_proxied_id_stay_in_the_id(gateway: Gateway) -> None:
    """`%3F` in an id once reached the RL Service as `?`: `GET /v1/rl/tasks/<t>%3Fx` answered Task <t>."""
    t = gateway.ensure_task("fz-terminal")
    for suffix in ("%3Fx", "%23x", "%3F", "%1F"):
        r = gateway.gw.signed("GET", f"/v1/rl/tasks/{t}{suffix}")
        assert (r.status_code, r.json()["error"]["code"]) == (404, "task_not_found"), (suffix, r.text)
    r = gateway.gw.signed("GET", "/v1/rl/trajectories/%1F")  # once a 500: a control character in the URL
    assert (r.status_code, r.json()["error"]["code"]) == (404, "trajectory_not_found")
    assert gateway.gw.signed("GET", f"/v1/rl/tasks/{t}").json()["status"] == "active"


def test_stop_with_a_malformed_task_id_is_404_without_touching_any_task(gateway: Gateway) -> None:
    t = gateway.ensure_task("fz-terminal")
    for bad in (f"{t}%3Fx", "%1F", "t" * 65, "a.b"):
        r = gateway.gw.signed("POST", f"/v1/rl/tasks/{bad}/stop")
        assert (r.status_code, r.json()["error"]["code"]) == (404, "task_not_found"), bad
    assert gateway.gw.signed("GET", f"/v1/rl/tasks/{t}").json()["status"] == "active"


@pytest.mark.parametrize("session", [b"\xe9t\xe9", b"caf\xc3\xa9", b"a b", b"x" * 129, b"*", b"s1\x80"])
def test_task_start_with_a_non_ascii_or_hostile_session_header_is_400(gateway: Gateway, session: bytes) -> None:
    """A non-ASCII session header once failed while being forwarded (500); the RL Service judges it: 400."""
    r = gateway.gw.signed("POST", "/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                          headers={"X-Agent-Session-Id": session})  # type: ignore[dict-item]
    assert (r.status_code, r.json()["error"]["code"]) == (400, "missing_session_id"), r.text


@pytest.mark.parametrize("field,value", [
    ("port", "0"), ("port", "70000"), ("port", "-1"), ("port", "x"), ("instanceIp", "a b"), ("instanceIp", "x/y"),
    ("instanceIp", "\u00e9"), ("instanceIp", "1.2.3.4:80"), ("instanceIp", "user@host"), ("name", "a\nb"),
])
def test_register_instance_with_an_invalid_address_is_400(gateway: Gateway, field: str, value: str) -> None:
    """Once a 500: the registry took any port and host and failed later, building the upstream URL."""
    body = {"name": "fz-bad", "model": "tiny", "instanceIp": "127.0.0.1", "port": "8000", "role": "mixed",
            "groupID": "", "dpRank": -1, field: value}
    r = gateway.gw.signed("POST", REGISTER_PATH, json=body, key=INS_KEY)
    assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request"), r.text
    status = gateway.gw.signed("GET", "/v1/loras/tiny").json()
    assert status["instances"] == {"ready": 1, "failed": 0}  # nothing was registered


# Last in the module: a valid registration adds an instance that later traffic could be routed to.
@pytest.mark.parametrize("mode", [GenerationMode.NEGATIVE, GenerationMode.POSITIVE])
@SETTINGS
@given(data=st.data())
def test_register_instance(gateway: Gateway, mode: GenerationMode, data: st.DataObject) -> None:
    _send(gateway, REGISTER_SCHEMA, f"POST {REGISTER_PATH}", mode, data)
