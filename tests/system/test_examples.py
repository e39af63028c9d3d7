"""The examples run as documented against a real gateway (fake vLLM instances, scripted trainer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fake_vllm import FakeVLLM, Reply
from tests.support.gateway_process import API_KEY, GatewayProcess

pytestmark = pytest.mark.system
ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, **kw)


def test_openai_agent_example_and_curl_signing(redis, redis_url, tmp_path):
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm:
        vllm.reply = Reply(content="Red is a colour.")
        with GatewayProcess(tmp_path, redis_url, instances=[vllm]) as gw:
            key_file = str(gw.dir / "hmac.json")
            out = run([sys.executable, "examples/openai_agent.py", "--gateway", gw.url, "--key-file", key_file])
            assert out.returncode == 0, out.stderr
            assert "reward: {'sample_count': 2}" in out.stdout
            env = dict(os.environ, KEY=API_KEY.decode(), GATEWAY=gw.url)
            out = run(["bash", "examples/sign_with_curl.sh", "GET", "/v1/rl/trajectories/stats"], env=env)
            assert '"pending":2' in out.stdout, out
            listing = "/v1/rl/trajectories?status=pending&limit=1"
            out = run(["bash", "examples/sign_with_curl.sh", "get", listing], env=env)
            assert '"next_cursor"' in out.stdout, out  # the query is part of what is signed
            out = run(["bash", "examples/sign_with_curl.sh", "POST", "/v1/rl/tasks/start",
                       '{"reward_mode":"terminal"}', "-H", "X-Agent-Session-Id: curl-session"], env=env)
            assert '"status":"active"' in out.stdout, out
            bad = run(["bash", "examples/sign_with_curl.sh", "GET", "/v1/rl/service"],
                      env=dict(env, KEY="wrong-key"))
            assert "invalid_signature" in bad.stdout
