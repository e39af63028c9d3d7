"""Agents written with the real frameworks (issue 35 item 4) run unchanged inside a Task: each pattern of
tests/compat/frameworks.py `RUNS` runs once outside a Task and once inside one, through the real gateway and RL
Service, against the fake vLLM (vLLM 0.32's recorded shapes) answered by a fake model that follows the conversation.

Inside, each must finish exactly as outside (same output, same number of model calls, each upstream request the one
sent outside plus the capture flags only), and every completion is captured with its constraints recorded (read back
through the RL Service's trajectory routes). The last test renders docs/compatibility.md from the runs and checks the
committed page is that page (`COMPAT_WRITE_PAGE=1` rewrites it).

The frameworks live in `.venv-compat` (`make venv-compat`, part of `make test`; or the interpreter named by
RL_TEST_COMPAT_PYTHON), one process per framework serving all its runs. Without it the tests are reported as
skipped, never as passed. One gateway stack serves the module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis as SyncRedis

from tests.compat.frameworks import COMPAT_PYTHON, PAGE, RUNS, AgentProcess, Run, render
from tests.support import agent_model
from tests.support.fake_vllm import CHAT_PATH, FakeVLLM
from tests.support.gateway_process import GatewayProcess

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(not COMPAT_PYTHON.exists(),
                       reason=f"no framework environment at {COMPAT_PYTHON} (run `make venv-compat`)"),
]

# What capture may add to a request the agent sent (docs/gateway.md "Request fields inside a Task"): the capture
# flags (`stream_options.include_usage` on a stream: the gateway forwards the usage chunk only to a client that asked
# for it), and the sampling fields a client left out, named with vLLM's neutral values.
CAPTURE_FIELDS = {"logprobs", "top_logprobs", "return_token_ids", "stream_options"}
NEUTRAL_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0, "repetition_penalty": 1.0}
RESULTS: dict[str, dict[str, Any]] = {}  # run id → its page row, filled by test_agent_runs_the_same_inside_a_task
VERSIONS: dict[str, str] = {}


def _delete_owned_keys(redis_url: str) -> None:
    """The service's key space emptied, as the function-scoped `redis` fixture does for one test (tests/conftest.py):
    this stack serves the whole module."""
    with SyncRedis.from_url(redis_url) as client:
        for key in client.scan_iter(match="rl:v1:*", count=1000):
            client.delete(key)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[tuple[GatewayProcess, FakeVLLM]]:
    _delete_owned_keys(redis_url)
    with FakeVLLM(served_model="tiny", name="vllm-compat") as vllm:
        vllm.responder = agent_model.answer
        with GatewayProcess(tmp_path_factory.mktemp("compat"), redis_url, instances=[vllm]) as gw:
            gw.start_service()
            yield gw, vllm
    _delete_owned_keys(redis_url)


class _Agents(dict):
    """Framework → its AgentProcess, started on first use (each framework is imported once per module)."""

    def __init__(self, logs: Path) -> None:
        super().__init__()
        self.logs = logs

    def __missing__(self, framework: str) -> AgentProcess:
        process = self[framework] = AgentProcess(framework, self.logs)
        VERSIONS.update(process.versions)
        return process


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Agents]:
    started = _Agents(tmp_path_factory.mktemp("agents"))
    try:
        yield started
    finally:
        for process in started.values():
            process.close()


def _chat_bodies(vllm: FakeVLLM, since: int) -> list[dict[str, Any]]:
    return [r.body for r in vllm.requests[since:] if r.path == CHAT_PATH]


def _run(agent: AgentProcess, run: Run, gw: GatewayProcess, vllm: FakeVLLM, session: str) -> tuple[Any, list[dict]]:
    since = len(vllm.requests)
    answer = agent.run(run.pattern, gw.url, session)
    assert "error" not in answer, f"{run.id} in session {session}: {answer['error']}\n{agent.stderr()[-3000:]}"
    return answer["output"], _chat_bodies(vllm, since)


def _call_ids_numbered(value: Any, seen: dict[str, str]) -> Any:
    """`value` with every tool call id the model minted (a fresh one per completion) replaced by its order of
    appearance, so two conversations that differ only in those ids compare equal."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key in ("tool_call_id", "id", "tool_use_id") and isinstance(item, str) and "tool" in item:
                item = seen.setdefault(item, f"call-{len(seen)}")
            out[key] = _call_ids_numbered(item, seen)
        return out
    if isinstance(value, list):
        return [_call_ids_numbered(item, seen) for item in value]
    return value


def _only_capture_added(outside: dict[str, Any], inside: dict[str, Any]) -> list[str]:
    """What differs between a request sent outside a Task and the same request sent inside one, beyond `model`, the
    tool call ids of earlier completions, and what capture may add."""
    outside, inside = _call_ids_numbered(outside, {}), _call_ids_numbered(inside, {})
    problems = []
    for key, value in outside.items():
        if key not in ("model", "logprobs", "top_logprobs", "stream_options") and inside.get(key) != value:
            problems.append(f"{key}: {value!r} outside, {inside.get(key)!r} inside")
    kept = (inside.get("stream_options") or {}).items()
    if "stream_options" in outside and not outside["stream_options"].items() <= kept:
        problems.append(f"stream_options: {outside['stream_options']!r} outside, {inside.get('stream_options')!r}")
    for key, value in inside.items():
        if key in outside or key in CAPTURE_FIELDS:
            continue
        if NEUTRAL_SAMPLING.get(key, object()) != value:
            problems.append(f"{key}={value!r} added inside")
    return problems


def _task_samples(gw: GatewayProcess, task_id: str) -> list[dict[str, Any]]:
    r = gw.signed("GET", "/v1/rl/trajectories", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return [s for s in r.json()["items"] if s["task_id"] == task_id]


def _trained_as(samples: list[dict[str, Any]]) -> str:
    ways = set()
    for sample in samples:
        if sample.get("status") == "excluded":
            kinds = (sample.get("exclusion") or {}).get("kinds") or []
            ways.add(f"excluded ({', '.join(kinds)})")
        elif (sample.get("sampling") or {}).get("constraints"):
            ways.add("corrected (TIS)")
        else:
            ways.add("on-policy")
    return "; ".join(sorted(ways))


@pytest.mark.parametrize("run", RUNS, ids=[run.id for run in RUNS])
def test_agent_runs_the_same_inside_a_task(stack, agents, run: Run):
    gw, vllm = stack
    agent = agents[run.framework]
    outside, outside_calls = _run(agent, run, gw, vllm, f"outside-{run.id}")
    assert outside_calls, f"{run.id} made no model call"

    started = gw.start_task(f"inside-{run.id}")
    assert started.status_code == 201, started.text
    task_id = started.json()["rl_task_id"]
    inside, inside_calls = _run(agent, run, gw, vllm, f"inside-{run.id}")
    stopped = gw.signed("POST", f"/v1/rl/tasks/{task_id}/stop")
    assert stopped.status_code == 200 and stopped.json()["status"] == "finalized", stopped.text

    assert inside == outside, f"{run.id} finished differently inside a Task"
    assert len(inside_calls) == len(outside_calls)
    for n, (out_body, in_body) in enumerate(zip(outside_calls, inside_calls)):
        assert not _only_capture_added(out_body, in_body), (n, _only_capture_added(out_body, in_body))

    rewarded = gw.signed("POST", f"/v1/rl/tasks/{task_id}/reward", json={"reward": 1.0})  # publishes the samples
    assert rewarded.status_code == 200, rewarded.text
    assert rewarded.json()["sample_count"] == len(inside_calls), f"{len(inside_calls)} completions: {rewarded.text}"
    samples = _task_samples(gw, task_id)
    assert len(samples) == len(inside_calls), f"{len(inside_calls)} completions, {len(samples)} listed"
    recorded = set()
    for sample in samples:
        recorded |= set((sample.get("sampling") or {}).get("constraints") or {})
    assert recorded == run.kinds, f"constraints recorded {sorted(recorded)}, expected {sorted(run.kinds)}"

    RESULTS[run.id] = {
        "framework": run.label, "pattern": run.what, "route": "`/v1/messages`" if run.route == "anthropic"
        else "`/v1/chat/completions`",
        "served": f"same output, {len(inside_calls)} call{'s' if len(inside_calls) > 1 else ''}",
        "captured": f"{len(samples)}/{len(inside_calls)}; " + (", ".join(f"`{k}`" for k in sorted(recorded))
                                                                 or "no constraint"),
        "trained": _trained_as(samples),
    }


def test_compatibility_page_is_generated_from_the_runs():
    missing = [run.id for run in RUNS if run.id not in RESULTS]
    assert not missing, f"runs that did not pass in this session, so the page cannot be rendered: {missing}"
    page = render(VERSIONS, [RESULTS[run.id] for run in RUNS])
    if os.environ.get("COMPAT_WRITE_PAGE") == "1":
        PAGE.write_text(page, encoding="utf-8")
    assert PAGE.exists() and PAGE.read_text(encoding="utf-8") == page, (
        "docs/compatibility.md differs from this run: rerun with COMPAT_WRITE_PAGE=1 and commit the page")
