"""The examples run as documented against a real gateway (fake vLLM instances, scripted trainer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fake_judge import FakeJudge
from tests.support.fake_vllm import FakeVLLM, Reply
from tests.support.gateway_process import AGENT_KEYS, API_KEY, GatewayProcess

pytestmark = pytest.mark.system
ROOT = Path(__file__).resolve().parents[2]
HEX_AGENT_KEY = bytes(range(32))  # in the key file as 64 hex digits


def run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # A script's own folder, not the checkout, leads sys.path: PYTHONPATH makes it import this checkout's package.
    env = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT))
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def test_openai_agent_example_and_curl_signing(redis, redis_url, tmp_path):
    with FakeVLLM(served_model="tiny", name="vllm-a") as vllm:
        vllm.reply = Reply(content="Red is a colour.")
        agents = {**AGENT_KEYS, "hex-agent": HEX_AGENT_KEY}
        with GatewayProcess(tmp_path, redis_url, instances=[vllm], agent_keys=agents) as gw:
            gw.start_service()  # the operator's part; the agent's key could not
            key_file = str(gw.agent_key_file("agent-a"))
            out = run([sys.executable, "examples/openai_agent.py", "--gateway", gw.url, "--key-file", key_file])
            assert out.returncode == 0, out.stderr
            assert "reward: {'sample_count': 2}" in out.stdout
            # The agent example refuses the operator's key file: an agent never needs it.
            out = run([sys.executable, "examples/openai_agent.py", "--gateway", gw.url, "--key-file", str(gw.key_file)])
            assert out.returncode != 0 and "gateway's (operator's) key file" in out.stderr
            env = dict(os.environ, KEY=API_KEY.decode(), GATEWAY=gw.url)
            out = run(["bash", "examples/sign_with_curl.sh", "GET", "/v1/rl/trajectories/stats"], env=env)
            assert '"pending":2' in out.stdout, out
            listing = "/v1/rl/trajectories?status=pending&limit=1"
            out = run(["bash", "examples/sign_with_curl.sh", "get", listing], env=env)
            assert '"next_cursor"' in out.stdout, out  # the query is part of what is signed
            out = run(["bash", "examples/sign_with_curl.sh", "POST", "/v1/rl/tasks/start",
                       '{"reward_mode":"terminal"}'], env=dict(env, SESSION="curl-session"))
            assert '"status":"active"' in out.stdout, out  # the session header is part of what is signed
            # An agent key (here a 64-hex-digit one, used as the 32 bytes it encodes) with its id.
            agent = dict(env, KEY=HEX_AGENT_KEY.hex(), KEY_ID="hex-agent", SESSION="curl-agent")
            out = run(["bash", "examples/sign_with_curl.sh", "POST", "/v1/rl/tasks/start",
                       '{"reward_mode":"terminal"}'], env=agent)
            assert '"agent_key_id":"hex-agent"' in out.stdout, out
            out = run(["bash", "examples/sign_with_curl.sh", "GET", "/v1/rl/service"], env=agent)
            assert "key_not_permitted" in out.stdout, out
            bad = run(["bash", "examples/sign_with_curl.sh", "GET", "/v1/rl/service"],
                      env=dict(env, KEY="wrong-key"))
            assert "invalid_signature" in bad.stdout


def test_delayed_feedback_agent_example_with_its_agent_key(redis, redis_url, tmp_path):
    """examples/delayed_feedback_agent.py as documented: an agent key file, a Judge, three streamed turns."""
    with FakeJudge() as judge, FakeVLLM(served_model="tiny", name="vllm-a") as vllm:
        vllm.reply = Reply(content="Lyon in two days.")
        with GatewayProcess(tmp_path, redis_url, instances=[vllm], judge_url=judge.url) as gw:
            gw.start_service()
            out = run([sys.executable, "examples/delayed_feedback_agent.py", "--gateway", gw.url,
                       "--key-file", str(gw.agent_key_file("agent-a"))])
            assert out.returncode == 0, out.stderr
            assert "stop: finalized" in out.stdout and out.stdout.count("Lyon in two days.") == 3, out.stdout
            # The Task is the agent key's, and each of the three turns was judged into a pending sample.
            task = gw.signed("GET", "/v1/rl/tasks").json()["items"][0]
            assert (task["agent_key_id"], task["reward_mode"]) == ("agent-a", "delayed_feedback")
            assert len(judge.requests) == 3
            assert gw.signed("GET", "/v1/rl/trajectories/stats").json()["by_status"]["pending"] == 3
