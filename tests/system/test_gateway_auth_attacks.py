"""Attacks on the gateway's authentication, each against real processes (issue 19 items 1 and 3, the weakness
"signatures cover neither method nor path", issue 28 items 7 and 10): a real gateway with its RL Service child, a
private Redis and a fake vLLM on loopback sockets; the attacker is a local process (or a browser's cross-site form)
with no key, the holder of the instance key only, or someone who intercepts a signed request in flight.

Only `sign` (the AIGW form) is imported from the signing module: everything else is signed the way this repository's
clients sign (`GatewayProcess.signed`), so each test also runs against the code before the fix and fails there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import sign
from tests.support.fake_vllm import CHAT_PATH, LOAD_PATH, FakeVLLM
from tests.support.gateway_process import API_KEY, INS_KEY, GatewayProcess
from tests.support.service_process import ServiceProcess
from tests.system.test_gateway_lora import rl_child_pid, wait_gone, wait_service

pytestmark = pytest.mark.system
REPO_ROOT = Path(__file__).resolve().parents[2]

ACTIVATE = "/internal/v1/rl/loras/activate"
POLICY = "/internal/v1/rl/loras/tiny"
CANARY_ROUTES = ("/internal/v1/rl/canary/start", "/internal/v1/rl/canary/promote", "/internal/v1/rl/canary/abort")
CANARY_STATUS = "/internal/v1/rl/canary/tiny"
REGISTER = "/aigw/v1/register-instance"
CHAT_BODY = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
# What a page on any origin can send cross-site without a CORS preflight, plus near-misses of the JSON type.
NOT_JSON = ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x", None, "text/json", "application/jsonp", "application/+json"]


@pytest.fixture
def vllm() -> Iterator[FakeVLLM]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as v:
        yield v


def error_code(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


def typed(content_type: str | None) -> dict[str, str]:
    return {} if content_type is None else {"content-type": content_type}


def rogue_activation(gw: GatewayProcess) -> bytes:
    """A well-formed activation of an adapter directory the attacker placed under the LoRA root."""
    path = gw.lora_root / "tiny" / "v9"
    path.mkdir(parents=True, exist_ok=True)
    return orjson.dumps({"base_model": "tiny", "lora_name": "tiny:v9", "lora_path": str(path),
                         "expected_lora_name": "base", "training_run_id": "run-000000000009"})


def assert_internal_routes_closed(gw: GatewayProcess, vllm: FakeVLLM, when: str) -> None:
    body = rogue_activation(gw)
    # A browser form (text/plain) and a local script (JSON, with or without a guessed bearer): none is served.
    assert error_code(gw.http.post(ACTIVATE, content=body, headers=typed("text/plain"))) == (
        415, "unsupported_media_type"), when
    for headers in ({}, {"authorization": "Bearer"}, {"authorization": "Bearer x"}):
        r = gw.http.post(ACTIVATE, content=body, headers={"content-type": "application/json", **headers})
        assert error_code(r) == (401, "unauthorized"), (when, headers, r.text)
        assert error_code(gw.http.get(POLICY, headers=headers)) == (401, "unauthorized"), (when, headers)
        # The canary routes (docs/rollout.md) are closed the same way: no rogue candidate for half the Tasks.
        canary = orjson.dumps({**orjson.loads(body), "share": 0.5})
        for path in CANARY_ROUTES:
            r = gw.http.post(path, content=canary, headers={"content-type": "application/json", **headers})
            assert error_code(r) == (401, "unauthorized"), (when, path, headers, r.text)
        assert error_code(gw.http.get(CANARY_STATUS, headers=headers)) == (401, "unauthorized"), (when, headers)
    assert not any(r.path == LOAD_PATH for r in vllm.requests), when  # nothing reached an instance
    status = gw.signed("GET", "/v1/loras/tiny").json()
    assert (status["status"], status["active_lora"]) == ("base", None), when
    assert "candidate" not in status, when


# ---------------------------------------------------------------------------------------------- item 1


def test_internal_routes_refuse_everyone_while_no_rl_service_child_runs(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        assert_internal_routes_closed(gw, vllm, "before the service start")

        gw.start_service()
        assert error_code(gw.http.get(POLICY)) == (401, "unauthorized")  # running: the child's token is needed
        assert gw.signed("POST", "/v1/rl/service/stop").json()["status"] == "stopped"
        assert_internal_routes_closed(gw, vllm, "after a stop")

        gw.start_service()
        child = rl_child_pid(gw)
        os.kill(child, signal.SIGKILL)  # only the pid the gateway spawned
        wait_gone(child, 5.0)
        wait_service(gw, "failed")
        assert_internal_routes_closed(gw, vllm, "after a child crash")


FAKE_CHILD = """\
import http.server, json, os, sys, urllib.error, urllib.request

opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

def status(headers):
    request = urllib.request.Request(os.environ["FAKE_CHILD_GATEWAY"] + "/internal/v1/rl/loras/tiny", headers=headers)
    try:
        return opener.open(request, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code

# Before it reports healthy, as the RL Service's start-up recovery does: read the policy with and without the token.
token = os.environ["RL_SERVICE_TOKEN"]
result = {"with_token": status({"Authorization": "Bearer " + token}), "without_token": status({})}
with open(os.environ["FAKE_CHILD_OUT"], "w") as out:
    json.dump(result, out)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # the RL Service's /health shape (CONTRACT §2.2): the gateway checks the model id
        body = b'{"status": "ready", "model_id": "tiny"}' if self.path == "/health" else b""
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(os.environ["FAKE_CHILD_PORT"])), Health).serve_forever()
"""


def test_a_starting_child_reaches_the_internal_routes_with_its_token_and_nobody_else(redis_url, tmp_path, vllm):
    """The start-up window (child spawned, not yet healthy) is when the RL Service's recovery reads and may activate
    the policy: its token works there, and a request without it is refused then too."""
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    out = tmp_path / "child-result.json"
    gw = GatewayProcess(tmp_path, redis_url, instances=[vllm],
                        online_overrides={"command": [sys.executable, str(script)]})
    gw.env.update(FAKE_CHILD_PORT=str(gw.rl_port), FAKE_CHILD_OUT=str(out), FAKE_CHILD_GATEWAY=gw.url)
    with gw:
        gw.start_service()
        assert orjson.loads(out.read_bytes()) == {"with_token": 200, "without_token": 401}
        assert gw.signed("POST", "/v1/rl/service/stop").json()["status"] == "stopped"


def test_non_json_bodies_are_refused_on_every_json_route(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        chat = orjson.dumps(CHAT_BODY)
        routes = ["/v1/chat/completions", "/v1/messages", "/v1/rl/tasks/start", "/v1/rl/service/stop", REGISTER,
                  "/console/login", ACTIVATE, "/v1/rl/training/runs"]
        for content_type in NOT_JSON:
            for route in routes:
                if content_type is not None and route.startswith(("/v1/rl", "/aigw")):
                    # Signed as the route wants: the refusal is about the body's type, not the credentials.
                    r = gw.signed("POST", route, json=CHAT_BODY, headers=typed(content_type))
                else:
                    r = gw.http.post(route, content=chat, headers=typed(content_type))
                assert error_code(r) == (415, "unsupported_media_type"), (route, content_type, r.text)
        assert not any(r.path == CHAT_PATH for r in vllm.requests)  # no completion reached an instance
        assert wait_service(gw, "running")  # the signed stop with a text/plain body did nothing
        assert gw.signed("GET", "/v1/rl/training/runs").json()["items"] == []

        # JSON, a +json type and parameters pass; bodiless calls need no type at all.
        for content_type in ("application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json"):
            r = gw.http.post("/v1/chat/completions", content=chat, headers=typed(content_type))
            assert r.status_code == 200, (content_type, r.text)
        assert gw.signed("GET", "/v1/rl/service", headers=typed("text/plain")).status_code == 200
        assert gw.signed("POST", "/v1/rl/service/stop", headers=typed("text/plain")).json()["status"] == "stopped"


def test_the_rl_service_refuses_non_json_bodies_too(redis, redis_url, tmp_path):
    """Without a token (AIGW mode) the RL Service answers any loopback client: a cross-site form must not reach it."""
    with ServiceProcess(tmp_path, redis_url) as svc, httpx.Client(base_url=svc.url, timeout=30) as http:
        start = {"X-Agent-Session-Id": "s1", "X-AIGW-RL-Task-Id": "t1", "X-AIGW-RL-Policy-Name": "base",
                 "X-AIGW-RL-Policy-Model": "tiny"}
        for content_type in NOT_JSON:
            r = http.post("/v1/rl/tasks/start", content=b'{"reward_mode": "terminal"}',
                          headers={**start, **typed(content_type)})
            assert error_code(r) == (415, "unsupported_media_type"), content_type
            r = http.post("/v1/rl/training/runs", content=b"{}", headers=typed(content_type))
            assert error_code(r) == (415, "unsupported_media_type"), content_type
        assert http.get("/v1/rl/tasks/t1").status_code == 404 and http.get("/v1/rl/training/runs").json()["items"] == []
        assert http.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"}, headers=start).status_code == 201


# ---------------------------------------------------------------------------------------------- item 3


def test_an_instance_key_flood_cannot_lock_the_operator_out(redis, redis_url, tmp_path, vllm):
    """The instance key's replay cache fills (a small size keeps it quick; the unit tests show the real default,
    100 000 per key); the operator's signed calls still answer, and the refusals are logged once, not per request."""
    size = 40
    with GatewayProcess(tmp_path, redis_url, instances=[vllm], global_overrides={"replayCacheSize": size}) as gw:
        answers = [gw.signed("POST", REGISTER, json={"junk": i}, key=INS_KEY).status_code for i in range(size + 25)]
        assert answers == [400] * size + [401] * 25  # authentic junk until the cache is full, then refused
        assert gw.signed("GET", "/v1/rl/service").status_code == 200
        gw.start_service()
        assert gw.signed("POST", "/v1/rl/service/stop").json()["status"] == "stopped"
        for i in range(size - 3):  # the operator's own allowance is all there
            assert gw.signed("GET", "/v1/rl/service", params={"i": i}).status_code == 200
        assert gw.stderr().count("replay cache of the instance key full") == 1


# ---------------------------------------------------------------------------------------------- signature scope


def intercept(gw: GatewayProcess, method: str, path: str, **kwargs: object) -> dict[str, str]:
    """The signature headers of a request signed the way this repository's clients sign, taken in flight (before it
    reaches the gateway), as an eavesdropper on the way would copy them."""
    seen: list[httpx.Request] = []
    real = gw.http
    gw.http = httpx.Client(base_url=gw.url, transport=httpx.MockTransport(
        lambda request: seen.append(request) or httpx.Response(599)))
    try:
        gw.signed(method, path, **kwargs)
    finally:
        gw.http.close()
        gw.http = real
    (request,) = seen
    names = ("x-timestamp", "x-signature", "x-signature-version")
    return {k: v for k, v in request.headers.items() if k.lower() in names}


def test_a_signed_request_cannot_be_replayed_on_another_route_method_or_query(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        stolen = intercept(gw, "GET", "/v1/rl/service")
        for method, target in (("POST", "/v1/rl/service/stop"), ("POST", "/v1/rl/service/start"),
                               ("DELETE", "/v1/loras/tiny"), ("GET", "/v1/rl/service?x=1"),
                               ("GET", "/v1/rl/trajectories/stats")):
            r = gw.http.request(method, target, headers=stolen)
            assert error_code(r) == (401, "invalid_signature"), (method, target, r.text)
        assert wait_service(gw, "running")  # the stop replayed from a status read did nothing
        listing = intercept(gw, "GET", "/v1/rl/tasks", params={"limit": 1})
        assert error_code(gw.http.get("/v1/rl/tasks?limit=1000", headers=listing)) == (401, "invalid_signature")
        # The refused replays consumed nothing: the intercepted requests still pass on their own route, once.
        assert gw.http.get("/v1/rl/service", headers=stolen).status_code == 200
        assert gw.http.get("/v1/rl/tasks?limit=1", headers=listing).status_code == 200
        assert error_code(gw.http.get("/v1/rl/service", headers=stolen)) == (401, "invalid_signature")


def test_the_aigw_signature_form_is_accepted_only_where_configured(redis, redis_url, tmp_path, vllm):
    def aigw(gw: GatewayProcess) -> httpx.Response:
        time.sleep(0.002)  # a fresh millisecond: the same empty body signed twice would be a replay
        return gw.http.get("/v1/rl/service", headers=sign(API_KEY, b"", now_ms=int(time.time() * 1000)))

    with GatewayProcess(tmp_path / "strict", redis_url, instances=[vllm]) as gw:
        assert error_code(aigw(gw)) == (401, "invalid_signature")
        assert gw.signed("GET", "/v1/rl/service").status_code == 200
    with GatewayProcess(tmp_path / "legacy", redis_url, instances=[vllm],
                        global_overrides={"acceptLegacySignatures": True}) as gw:
        assert aigw(gw).status_code == 200
        assert gw.signed("GET", "/v1/rl/service").status_code == 200
        assert "acceptLegacySignatures is on" in gw.stderr()


# ---------------------------------------------------------------------------------------------- issue 28 items 7, 10


def tampered(request: httpx.Request, **changes: str | None) -> httpx.Request:
    """`request` as sent, with headers replaced (a value), removed (None) or doubled (a `+` prefix appends one)."""
    headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() not in {n.lower() for n in changes}]
    for name, value in changes.items():
        if value is None:
            continue
        if value.startswith("+"):
            headers += [(name, request.headers[name]), (name, value[1:])]
        else:
            headers.append((name, value))
    return httpx.Request(request.method, request.url, headers=headers, content=request.content)


def test_an_intercepted_task_start_cannot_be_retargeted_to_another_session(redis, redis_url, tmp_path, vllm):
    """Issue 28 item 7: the session header of a signed Task start is signed, and so is the key id: a start taken in
    flight cannot be pointed at a victim's session (whose captures would then go into the attacker's Task), at no
    session, or at another agent key, nor sent twice."""
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        for agent in (None, "agent-a"):
            session = f"caller-{agent or 'operator'}"
            request = gw.signed_request("POST", "/v1/rl/tasks/start", json={"reward_mode": "terminal"},
                                        headers={"X-Agent-Session-Id": session}, agent=agent)
            attempts = [tampered(request, **{"X-Agent-Session-Id": "victim"}),
                        tampered(request, **{"X-Agent-Session-Id": None}),
                        tampered(request, **{"X-Agent-Session-Id": "+victim"}),
                        tampered(request, **{"X-Key-Id": "agent-b"})]
            if agent is not None:
                attempts.append(tampered(request, **{"X-Key-Id": None}))
            for attempt in attempts:
                r = gw.http.send(attempt)
                assert error_code(r) == (401, "invalid_signature"), (agent, attempt.headers, r.text)
            tasks = gw.signed("GET", "/v1/rl/tasks").json()["items"]
            assert not any(t["agent_session_id"] in ("victim", session) for t in tasks), tasks
            # The intercepted request itself still starts its own Task, once.
            r = gw.http.send(request)
            assert r.status_code == 201 and r.json()["agent_session_id"] == session, r.text
            assert r.json()["agent_key_id"] == agent
            # Sent again as it was, it is a replay: refused, and the Task is not re-started.
            assert error_code(gw.http.send(tampered(request))) == (401, "invalid_signature")


def test_the_gateway_refuses_to_start_with_an_open_key_file_or_a_key_two_holders_share(redis, redis_url, tmp_path,
                                                                                       vllm):
    """Issue 28 item 10: at start, a key file group or others may read or write, or one key serving two holders
    (api, instance, any agent), is a clear configuration error that names the problem and never the key."""
    gw = GatewayProcess(tmp_path, redis_url, instances=[vllm])
    good = gw.key_file.read_bytes()

    def refused(problem: str) -> None:
        try:
            run = subprocess.run(
                [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.cli.main", "gateway",
                 "--config", str(gw.config_path)],
                cwd=REPO_ROOT, env=gw.env, capture_output=True, text=True, timeout=30,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"the gateway started despite: {problem}")
        assert run.returncode == 2, run.stderr
        assert problem in run.stderr and str(gw.key_file) in run.stderr, run.stderr
        for key in (API_KEY, INS_KEY, *gw.agent_keys.values()):
            assert key.decode() not in run.stderr and key.hex() not in run.stderr

    os.chmod(gw.key_file, 0o644)
    refused("mode 0644 lets group or others read or write the keys")
    os.chmod(gw.key_file, 0o640)
    refused("mode 0640 lets group or others read or write the keys")
    os.chmod(gw.key_file, 0o600)
    document = orjson.loads(good)
    for shared, problem in (
        ({"insHmacKey": document["apiHmacKey"]}, "insHmacKey is the same key as apiHmacKey"),
        ({"agentHmacKeys": [{"id": "agent-a", "key": document["insHmacKey"]}]},
         "agentHmacKeys[0] (id 'agent-a') is the same key as insHmacKey"),
        ({"agentHmacKeys": [{"id": "agent-a", "key": "ab" * 32}, {"id": "agent-b", "key": "AB" * 32}]},
         "agentHmacKeys[1] (id 'agent-b') is the same key as agentHmacKeys[0] (id 'agent-a')"),
    ):
        gw.key_file.write_bytes(orjson.dumps({**document, **shared}))
        refused(problem)
    gw.key_file.write_bytes(good)
    with gw:  # the same configuration with a private file of distinct keys starts
        assert gw.signed("GET", "/v1/rl/service").status_code == 200
