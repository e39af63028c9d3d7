"""The web console with real processes: gateway + RL Service child (scripted trainer) + private Redis + fake vLLM and
Judge, agents through the official `openai` SDK. One real run feeds every test: rewarded Tasks on base, a Training Run
that activates `tiny:v1`, a rewarded Task of lineage `support` and its run (`tiny:support:v1`), a delayed-feedback Task
judged per turn, and a Task still active (pinned to v1).

The pages are driven in headless Chromium (the Debian `chromium` package, through Playwright's `executable_path`):
they load, show the run's data, log no console error and no failed request. Screenshots go to
`test-artifacts/console/` (git-ignored; the CI artifacts); docs/img/console-*.png are copies of them
(`cp test-artifacts/console/console-*.png docs/img/`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis as redis_sync

from openjiuwen.agent_evolving.agent_rl.gateway.console.console_auth import COOKIE_NAME, ConsoleAuth, login_token
from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import sign, sign_request
from tests.support.fake_judge import FakeJudge
from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import API_KEY, REPO_ROOT, GatewayProcess

pytestmark = pytest.mark.system

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = REPO_ROOT / "test-artifacts" / "console"
RUN_TIMEOUT_S = 30.0
TURN = "X-Agent-Turn-Id"


@dataclass
class ConsoleRun:
    gw: GatewayProcess
    base_tasks: list[str] = field(default_factory=list)
    v1_tasks: list[str] = field(default_factory=list)
    delayed_task: str = ""
    active_task: str = ""
    run_id: str = ""
    support_task: str = ""
    support_run_id: str = ""


def now_ms() -> int:
    return int(time.time() * 1000)


def chat(client: openai.OpenAI, session: str, turn: str | None = None, **sampling: Any) -> None:
    headers = {"X-Agent-Session-Id": session, **({TURN: turn} if turn else {})}
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         extra_headers=headers, **sampling)
    assert out.choices[0].message.content


def start(gw: GatewayProcess, session: str, mode: str = "terminal", lineage: str | None = None) -> str:
    if lineage is None:
        r = gw.start_task(session, mode)
    else:
        r = gw.signed("POST", "/v1/rl/tasks/start", json={"reward_mode": mode, "lineage": lineage},
                      headers={"X-Agent-Session-Id": session})
    assert r.status_code == 201, r.text
    return r.json()["rl_task_id"]


def stop(gw: GatewayProcess, rl_task_id: str) -> None:
    r = gw.signed("POST", f"/v1/rl/tasks/{rl_task_id}/stop")
    assert r.status_code == 200 and r.json()["status"] == "finalized", r.text


def rewarded_task(gw: GatewayProcess, client: openai.OpenAI, session: str, reward: float, chats: int = 1,
                  lineage: str | None = None) -> str:
    t = start(gw, session, lineage=lineage)
    for n in range(chats):  # the agent's own sampling; a third chat asks for JSON (issue 35: served, recorded)
        chat(client, session, **({"temperature": 0.7, "top_p": 0.9} if n == 1 else
                                 {"response_format": {"type": "json_object"}} if n == 2 else {}))
    stop(gw, t)
    r = gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": reward})
    assert r.status_code == 200, r.text
    return t


def wait_run(gw: GatewayProcess, run_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        record = gw.signed("GET", f"/v1/rl/training/runs/{run_id}").json()
        if record["status"] in ("succeeded", "failed", "canceled"):
            return record
        assert time.monotonic() < deadline, record
        time.sleep(0.1)


@pytest.fixture(scope="module")
def run(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConsoleRun]:
    clear_keys(redis_url)  # a clean key space before and after: the suite shares one redis-server
    tmp = tmp_path_factory.mktemp("console")
    with FakeVLLM(served_model="tiny", name="vllm-a") as a, FakeVLLM(served_model="tiny", name="vllm-b") as b, \
            FakeJudge() as judge, GatewayProcess(tmp, redis_url, instances=[a, b], judge_url=judge.url) as gw:
        gw.start_service()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        out = ConsoleRun(gw)
        out.base_tasks = [rewarded_task(gw, client, f"base-{i}", reward, chats=i + 1)
                          for i, reward in enumerate((0.2, 0.5, 0.3))]
        gw.set_plan({"outcome": "succeed", "steps": [  # a few PPO steps for the run's metric charts
            {"step": i + 1, "loss": round(0.9 - 0.15 * i, 3), "kl": round(0.01 * i, 3), "grad_norm": 1.0 - 0.1 * i,
             "samples": 6} for i in range(5)],
            "sampling": {"tokens": 24, "temperatures": {"1": 4, "0.7": 2}, "truncated_samples": 2,  # as PPO reports
                         "logprob_mismatch_mean": 0.0125, "logprob_mismatch_max": 0.105,
                         "untruncated_mismatch_max": 3e-6, "ratio_clipped_share": 0.0417, "correction": "ppo_clip"}})
        r = gw.signed("POST", "/v1/rl/training/runs")
        assert r.status_code == 201, r.text
        record = wait_run(gw, r.json()["training_run_id"])
        assert (record["status"], record["lora_name"]) == ("succeeded", "tiny:v1"), record
        out.run_id = record["training_run_id"]
        out.v1_tasks = [rewarded_task(gw, client, f"v1-{i}", reward) for i, reward in enumerate((0.8, 0.9))]
        # A second lineage with a version of its own: what the console's lineage selector switches to.
        out.support_task = rewarded_task(gw, client, "support-0", 0.6, lineage="support")
        r = gw.signed("POST", "/v1/rl/training/runs", json={"lineage": "support"})
        assert r.status_code == 201, r.text
        record = wait_run(gw, r.json()["training_run_id"])
        assert (record["status"], record["lora_name"]) == ("succeeded", "tiny:support:v1"), record
        out.support_run_id = record["training_run_id"]
        # An archived lineage (docs/lineages.md "Lifecycle"): the selector marks it.
        stop(gw, start(gw, "old-0", lineage="old"))
        assert gw.signed("POST", "/v1/rl/lineages/old/archive").status_code == 200
        out.delayed_task = start(gw, "delayed", "delayed_feedback")
        chat(client, "delayed", "u1")
        chat(client, "delayed", "u2")  # a new turn: the Judge scores u1
        stop(gw, out.delayed_task)  # publishes u2
        out.active_task = start(gw, "still-active")
        chat(client, "still-active")
        yield out
    clear_keys(redis_url)


def clear_keys(redis_url: str) -> None:
    with redis_sync.Redis.from_url(redis_url) as r:  # only the service's own prefix, never FLUSHDB
        for key in r.scan_iter(match="rl:v1:*", count=1000):
            r.delete(key)


@contextmanager
def login(gw: GatewayProcess) -> Iterator[httpx.Client]:
    """A client holding a fresh console session cookie."""
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        r = client.post("/console/login", json={"token": login_token(API_KEY, expires_ms=now_ms() + 60_000)})
        assert r.status_code == 204, r.text
        yield client


# -------------------------------------------------------------------------------------------- auth over HTTP


def test_without_a_session_the_console_shows_the_login_page_and_the_api_refuses(run: ConsoleRun) -> None:
    http = run.gw.http
    bare = http.get("/console", follow_redirects=False)
    assert (bare.status_code, bare.headers["location"]) == (308, "/console/")
    page = http.get("/console/")
    assert page.status_code == 200 and "Console login" in page.text and "console.js" not in page.text
    for path in ("/console/api/overview", "/console/api/rl/tasks", f"/console/api/rl/runs/{run.run_id}"):
        r = http.get(path)
        assert (r.status_code, r.json()["error"]["code"]) == (401, "console_unauthorized"), path
    # A signed control request is no console credential either.
    r = http.get("/console/api/overview", headers=sign_request(API_KEY, "GET", "/console/api/overview", b"",
                                                               now_ms=now_ms()))
    assert r.status_code == 401


def test_a_login_token_opens_one_session_and_only_once(run: ConsoleRun) -> None:
    http = run.gw.http
    token = login_token(API_KEY, expires_ms=now_ms() + 60_000)
    r = httpx.post(run.gw.url + "/console/login", json={"token": token})
    assert r.status_code == 204
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(COOKIE_NAME + "=")
    attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")[1:]}
    assert {"httponly", "max-age", "path"} <= attributes and "samesite=strict" in cookie.lower()
    assert "path=/console" in cookie.lower()
    assert httpx.get(run.gw.url + "/console/api/overview", cookies=r.cookies).status_code == 200
    # Replayed, forged, expired, too long-lived, a control signature, junk: all refused without a cookie.
    ts = str(now_ms())
    for bad in (token, token[:-1] + ("0" if token[-1] != "0" else "1"),
                login_token(b"x" * 32, expires_ms=now_ms() + 60_000),
                login_token(API_KEY, expires_ms=now_ms() - 1),
                login_token(API_KEY, expires_ms=now_ms() + 25 * 3600 * 1000),
                f"{ts}.{sign(API_KEY, b'', now_ms=int(ts))['X-Signature']}", "", 7, None):
        r = http.post("/console/login", json={"token": bad})
        assert (r.status_code, r.json()["error"]["code"]) == (401, "console_unauthorized"), bad
        assert "set-cookie" not in r.headers
    typed = {"content-type": "application/json"}
    assert http.post("/console/login", content=b"not json", headers=typed).status_code == 400
    assert http.post("/console/login", content=b"x" * 5000, headers=typed).status_code == 413
    assert http.post("/console/login", content=iter([b"x" * 600, b"x" * 600]), headers=typed).status_code == 413
    assert http.post("/console/login", content=b"{}").status_code == 415  # an untyped body: refused unread
    assert token not in run.gw.stderr()  # the gateway's log names the login, never the token
    assert "console session opened" in run.gw.stderr()


def test_forged_tampered_and_expired_cookies_are_refused(run: ConsoleRun) -> None:
    good, _ = ConsoleAuth(API_KEY).issue(now_ms=now_ms())
    expires, nonce, mac = good.split(".")
    expired, _ = ConsoleAuth(API_KEY, session_ttl_ms=1).issue(now_ms=now_ms() - 10_000)
    forged, _ = ConsoleAuth(b"y" * 32).issue(now_ms=now_ms())
    for bad in (expired, forged, f"{int(expires) + 1}.{nonce}.{mac}", f"{expires}.{nonce}.{'0' * 64}",
                f"{expires}.{nonce}", "garbage"):
        r = httpx.get(run.gw.url + "/console/api/overview", cookies={COOKIE_NAME: bad})
        assert r.status_code == 401, bad
        assert "Console login" in httpx.get(run.gw.url + "/console/", cookies={COOKIE_NAME: bad}).text
    assert httpx.get(run.gw.url + "/console/api/overview", cookies={COOKIE_NAME: good}).status_code == 200


def test_the_console_api_is_read_only_and_allow_listed(run: ConsoleRun) -> None:
    with login(run.gw) as client:
        overview = client.get("/console/api/overview")
        assert overview.status_code == 200
        assert overview.headers["cache-control"] == "no-store"
        assert "default-src 'none'" in overview.headers["content-security-policy"]
        data = overview.json()
        assert data["service"]["status"] == "running"
        lora = data["lora"]
        assert lora["active_lora"]["lora_name"] == "tiny:v1" and lora["status"] == "active"
        assert sorted((i["name"], "tiny:v1" in i["loaded"]) for i in lora["instance_list"]) == [
            ("vllm-a", True), ("vllm-b", True)]
        assert lora["leases"] == {"tiny:v1": 1}  # the still-active Task is pinned to v1
        assert data["trajectories"]["total"] >= 6
        task = client.get(f"/console/api/rl/tasks/{run.v1_tasks[0]}")
        assert task.json()["policy_lora_name"] == "tiny:v1"
        events = client.get(f"/console/api/rl/runs/{run.run_id}/events").json()["items"]
        assert [e["type"] for e in events][0] == "created" and events[-1]["type"] == "succeeded"
        # Only the allow-listed RL reads: no trajectory detail, no path tricks, no writes.
        sample = run.gw.signed("GET", "/v1/rl/trajectories", params={"limit": 1}).json()["items"][0]
        for path in (f"rl/trajectories/{sample['trajectory_id']}", "rl/tasks/%2E%2E",
                     "rl/tasks/%2E%2E/trajectories", "rl/service", "nothing"):
            assert client.get("/console/api/" + path).status_code == 404, path
        assert client.post(f"/console/api/rl/tasks/{run.active_task}/stop").status_code == 405
        assert client.get(f"/console/api/rl/tasks/{run.active_task}").json()["status"] == "active"
        # No secret in what the console serves.
        bodies = [client.get(p).text for p in ("/console/", "/console/login", "/console/assets/console.js",
                                                "/console/assets/login.js", "/console/api/overview")]
        assert not any(API_KEY.decode() in b for b in bodies)


def test_the_lineage_selector_api_lists_default_first_and_shows_each_line(run: ConsoleRun) -> None:
    with login(run.gw) as client:
        # The RL Service never lists `default` (it always exists); the selector's list starts with it.
        listed = client.get("/console/api/lineages")
        assert listed.status_code == 200 and listed.headers["cache-control"] == "no-store"
        body = listed.json()
        assert [(i["lineage"], i["line"], i.get("state")) for i in body["items"]] == [
            ("default", "tiny", None), ("old", "tiny:old", "archived"), ("support", "tiny:support", "live")]
        assert body["lineages_supported"] is True and body["next_cursor"] is None
        first = client.get("/console/api/lineages", params={"limit": 1}).json()  # `limit` is the RL Service's
        assert [i["lineage"] for i in first["items"]] == ["default", "old"]
        default = client.get("/console/api/loras/tiny").json()
        assert default["active_lora"]["lora_name"] == "tiny:v1"
        support = client.get("/console/api/loras/tiny:support").json()
        assert support["active_lora"]["lora_name"] == "tiny:support:v1"
        other = client.get("/console/api/loras/tiny:other").json()
        assert other["status"] == "base" and other["active_lora"] is None  # a line with no version yet
        for path, expected in (("tiny:v2", (400, "invalid_lineage")), ("other:support", (404, "model_not_found"))):
            r = client.get("/console/api/loras/" + path)
            assert (r.status_code, r.json()["error"]["code"]) == expected, path
        # The selected lineage reaches the RL Service's listing as `?lineage=`.
        versions = {lineage: [p["policy_version"] for p in client.get(
            "/console/api/rl/policies", params={"lineage": lineage}).json()["items"]]
            for lineage in ("default", "support")}
        assert versions == {"default": ["base", "tiny:v1"], "support": ["base", "tiny:support:v1"]}
    with httpx.Client(base_url=run.gw.url, timeout=30) as anonymous:
        for path in ("/console/api/lineages", "/console/api/loras/tiny"):
            assert anonymous.get(path).status_code == 401, path


# -------------------------------------------------------------------------------------------- the browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "the Debian chromium package is missing: `make test` installs it"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


def test_console_pages_in_headless_chromium(run: ConsoleRun, browser: Any) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning")
            else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)

    def show(route: str) -> None:
        page.goto(f"{run.gw.url}/console/#{route}")
        # Selector waits, not wait_for_function: polling a JS predicate needs eval, which the console's CSP refuses.
        page.wait_for_selector(f'#view[data-route="{route}"]', state="attached")

    def shot(name: str) -> None:
        page.screenshot(path=str(ARTIFACTS / f"console-{name}.png"), full_page=True)

    def text() -> str:
        return page.inner_text("#view")

    try:
        page.goto(run.gw.url + "/console/")  # no session yet: the login page
        assert "Not logged in" in page.inner_text("#login-state")
        token = login_token(API_KEY, expires_ms=now_ms() + 60_000)
        page.goto(f"{run.gw.url}/console/login#token={token}")
        page.wait_for_url(run.gw.url + "/console/")
        assert "#" not in page.url and token not in page.url
        cookie = next(c for c in context.cookies() if c["name"] == COOKIE_NAME)
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert page.evaluate("document.cookie") == ""  # HttpOnly: scripts cannot read it

        page.wait_for_selector('#view[data-route="/"]', state="attached")
        shot("overview")
        assert "running" in text() and "tiny:v1" in text()

        show("/tasks")
        shot("tasks")
        for t in run.base_tasks + run.v1_tasks + [run.delayed_task]:
            assert t in text()

        show(f"/tasks/{run.base_tasks[2]}")
        shot("task")
        body = text()
        assert "capture_committed" in body and "reward_recorded" in body and "after finalize" in body
        assert "T 1 · T 0.7 top_p 0.9 · T 1 [json_object]" in body  # each capture's sampling, as the agent asked
        assert page.locator("svg.chart rect").count() >= 6  # created, 3 × reserved + committed, finalized, reward

        show(f"/tasks/{run.delayed_task}")
        shot("task-delayed")
        body = text()
        assert "judge" in body and "turn u1" in body and "turn u2" in body and "after last capture" in body

        show(f"/runs/{run.run_id}")
        shot("run")
        body = text()
        for word in ("succeeded", "tiny:v1", "queued", "training", "activating", "activation_succeeded",
                     "loss per step", "T 1×4, 0.7×2 · truncated 2 · |captured − recomputed| mean 0.0125, max 0.1050 · "
                     "ratios clipped 4.2% (ppo_clip)", "sample → policy p50 / p95", "by activation)",
                     "eligible → run wait", "constrained samples by kind", "json_object×1"):
            assert word in body, word
        assert page.locator("svg.chart circle.dot").count() == 4 * 5  # loss, kl, grad_norm, samples × 5 steps

        show("/policies")
        shot("policies")
        body = text()
        assert "tiny:v1" in body and "base" in body
        assert page.locator("svg.chart circle.dot").count() == 2  # base and v1 carry rewards

        show("/loras")
        shot("loras")
        body = text()
        assert "vllm-a" in body and "vllm-b" in body and "tiny:v1" in body
        before = page.get_attribute("#view", "data-loads")
        page.click("#refresh")  # reads the page again
        page.wait_for_selector(f'#view:not([data-loads="{before}"])', state="attached")
        assert "vllm-a" in text()

        show("/rollout")  # immediate mode: no rollout, and the page says so
        assert "immediate" in text() and "No rollout yet" in text()

        # The lineage selector: `default` first, then each registered lineage; the per-lineage views follow it.
        def pick(lineage: str, route: str) -> None:
            page.select_option("#lineage", lineage)
            page.wait_for_selector(f'#view[data-route="{route}"][data-lineage="{lineage}"]', state="attached")

        def scope() -> str:
            return page.inner_text("#scope")

        show("/policies")
        assert page.locator("#lineage option").all_inner_texts() == ["default", "old (archived)", "support"]
        assert page.input_value("#lineage") == "default" and "lineage default (tiny)" in scope()
        pick("old", "/policies")
        assert "lineage old (tiny:old), archived: no new Tasks or Training Runs until restored" in scope()
        pick("support", "/policies")
        shot("policies-lineage")
        body = text()
        assert "Policies of lineage support" in body and "tiny:support:v1" in body and "tiny:v1" not in body
        assert "lineage support (tiny:support)" in scope()
        show("/loras")  # the choice stays while moving between views
        body = text()
        assert "LoRA state of tiny:support" in body and "active LoRA\ntiny:support:v1" in body
        show("/rollout")
        # The RL Service answers the rollout per lineage (immediate mode here: no rollout of support either).
        assert "Rollout of lineage support" in text() and "No rollout yet" in text()
        assert "lineage support (tiny:support)" in scope()
        show("/tasks")  # the selected lineage's Tasks only (the RL listing's ?lineage=, docs/lineages.md)
        assert run.support_task in text() and run.base_tasks[0] not in text()
        assert "lineage support (tiny:support)" in scope()
        page.locator(f'a[href="#/tasks/{run.support_task}"]').click()
        page.wait_for_selector(f'#view[data-route="/tasks/{run.support_task}"]', state="attached")
        assert "lineage\nsupport" in text()
        show("/runs")
        assert run.support_run_id in text() and run.run_id not in text()
        assert "sample → policy p50 / p95" in text()  # each run's freshness, this lineage's runs only
        page.reload()  # the tab keeps its choice
        page.wait_for_selector('#view[data-route="/runs"][data-lineage="support"]', state="attached")
        show("/policies")
        pick("default", "/policies")
        assert "tiny:v1" in text() and "tiny:support:v1" not in text()

        page.click("#logout")
        page.wait_for_url(run.gw.url + "/console/login")
        assert all(c["name"] != COOKIE_NAME for c in context.cookies())
    finally:
        context.close()
    assert problems == []



def test_with_the_rl_service_stopped_the_console_still_shows_the_lora_state(run: ConsoleRun) -> None:
    """Runs last in this module: it stops the RL Service of the shared run."""
    r = run.gw.signed("POST", "/v1/rl/service/stop")
    assert r.status_code == 200, r.text
    with login(run.gw) as client:
        overview = client.get("/console/api/overview").json()
        assert overview["service"]["status"] == "stopped" and overview["trajectories"] is None
        assert overview["lora"]["active_lora"]["lora_name"] == "tiny:v1"
        r = client.get("/console/api/rl/tasks")
        assert (r.status_code, r.json()["error"]["code"]) == (503, "rl_service_unavailable")
