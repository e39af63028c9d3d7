"""The operator CLI never hands captured text's control characters to the terminal (issue 28 item 6).

A model's reply is whatever the model wrote, and agents choose much of what it says: here it carries a terminal
title change, a screen clear, a C1 CSI, a carriage return that would overwrite the line, DEL and a bidirectional
override. `openjiuwen-rl rl traj get` (the installed entry point, its real stdout bytes) shows each as an escape;
`--json` prints the answer exactly as the gateway sent it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.cli.operator import KEY_FILE_ENV, URL_ENV
from tests.support.fake_vllm import FakeVLLM, Reply
from tests.support.gateway_process import GatewayProcess

pytestmark = pytest.mark.system

REPO_ROOT = Path(__file__).resolve().parents[2]
HOSTILE = "ok\x1b]0;owned\x07\x1b[2J\x9b31mred\rgone\x7f\u202eevil"
SHOWN = "ok\\x1b]0;owned\\x07\\x1b[2J\\x9b31mred\\rgone\\x7f\\u202eevil"
CONTROLS = "\x1b\x07\x9b\r\x7f\u202e"


@pytest.fixture
def vllm() -> Iterator[FakeVLLM]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as fake:
        yield fake


def rl(gw: GatewayProcess, *argv: str) -> subprocess.CompletedProcess[bytes]:
    env = {KEY_FILE_ENV: str(gw.dir / "hmac.json"), URL_ENV: gw.url, "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.cli.main", "rl", *argv],
                          cwd=REPO_ROOT, env=env, capture_output=True, timeout=60, check=False)


def test_traj_get_escapes_captured_text_and_json_stays_exact(redis, redis_url, tmp_path, vllm):
    vllm.reply = Reply(content=HOSTILE)
    with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
        gw.start_service()
        t = gw.start_task("s-cli").json()["rl_task_id"]
        r = httpx.post(gw.url + "/v1/chat/completions", headers={"X-Agent-Session-Id": "s-cli"}, timeout=30,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64})
        assert r.json()["choices"][0]["message"]["content"] == HOSTILE
        gw.signed("POST", f"/v1/rl/tasks/{t}/stop")
        assert gw.signed("POST", f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0}).json() == {"sample_count": 1}
        sample_id = gw.signed("GET", "/v1/rl/trajectories").json()["items"][0]["sample_id"]

        shown = rl(gw, "traj", "get", sample_id)
        assert shown.returncode == 0, shown.stderr
        out = shown.stdout.decode()
        assert f"reply     {SHOWN}" in out.splitlines(), out
        assert not any(c in out for c in CONTROLS), out

        exact = rl(gw, "traj", "get", sample_id, "--json")
        assert exact.returncode == 0, exact.stderr
        answer = gw.signed("GET", f"/v1/rl/trajectories/{sample_id}").json()
        assert orjson.loads(exact.stdout) == answer
        assert answer["trajectory"]["response_text"] == HOSTILE
        assert exact.stdout == orjson.dumps(answer, option=orjson.OPT_INDENT_2) + b"\n"  # byte for byte
