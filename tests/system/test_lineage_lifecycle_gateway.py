"""The lineage lifecycle through the real gateway and its real RL Service child (docs/lineages.md "Lifecycle"), a
private Redis and a fake vLLM: an agent key's `maxLineages` cap, archive (the adapter unloaded from vLLM, the version
refused outside a Task, the line's Tasks refused), restore (served again), delete with the operator CLI
(`rl lineage delete --remove-files --wait`), and the lifecycle routes closed to agent keys."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from openjiuwen.agent_evolving.agent_rl.cli.operator import KEY_FILE_ENV, URL_ENV, main
from tests.support.fake_vllm import CHAT_PATH, FakeVLLM
from tests.support.gateway_process import GatewayProcess
from tests.support.invariants import check_invariants
from tests.support.waiting import wait_for
from tests.system.test_operator_cli import vllm  # noqa: F401 - the fixture: one fake vLLM instance

pytestmark = pytest.mark.system


@pytest.fixture
def gw(redis, redis_url: str, tmp_path: Path, vllm: FakeVLLM) -> Iterator[GatewayProcess]:
    with GatewayProcess(tmp_path, redis_url, instances=[vllm], agent_caps={"agent-a": 1}) as gateway:
        gateway.start_service()
        yield gateway


def task(gw: GatewayProcess, lineage: str, session: str, *, agent: str | None = "agent-a") -> httpx.Response:
    return gw.signed("POST", "/v1/rl/tasks/start", json={"reward_mode": "terminal", "lineage": lineage},
                     headers={"X-Agent-Session-Id": session}, agent=agent)


def rewarded(gw: GatewayProcess, lineage: str, session: str) -> str:
    """One Task of `lineage` with a completion, stopped and rewarded; the model vLLM was asked for."""
    started = task(gw, lineage, session)
    assert started.status_code == 201, started.text
    rl_task_id = started.json()["rl_task_id"]
    chat = httpx.post(gw.url + "/v1/chat/completions", headers={"X-Agent-Session-Id": session}, timeout=30,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    assert gw.signed("POST", f"/v1/rl/tasks/{rl_task_id}/stop", agent="agent-a").status_code == 200
    assert gw.signed("POST", f"/v1/rl/tasks/{rl_task_id}/reward", json={"reward": 1.0},
                     agent="agent-a").status_code == 200
    return started.json()["policy_lora_name"]


def code(resp: httpx.Response) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


def active(gw: GatewayProcess, line: str) -> str | None:
    return (gw.signed("GET", f"/v1/loras/{line}").json().get("active_lora") or {}).get("lora_name")


async def test_archive_restore_and_delete_through_the_gateway(gw: GatewayProcess, vllm: FakeVLLM, redis,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rewarded(gw, "up", "s1")
    # The key's cap (maxLineages 1): its second new lineage is refused, a known one is not.
    assert code(task(gw, "second", "s2")) == (409, "agent_lineage_limit_reached")
    r = gw.signed("POST", "/v1/rl/training/runs", json={"lineage": "up"})
    assert r.status_code == 201, r.text
    run_id = r.json()["training_run_id"]
    wait_for(lambda: gw.signed("GET", f"/v1/rl/training/runs/{run_id}").json()["status"] == "succeeded",
             timeout_s=30, what="the run of up")
    assert active(gw, "tiny:up") == "tiny:up:v1" and "tiny:up:v1" in vllm.loaded

    # Agent keys never reach the lifecycle.
    for action in ("archive", "restore", "delete"):
        assert code(gw.signed("POST", f"/v1/rl/lineages/up/{action}", agent="agent-a")) == (403, "key_not_permitted")

    env = {KEY_FILE_ENV: str(gw.dir / "hmac.json"), URL_ENV: gw.url}  # the documented operator commands
    assert main(["lineage", "archive", "up"], env=env) == 0
    assert "archived since" in capsys.readouterr().out
    assert gw.signed("GET", "/v1/rl/lineages/up").json()["restores_to"] == "tiny:up:v1"
    assert active(gw, "tiny:up") is None and "tiny:up:v1" not in vllm.loaded  # unloaded from vLLM
    outside = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                         json={"model": "tiny:up:v1", "messages": [{"role": "user", "content": "hi"}]})
    assert code(outside) == (404, "model_not_found")
    assert code(task(gw, "up", "s3")) == (409, "lineage_archived")

    assert main(["lineage", "restore", "up"], env=env) == 0
    assert "state          live" in capsys.readouterr().out
    assert active(gw, "tiny:up") == "tiny:up:v1"
    mark = len(vllm.requests)
    assert rewarded(gw, "up", "s4") == "tiny:up:v1"
    assert [q.body["model"] for q in vllm.requests[mark:] if q.path == CHAT_PATH] == ["tiny:up:v1"]

    # Deleted, waiting until it is done.
    assert main(["lineage", "delete", "up", "--remove-files", "--wait", "--interval", "0.1",
                 "--watch-timeout", "60"], env=env) == 0
    out = capsys.readouterr().out
    assert "being deleted since" in out and out.rstrip().endswith("lineage up deleted")
    assert active(gw, "tiny:up") is None and "tiny:up:v1" not in vllm.loaded
    assert [p.name for p in (gw.lora_root / "tiny" / "lineages" / "up").iterdir()] == ["retired.json"]
    assert code(gw.signed("GET", "/v1/rl/lineages/up")) == (404, "lineage_not_found")
    # Its registration was the key's one: the key may register a lineage again.
    assert task(gw, "second", "s5").status_code == 201
    await check_invariants(redis, model_id="tiny")
