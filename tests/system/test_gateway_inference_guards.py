"""Attacks on the inference path with real processes (issue 19 items 5 and 6, and the bypass-model weakness).

Each test starts the reference gateway (with its RL Service child where capture matters) over a fake vLLM on a
loopback socket and performs the attack as a client, a rogue instance or a browser would:

- a rogue instance answers 418 `text/html` with a script: the client gets the gateway's JSON envelope, with
  `nosniff` and a deny-all CSP, and headless Chromium runs no script on the gateway's origin;
- every gateway answer carries `nosniff` and a CSP;
- spoiling request fields inside a Task are refused or dropped before anything is captured, while the client's
  own sampling is honoured and recorded (issue 29);
- a Task's capture secret: the right one captures, a missing or wrong one is refused and writes nothing;
- traffic outside a Task cannot name a version that only pinned Tasks hold.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import orjson
import pytest
from redis import Redis as SyncRedis

from openjiuwen.agent_evolving.agent_rl.cli.operator import KEY_FILE_ENV, URL_ENV, main
from openjiuwen.agent_evolving.agent_rl.gateway.console_auth import login_token
from tests.support.fake_vllm import FakeVLLM, Reply, ToolCall
from tests.support.gateway_process import API_KEY, GatewayProcess
from tests.system.test_gateway_lora import activate_v1, agent

pytestmark = pytest.mark.system

CHAT = "/v1/chat/completions"
SESSION = "X-Agent-Session-Id"
SECRET = "X-Agent-Capture-Secret"
IGNORED = "x-aigw-rl-ignored-fields"
CHROMIUM = "/usr/bin/chromium"
DENY_ALL_CSP = "default-src 'none'; frame-ancestors 'none'"
ROGUE_PAGE = (b"<!doctype html><html><head><title>rogue</title></head><body><script>document.title='script ran';"
              b"fetch('/console/api/overview').then(r => r.text()).then(t => { document.title = 'stolen ' + t; });"
              b"</script></body></html>")
ASK = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture
def vllm() -> Iterator[FakeVLLM]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as v:
        yield v


def chat_bodies(vllm: FakeVLLM) -> list[dict[str, Any]]:
    return [r.body for r in vllm.requests if r.path == CHAT]


def start_task(gw: GatewayProcess, session: str, **extra: Any) -> httpx.Response:
    return gw.signed("POST", "/v1/rl/tasks/start", json={"reward_mode": "terminal", **extra},
                     headers={SESSION: session})


def capture_sets(redis_url: str, t: str) -> dict[str, int]:
    prefix = f"rl:v1:task:{t}:captures"
    with SyncRedis.from_url(redis_url) as sync:
        return {name: sync.scard(key) for name, key in
                (("all", prefix), ("open", prefix + ":open"), ("committed", prefix + ":committed"))}


def assert_hardened(r: httpx.Response, what: str, *, csp: str = DENY_ALL_CSP) -> None:
    assert r.headers.get("x-content-type-options") == "nosniff", (what, r.status_code, dict(r.headers))
    assert r.headers.get("content-security-policy") == csp, (what, r.status_code, dict(r.headers))


def error_of(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["error"]["code"]


# ------------------------------------------------------------------------------- item 5: rogue upstream errors


def test_rogue_html_error_reaches_the_client_as_a_json_envelope(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        t = start_task(gw, "s-rogue").json()["rl_task_id"]
        cases = [({}, {}, "bypass JSON"), ({SESSION: "s-rogue"}, {}, "captured JSON"),
                 ({SESSION: "s-rogue"}, {"stream": True}, "captured SSE, before the first byte"),
                 ({}, {"stream": True}, "bypass SSE")]
        for headers, extra, what in cases:
            vllm.fail_next(CHAT, 418, body=ROGUE_PAGE, content_type="text/html; charset=utf-8")
            r = gw.http.post(CHAT, json={**ASK, **extra}, headers=headers)
            assert r.status_code == 418, (what, r.text)
            assert r.headers["content-type"] == "application/json", what
            assert error_of(r) == (418, "upstream_error"), what
            assert "text/html" in r.json()["error"]["message"] and b"<script" not in r.content, what
            assert_hardened(r, what)
        vllm.fail_next(CHAT, 502, body=b"<html>bad gateway</html>", content_type="text/html")
        r = gw.http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                               "messages": [{"role": "user", "content": "hi"}]})
        assert error_of(r) == (502, "upstream_error") and b"<html" not in r.content
        # A redirect (or any non-error status) is never relayed; broken JSON neither.
        vllm.fail_next(CHAT, 302, body=b"", content_type="text/html")
        assert error_of(gw.http.post(CHAT, json=ASK)) == (502, "upstream_error")
        vllm.fail_next(CHAT, 500, body=b'{"error": ', content_type="application/json")
        assert error_of(gw.http.post(CHAT, json=ASK)) == (500, "upstream_error")
        # vLLM's own JSON error (the recorded shape) still passes through byte for byte, always as JSON.
        recorded = (Path(__file__).parents[1] / "fixtures/vllm-0.32-cpu/error_unknown_model.txt").read_text()
        body = recorded.splitlines()[0].encode()
        vllm.fail_next(CHAT, 404, body=body, content_type="text/plain")
        r = gw.http.post(CHAT, json=ASK)
        assert (r.status_code, r.content, r.headers["content-type"]) == (404, body, "application/json")
        assert_hardened(r, "vLLM JSON error")
        # Nothing was captured from the failed calls; the Task is still active.
        stopped = gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()
        assert stopped["status"] == "finalized"
        assert capture_sets(redis_url, t) == {"all": 0, "open": 0, "committed": 0}


def test_every_gateway_answer_carries_nosniff_and_a_csp(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm], global_overrides={"maxBodyBytes": 4096}) as gw:
        gw.start_service()
        assert start_task(gw, "s-headers").status_code == 201
        http = gw.http
        answers = {
            "health": http.get("/aigw/v1/health"),
            "metrics": http.get("/metrics"),
            "bypass JSON": http.post(CHAT, json=ASK),
            "captured JSON": http.post(CHAT, json=ASK, headers={SESSION: "s-headers"}),
            "anthropic": http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "hi"}]}),
            "invalid JSON 400": http.post(CHAT, content=b"{", headers={"content-type": "application/json"}),
            "unsigned 401": http.get("/v1/rl/service"),
            "signed 200": gw.signed("GET", "/v1/rl/service"),
            "proxied RL answer": gw.signed("GET", "/v1/rl/trajectories/stats"),
            "unknown route 404": http.get("/nope"),
            "wrong method 405": http.get(CHAT),
            "too large 413": http.post(CHAT, content=b"x" * 5000, headers={"content-type": "application/json"}),
            "internal without token 401": http.get("/internal/v1/rl/loras/tiny"),
            "console api 401": http.get("/console/api/overview"),
            "console asset": http.get("/console/assets/console.css"),
        }
        with http.stream("POST", CHAT, json={**ASK, "stream": True}, headers={SESSION: "s-headers"}) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
            assert b"[DONE]" in stream.read()
            answers["captured SSE"] = stream
        for what, r in answers.items():
            assert r.status_code < 500, (what, r.status_code, r.text)
            csp = r.headers.get("content-security-policy", "")
            if what == "console asset":
                assert "script-src 'self'" in csp  # the console's own policy is kept, not overwritten
                assert_hardened(r, what, csp=csp)
            else:
                assert_hardened(r, what)
        # The console page keeps its own policy (scripts only from the gateway, no framing).
        for path in ("/console/", "/console/login"):
            r = http.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert r.headers["content-security-policy"].startswith("default-src 'none'; script-src 'self'")
            assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
            assert r.headers["x-content-type-options"] == "nosniff"


@pytest.fixture
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "the Debian chromium package is missing: `make test` installs it"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


def test_rogue_html_error_runs_no_script_on_the_gateway_origin_in_chromium(redis, redis_url, tmp_path, vllm,
                                                                          browser):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        context = browser.new_context()
        try:
            page = context.new_page()
            # The operator is logged in to the console in this browser.
            token = login_token(API_KEY, expires_ms=int(time.time() * 1000) + 60_000)
            page.goto(f"{gw.url}/console/login#token={token}")
            page.wait_for_url(f"{gw.url}/console/")
            # A cross-site form post to the inference route as a top-level navigation (the attack of the review).
            # The navigation is made a JSON POST, as a request that passes the gateway's request checks would be.
            body = orjson.dumps({**ASK, "messages": []}).decode()
            page.route(gw.url + CHAT, lambda route: route.continue_(
                method="POST", post_data=body, headers={**route.request.headers, "content-type": "application/json"}))
            vllm.fail_next(CHAT, 418, body=ROGUE_PAGE, content_type="text/html; charset=utf-8")
            page.goto(gw.url + CHAT)
            page.wait_for_load_state("load")
            time.sleep(0.5)  # the rogue script's fetch would have finished by now
            assert vllm.count(CHAT) == 1  # the attack reached the rogue instance
            assert page.url == gw.url + CHAT
            assert "upstream_error" in page.content()
            assert page.title() not in ("script ran",) and not page.title().startswith("stolen")
        finally:
            context.close()


# --------------------------------------------------------------------------------- item 6: spoiling fields


REFUSED: list[tuple[str, Any]] = [
    ("logit_bias", {"42": 100}),
    ("allowed_token_ids", [5, 6]),
    ("bad_words", ["no"]),
    ("min_tokens", 3),
    ("ignore_eos", True),
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
    ("structured_outputs", {"choice": ["yes", "no"]}),
    ("guided_json", {"type": "object"}),
    ("guided_regex", "[a-z]+"),
    ("guided_choice", ["a", "b"]),
    ("chat_template", "{{ 'hidden system prompt' }}"),
    ("chat_template_kwargs", {"chat_template": "{{ 'hidden' }}"}),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "get_weather"}}),
    ("parallel_tool_calls", False),
    ("thinking_token_budget", 8),
    ("watermarking", True),
    ("vllm_xargs", {"bias": 1}),
    ("logprob_token_ids", [5]),
    ("echo", True),
    ("add_generation_prompt", False),
    ("continue_final_message", True),
    ("use_beam_search", True),
    ("best_of", 4),
    ("temperature", 0),  # greedy: no policy-gradient signal
    ("temperature", 0.005),  # vLLM would raise it to 0.01
    ("presence_penalty", 1.5),  # penalties: the trainers cannot reproduce them
    ("frequency_penalty", 1.5),
    ("repetition_penalty", 1.3),
]
HONOURED_SENT = {"temperature": 0.3, "top_p": 0.9, "top_k": 5, "min_p": 0.05}
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "repetition_penalty": 1.0}
DROPPED_SENT = {"metadata": {"who": "x"}, "prompt_logprobs": 5, "kv_transfer_params": {"remote": "h"},
                "routed_experts_prompt_start": 0, "some_future_field": True}


def test_spoiling_fields_inside_a_task_are_refused_or_dropped_and_sampling_is_honoured(redis, redis_url, tmp_path,
                                                                                       vllm):
    vllm.reply = Reply(content="Sure.", tool_calls=[ToolCall("get_weather", {"city": "Paris"})])
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        t = start_task(gw, "s-fields").json()["rl_task_id"]
        inside = {SESSION: "s-fields"}
        ask = {**ASK, "tools": [WEATHER_TOOL]}

        # Refused: 400 naming the field, nothing sent upstream, nothing captured, the Task stays active.
        for field, value in REFUSED:
            r = gw.http.post(CHAT, json={**ask, field: value}, headers=inside)
            assert error_of(r) == (400, "capture_field_refused"), (field, r.text)
            assert r.json()["error"]["message"].startswith(field.split(".")[0]), (field, r.text)
        assert chat_bodies(vllm) == []
        assert capture_sets(redis_url, t) == {"all": 0, "open": 0, "committed": 0}

        # Their neutral values are harmless and pass.
        neutral = {"logit_bias": {}, "min_tokens": 0, "ignore_eos": False, "response_format": {"type": "text"},
                   "tool_choice": "auto", "parallel_tool_calls": True, "echo": False, "add_generation_prompt": True,
                   "chat_template_kwargs": {"enable_thinking": False}}
        r = gw.http.post(CHAT, json={**ask, **neutral, "guided_json": None}, headers=inside)
        assert r.status_code == 200, r.text
        assert IGNORED not in r.headers
        sent = chat_bodies(vllm)[-1]
        assert {k: sent[k] for k in neutral} == neutral and sent["return_token_ids"] is True
        assert "guided_json" not in sent

        # Honoured and dropped: the client's own sampling goes upstream as sent (the rest explicit) and into the
        # sample; dropped fields are named in the header, honoured ones never.
        strict_tool = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
        r = gw.http.post(CHAT, json={**ASK, **HONOURED_SENT, **DROPPED_SENT, "tools": [strict_tool]},
                         headers=inside)
        assert r.status_code == 200, r.text
        assert r.headers[IGNORED].split(", ") == [*DROPPED_SENT, "tools[0].function.strict"]
        sent = chat_bodies(vllm)[-1]
        assert {k: sent[k] for k in NEUTRAL_SAMPLING} == {**NEUTRAL_SAMPLING, **HONOURED_SENT}
        assert not set(DROPPED_SENT) & set(sent) and sent["tools"] == [WEATHER_TOOL]
        # A value vLLM itself would refuse is the client's mistake: 400 invalid_request, nothing captured.
        r = gw.http.post(CHAT, json={**ASK, "top_p": 1.5}, headers=inside)
        assert error_of(r) == (400, "invalid_request") and r.json()["error"]["message"] == "top_p must be in (0, 1]"
        # Hostile key names never break the header: control characters are escaped, the list is bounded.
        r = gw.http.post(CHAT, json={**ASK, "\u001f\r\n": 1, **{f"k{i}": i for i in range(40)}}, headers=inside)
        assert r.status_code == 200, r.text
        assert r.headers[IGNORED].startswith("%1F%0D%0A, k0, k1") and r.headers[IGNORED].endswith(", +9 more")
        # Streams too, and a request that names no sampling field gets vLLM's neutral values, explicitly (vLLM
        # would otherwise apply the model's generation_config, which the sample could not record).
        with gw.http.stream("POST", CHAT, json={**ASK, "stream": True, "temperature": 0.5}, headers=inside) as s:
            assert s.status_code == 200 and IGNORED not in s.headers
            s.read()
        assert gw.http.post(CHAT, json=ASK, headers=inside).status_code == 200
        streamed, plain = chat_bodies(vllm)[-2:]
        assert {k: streamed[k] for k in NEUTRAL_SAMPLING} == {**NEUTRAL_SAMPLING, "temperature": 0.5}
        assert {k: plain[k] for k in NEUTRAL_SAMPLING} == NEUTRAL_SAMPLING

        # Anthropic: the converted request gets the same rules, named as the client named them.
        client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
        tool = {"name": "get_weather", "input_schema": {"type": "object"}}
        for choice, field in (({"type": "any"}, "tool_choice"), ({"type": "tool", "name": "get_weather"},
                                                                  "tool_choice"),
                              ({"type": "auto", "disable_parallel_tool_use": True},
                               "tool_choice.disable_parallel_tool_use")):
            with pytest.raises(anthropic.BadRequestError) as refused:
                client.messages.create(model="tiny", max_tokens=4, tools=[tool], tool_choice=choice,
                                       messages=[{"role": "user", "content": "hi"}], extra_headers=inside)
            assert refused.value.body["error"]["code"] == "capture_field_refused"
            assert refused.value.body["error"]["message"].startswith(field + " is not allowed")
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"temperature": 0.0}, extra_headers=inside)
        assert refused.value.body["error"]["code"] == "capture_field_refused"
        assert "greedy decoding" in refused.value.body["error"]["message"]
        raw = client.messages.with_raw_response.create(model="tiny", max_tokens=4,
                                                       messages=[{"role": "user", "content": "hi"}],
                                                       extra_body={"temperature": 0.4, "top_k": 3},
                                                       extra_headers=inside)
        assert IGNORED not in raw.headers
        sent = chat_bodies(vllm)[-1]
        assert {k: sent[k] for k in NEUTRAL_SAMPLING} == {**NEUTRAL_SAMPLING, "temperature": 0.4, "top_k": 3}

        # The samples hold the sampling each call was made with, in the request and in their `sampling` record.
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0}).json() == {"sample_count": 6}
        listing = gw.signed("GET", "/v1/rl/trajectories", params={"limit": 100}).json()["items"]
        recorded = []
        for item in listing:
            sample = gw.signed("GET", f"/v1/rl/trajectories/{item['trajectory_id']}").json()
            request = sample["request"]
            assert item["sampling"] == sample["sampling"] == {k: request[k] for k in NEUTRAL_SAMPLING}
            recorded.append(sample["sampling"])
            assert all(request.get(field) != value for field, value in REFUSED), request
            assert not set(DROPPED_SENT) & set(request)
        assert {**NEUTRAL_SAMPLING, **HONOURED_SENT} in recorded
        assert {**NEUTRAL_SAMPLING, "temperature": 0.4, "top_k": 3} in recorded

        # Outside a Task the same fields are forwarded exactly as sent.
        spoiling = {**ASK, "logit_bias": {"42": 100}, "temperature": 0.01, "min_tokens": 2, "metadata": {"a": 1}}
        r = gw.http.post(CHAT, json=spoiling)
        assert r.status_code == 200 and IGNORED not in r.headers
        assert chat_bodies(vllm)[-1] == spoiling


# ------------------------------------------------------------------------------- item 6: capture secrets


def test_a_capture_secret_guards_its_task_and_tasks_without_one_behave_as_before(redis, redis_url, tmp_path, vllm,
                                                                                 capsys):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        assert error_of(start_task(gw, "s-guarded", capture_secret="yes")) == (400, "invalid_task_request")
        r = start_task(gw, "s-guarded", capture_secret=True)
        assert r.status_code == 201, r.text
        assert r.headers["cache-control"] == "no-store"
        t, secret = r.json()["rl_task_id"], r.json()["capture_secret"]
        assert isinstance(secret, str) and len(secret) >= 40
        assert "capture_secret" not in gw.signed("GET", f"/v1/rl/tasks/{t}").json()  # the RL Service never has it

        # Knowing the session id is not enough: no secret, a wrong one, the secret of another Task.
        other = start_task(gw, "s-other", capture_secret=True).json()
        for headers, code in (({}, "capture_secret_required"),
                              ({SECRET: "x" * len(secret)}, "invalid_capture_secret"),
                              ({SECRET: secret[:-1]}, "invalid_capture_secret"),
                              ({SECRET: other["capture_secret"]}, "invalid_capture_secret")):
            r = gw.http.post(CHAT, json=ASK, headers={SESSION: "s-guarded", **headers})
            assert error_of(r) == (403, code), r.text
            r = gw.http.post("/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                                   "messages": [{"role": "user", "content": "hi"}]},
                             headers={SESSION: "s-guarded", **headers})
            assert error_of(r) == (403, code), r.text
        assert chat_bodies(vllm) == []
        assert capture_sets(redis_url, t) == {"all": 0, "open": 0, "committed": 0}

        # A repeated start cannot issue a new secret nor drop the old one.
        again = start_task(gw, "s-guarded", capture_secret=True)
        assert error_of(again) == (409, "capture_secret_unavailable") and t in again.json()["error"]["message"]
        again = start_task(gw, "s-guarded")
        assert again.status_code == 200 and again.json()["rl_task_id"] == t and "capture_secret" not in again.json()
        assert error_of(gw.http.post(CHAT, json=ASK, headers={SESSION: "s-guarded"})) == (403,
                                                                                         "capture_secret_required")

        # The right secret captures, JSON and SSE.
        r = gw.http.post(CHAT, json=ASK, headers={SESSION: "s-guarded", SECRET: secret})
        assert r.status_code == 200, r.text
        with gw.http.stream("POST", CHAT, json={**ASK, "stream": True},
                            headers={SESSION: "s-guarded", SECRET: secret}) as s:
            assert s.status_code == 200 and b"[DONE]" in s.read()
        assert all(b["return_token_ids"] is True for b in chat_bodies(vllm))

        # The operator CLI asks for one and prints it once.
        code = main(["task", "start", "--session", "s-cli", "--capture-secret"],
                    env={KEY_FILE_ENV: str(gw.dir / "hmac.json"), URL_ENV: gw.url})
        out = capsys.readouterr().out
        assert code == 0, out
        cli_secret = next(line.split()[-1] for line in out.splitlines() if line.startswith("capture secret"))
        assert error_of(gw.http.post(CHAT, json=ASK, headers={SESSION: "s-cli"}))[0] == 403
        assert gw.http.post(CHAT, json=ASK, headers={SESSION: "s-cli", SECRET: cli_secret}).status_code == 200

        # A Task started without a secret behaves as before: the session id alone captures.
        plain = start_task(gw, "s-plain")
        assert plain.status_code == 201 and "capture_secret" not in plain.json()
        assert gw.http.post(CHAT, json=ASK, headers={SESSION: "s-plain"}).status_code == 200

        for task, count in ((t, 2), (plain.json()["rl_task_id"], 1)):
            assert gw.signed("POST", f"/v1/rl/tasks/{task}/stop").json()["status"] == "finalized"
            r = gw.signed("POST", f"/v1/rl/tasks/{task}/reward", json={"reward": 1.0})
            assert r.json() == {"sample_count": count}, r.text
        # Once its Task ended, the session is plain uncaptured traffic again.
        assert gw.http.post(CHAT, json=ASK, headers={SESSION: "s-guarded"}).status_code == 200
        assert "return_token_ids" not in chat_bodies(vllm)[-1]
        # The secrets reach no log.
        logs = gw.stderr() + "".join(p.read_text(errors="replace") for p in gw.dir.glob("*.log"))
        assert secret not in logs and other["capture_secret"] not in logs and cli_secret not in logs


# ------------------------------------------------------------------------- weakness: bypass model names


def test_outside_a_task_only_the_base_model_or_the_active_version_can_be_named(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        activate_v1(gw, agent(gw))
        r = gw.http.post(CHAT, json={**ASK, "model": "tiny:v1"})
        assert r.status_code == 200 and chat_bodies(vllm)[-1]["model"] == "tiny:v1"  # the active version
        pinned = start_task(gw, "s-pinned").json()
        assert pinned["policy_model"] == "tiny:v1"
        assert gw.signed("DELETE", "/v1/loras/tiny").status_code == 204  # rolled back; v1 stays for its Task

        before = len(chat_bodies(vllm))
        r = gw.http.post(CHAT, json={**ASK, "model": "tiny:v1"})
        assert error_of(r) == (404, "model_not_found") and "tiny:v1" in r.json()["error"]["message"]
        r = gw.http.post(CHAT, json={**ASK, "model": "tiny:v1", "stream": True}, headers={SESSION: "no-task"})
        assert error_of(r) == (404, "model_not_found")
        assert len(chat_bodies(vllm)) == before  # nothing reached the instance
        # The pinned Task keeps its version, and base traffic is served.
        assert gw.http.post(CHAT, json=ASK, headers={SESSION: "s-pinned"}).status_code == 200
        assert chat_bodies(vllm)[-1]["model"] == "tiny:v1"
        assert gw.http.post(CHAT, json=ASK).status_code == 200 and chat_bodies(vllm)[-1]["model"] == "tiny"
        assert "tiny:v1" in vllm.loaded
