"""What an outside party writes cannot forge a gateway log record or drive the terminal reading it (issue 28 item 5).

The gateway logs an instance's registration (name, model, address: whatever the instance-key holder sent) and a
vLLM instance's error text. Both arrive here carrying a line break followed by a line shaped like a record, a carriage
return, ESC sequences (clear screen, window title), a C1 CSI and a bidirectional override. Each must give exactly
one record, on one line, with every control escaped, and no raw control byte anywhere in the log.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import GatewayProcess, INS_KEY, LOOPBACK_REGISTRATION
from tests.support.waiting import wait_for
from tests.system.test_gateway_lora import activate_v1, agent

pytestmark = pytest.mark.system

FORGED = "2026-01-01 00:00:00,000 ERROR openjiuwen.agent_rl.gateway forged record"
HOSTILE = f"x\n{FORGED}\r\x1b[2J\x1b]0;owned\x07\x9b31m\u2028\u202eevil"
ESCAPED = f"x\\n{FORGED}\\r\\x1b[2J\\x1b]0;owned\\x07\\x9b31m\\u2028\\u202eevil"
RAW_CONTROLS = "\x1b\x07\x9b\r\u2028\u202e"


@pytest.fixture
def vllms() -> Iterator[tuple[FakeVLLM, FakeVLLM]]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as a, FakeVLLM(served_model="tiny", name="vllm-b") as b:
        yield a, b


def records(gw: GatewayProcess, needle: str) -> list[str]:
    return [line for line in gw.stderr().splitlines() if needle in line]


def assert_clean(log: str) -> None:
    assert not [line for line in log.splitlines() if line.startswith(FORGED[:23]) and "forged" in line], log[-2000:]
    assert not any(c in log for c in RAW_CONTROLS), [c for c in RAW_CONTROLS if c in log]


def test_a_hostile_registration_and_vllm_error_text_each_log_one_escaped_record(redis, redis_url, tmp_path, vllms):
    a, b = vllms
    with GatewayProcess(tmp_path, redis_url, instances=[a], extra_config=LOOPBACK_REGISTRATION) as gw:
        registration = {"name": "vllm-b", "model": HOSTILE, "instanceIp": "127.0.0.1", "port": b.port}
        r = gw.signed("POST", "/aigw/v1/register-instance", json=registration, key=INS_KEY)
        assert r.status_code == 200, r.text
        line = records(gw, "instance vllm-b registered for")
        assert len(line) == 1 and line[0].endswith(f"registered for {ESCAPED} at {b.url}"), line
        # A vLLM error body quoted in the log: unloading the version an operator deactivates fails with it.
        gw.start_service()
        activate_v1(gw, agent(gw))
        a.fail_next("/v1/unload_lora_adapter", 500, body=HOSTILE, content_type="text/plain")
        assert gw.signed("DELETE", "/v1/loras/tiny").status_code == 204
        line = wait_for(lambda: records(gw, "unload of tiny:v1 on vllm-a"), what="the unload failure's record")
        assert line == [line[0]] and line[0].endswith(f"unload of tiny:v1 on vllm-a: status 500: {ESCAPED}"), line
        assert_clean(gw.stderr())
