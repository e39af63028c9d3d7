"""Attacks on the inference path with real processes (issue 19 items 5 and 6, and the bypass-model weakness).

Each test starts the reference gateway (with its RL Service child where capture matters) over a fake vLLM on a
loopback socket and performs the attack as a client, a rogue instance or a browser would:

- a rogue instance answers 418 `text/html` with a script: the client gets the gateway's JSON envelope, with
  `nosniff` and a deny-all CSP, and headless Chromium runs no script on the gateway's origin;
- every gateway answer carries `nosniff` and a CSP;
- inside a Task every request vLLM serves is served as sent and captured, its constraints recorded (issue 35); only
  a value vLLM itself refuses is refused;
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
from openjiuwen.agent_evolving.agent_rl.gateway.console.console_auth import login_token
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


# ------------------------------------------------------------- issue 35: every field served, its constraint recorded


# (extra request fields, the constraint kinds the sample records): everything issue 19 refused inside a Task.
SERVED: list[tuple[dict[str, Any], set[str]]] = [
    ({"logit_bias": {"42": 100}}, {"logit_bias"}),
    ({"allowed_token_ids": [5, 6]}, {"allowed_tokens"}),
    ({"bad_words": ["no"]}, {"banned_tokens"}),
    ({"min_tokens": 3}, {"min_tokens"}),
    ({"ignore_eos": True}, {"ignore_eos"}),
    ({"response_format": {"type": "json_object"}}, {"json_object"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     {"json_schema"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice"}),
    ({"guided_json": {"type": "object"}}, {"json_schema"}),
    ({"guided_regex": "[a-z]+"}, {"regex"}),
    ({"chat_template": "{{ 'hidden system prompt' }}"}, {"chat_template"}),
    ({"chat_template_kwargs": {"chat_template": "{{ 'hidden' }}"}}, {"chat_template"}),
    ({"tool_choice": "required"}, {"tool_required"}),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, {"tool_named"}),
    ({"parallel_tool_calls": False}, {"single_tool_call"}),
    ({"tools": [{"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}]}, {"strict_tools"}),
    ({"thinking_token_budget": 8}, {"thinking_budget"}),
    ({"watermarking": True}, {"watermarking"}),
    ({"vllm_xargs": {"bias": 1}}, {"logits_processors"}),
    ({"logprobs": True, "logprob_token_ids": [5]}, set()),
    ({"echo": True}, {"echo"}),
    ({"add_generation_prompt": False}, {"no_generation_prompt"}),
    ({"continue_final_message": True}, {"continue_final_message"}),
    ({"use_beam_search": True}, {"beam_search"}),
    ({"best_of": 4}, {"beam_search"}),
    ({"temperature": 0}, {"greedy"}),
    ({"temperature": 0.005}, set()),  # vLLM raises it to 0.01: the record says 0.01
    ({"presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.3}, {"penalties"}),
    ({"metadata": {"who": "x"}, "prompt_logprobs": 2, "some_future_field": True}, set()),
]
# What the RL Service adds to a captured request: the capture flags and every sampling field named.
INJECTED = {"logprobs", "top_logprobs", "return_token_ids", "stream_options", "temperature", "top_p", "top_k",
            "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}


def test_every_field_vllm_serves_is_served_inside_a_task_as_outside_and_recorded(redis, redis_url, tmp_path, vllm):
    """Issue 35: nothing is refused or dropped for capture's sake. Inside a Task each request reaches vLLM as the
    client sent it (only the capture flags and explicit sampling defaults added), it is captured, and its sample
    records what constrained its sampling; the training policy excludes the kinds it excludes. A value vLLM itself
    refuses is 400 `invalid_request`, sent nowhere. Outside a Task the same requests are forwarded exactly."""
    vllm.reply = Reply(content="Sure.", tool_calls=[ToolCall("get_weather", {"city": "Paris"})])
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        t = start_task(gw, "s-fields").json()["rl_task_id"]
        inside = {SESSION: "s-fields"}
        sent_bodies = []
        for row, (extra, _) in enumerate(SERVED):
            body = {**ASK, "messages": [{"role": "user", "content": f"row {row}"}], "tools": [WEATHER_TOOL], **extra}
            r = gw.http.post(CHAT, json=body, headers=inside)
            assert r.status_code == 200, (extra, r.text)
            assert IGNORED not in r.headers
            upstream = chat_bodies(vllm)[-1]
            assert {k: v for k, v in upstream.items() if k not in INJECTED} == {
                k: v for k, v in body.items() if k not in INJECTED}, extra
            assert {k: upstream[k] for k in extra if k in INJECTED and k != "logprobs"} == {
                k: v for k, v in extra.items() if k in INJECTED and k != "logprobs"}
            assert upstream["return_token_ids"] is True and upstream["logprobs"] is True
            sent_bodies.append(body)
        # Several choices: each is a sample of the same prompt, JSON and SSE (vLLM interleaves the choices' chunks).
        r = gw.http.post(CHAT, json={**ASK, "messages": [{"role": "user", "content": "three"}], "n": 3},
                         headers=inside)
        assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
        with gw.http.stream("POST", CHAT, json={**ASK, "messages": [{"role": "user", "content": "two"}], "n": 2,
                                                "stream": True}, headers=inside) as stream:
            assert stream.status_code == 200
            chunks = [orjson.loads(line[6:]) for line in stream.iter_lines()
                      if line.startswith("data: {")]
        assert {c["choices"][0]["index"] for c in chunks if c.get("choices")} == {0, 1}
        # A value vLLM itself would refuse: the client's mistake, answered before anything is sent or captured.
        upstream_calls = len(chat_bodies(vllm))
        for bad, message in (({"top_p": 1.5}, "top_p must be in (0, 1]"), ({"n": 0}, "n must be a positive integer"),
                             ({"temperature": 0, "n": 2}, "n must be 1 under greedy decoding"),
                             ({"top_logprobs": 2}, "top_logprobs must be absent or 0 unless logprobs is true")):
            r = gw.http.post(CHAT, json={**ASK, **bad}, headers=inside)
            assert error_of(r) == (400, "invalid_request") and r.json()["error"]["message"].startswith(message), bad
        assert len(chat_bodies(vllm)) == upstream_calls

        # Anthropic: forced tools, no parallel calls, a strict tool, structured output and greedy decoding are
        # served too, converted as vLLM converts them.
        client = anthropic.Anthropic(base_url=gw.url, api_key="x", max_retries=0)
        tool = {"name": "get_weather", "input_schema": {"type": "object"}, "strict": True}
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"},
                       {"type": "auto", "disable_parallel_tool_use": True}):
            message = client.messages.create(model="tiny", max_tokens=4, tools=[tool], tool_choice=choice,
                                             messages=[{"role": "user", "content": "hi"}], extra_headers=inside)
            assert message.content
        converted = chat_bodies(vllm)[-3:]
        assert [b["tool_choice"] for b in converted] == [
            "required", {"type": "function", "function": {"name": "get_weather"}}, "auto"]
        assert converted[-1]["parallel_tool_calls"] is False
        assert all(b["tools"][0]["function"]["strict"] is True for b in converted)
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"temperature": 0.0, "output_config": {"format": {
                                   "type": "json_schema", "schema": {"type": "object"}}}}, extra_headers=inside)
        greedy_schema = chat_bodies(vllm)[-1]
        assert greedy_schema["temperature"] == 0 and greedy_schema["response_format"]["type"] == "json_schema"

        # Each sample records its constraints; the default policy excludes greedy decoding, the prompt reshapers,
        # the unjudged processors and beam search, and trains the rest with the correction.
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/stop").json()["status"] == "finalized"
        expected_samples = len(SERVED) + 3 + 2 + 4
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0}).json() == {
            "sample_count": expected_samples}
        listing = gw.signed("GET", "/v1/rl/trajectories", params={"limit": 100}).json()["items"]
        assert len(listing) == expected_samples
        by_row = {}
        for item in listing:
            sample = gw.signed("GET", f"/v1/rl/trajectories/{item['trajectory_id']}").json()
            assert item["sampling"] == sample["sampling"] and item["exclusion"] == sample.get("exclusion")
            by_row.setdefault(sample["request"]["messages"][-1]["content"], []).append(sample)
        excluded_by_default = {"greedy", "echo", "no_generation_prompt", "continue_final_message", "chat_template",
                               "watermarking", "logits_processors", "beam_search"}
        for row, (extra, kinds) in enumerate(SERVED):
            (sample,) = by_row[f"row {row}"]
            assert set(sample["sampling"]["constraints"]) == kinds, (extra, sample["sampling"])
            assert {k: v for k, v in sample["request"].items() if k not in INJECTED} == {
                k: v for k, v in sent_bodies[row].items() if k not in INJECTED}
            excluded = kinds & excluded_by_default
            assert sample["status"] == ("excluded" if excluded else "pending"), extra
            assert sample.get("exclusion") == ({"reason": "constraint", "kinds": sorted(
                excluded, key=list(sample["sampling"]["constraints"]).index)} if excluded else None)
        assert by_row["row 26"][0]["sampling"]["temperature"] == 0.01  # what vLLM applied to 0.005
        assert by_row["row 25"][0]["sampling"]["top_p"] == 1.0
        three, two = by_row["three"], by_row["two"]
        assert sorted(s["choice_index"] for s in three) == [0, 1, 2] and {s["group_uid"] for s in three} == {
            f"{t}:{three[0]['sample_id'].split('.')[0]}"}
        assert sorted(s["choice_index"] for s in two) == [0, 1]
        assert all(s["trajectory"]["response_ids"] for s in three + two)

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
