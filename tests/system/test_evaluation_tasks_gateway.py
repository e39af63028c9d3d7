"""Evaluation Tasks through the gateway and the operator CLI (issue 15, item 3): `rl task start --evaluation` and a
raw signed start both reach the RL Service child through the gateway's proxy; the samples are counted as
evaluation and no Training Run claims them. Real processes: gateway, RL Service (scripted trainer), Redis, fake
vLLM."""

from __future__ import annotations

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.cli.call import main as call_main
from tests.system.test_operator_cli import Operator, captured_completion, gw, vllm  # noqa: F401 (fixtures)

pytestmark = pytest.mark.system


def test_evaluation_task_through_the_gateway(gw, capsys):  # noqa: F811
    rl = Operator(gw, capsys)
    assert rl("service", "start")[0] == 0

    # A non-boolean `evaluation` crosses the gateway untouched and the RL Service refuses it.
    code = call_main(["POST", "/v1/rl/tasks/start", "--url", gw.url, "--key-file", str(gw.dir / "hmac.json"),
                      "--data", '{"reward_mode": "terminal", "evaluation": "yes"}', "-H", "X-Agent-Session-Id: ev-0"])
    out = capsys.readouterr().out
    assert code == 1 and out.startswith("400 ") and '"invalid_task_request"' in out, out

    code, out, _ = rl("--json", "task", "start", "--session", "ev-1", "--evaluation")
    assert code == 0, out
    task = orjson.loads(out)
    assert (task["status"], task["evaluation"]) == ("active", True)
    captured_completion(gw, "ev-1")
    assert rl("task", "stop", task["rl_task_id"])[0] == 0
    assert rl("task", "reward", task["rl_task_id"], "1")[0] == 0
    code, out, _ = rl("task", "get", task["rl_task_id"])
    assert "evaluation   yes (never trained on)\n" in out, out

    code, out, _ = rl("--json", "traj", "stats")
    stats = orjson.loads(out)
    assert stats["by_status"] == {"pending": 0, "training": 0, "trained": 0, "failed": 0, "evaluation": 1}
    code, out, err = rl("train", "start")
    assert code == 1 and err.startswith("error: 409 insufficient_samples: "), err
    code, out, _ = rl("--json", "policy", "report")
    (base,) = orjson.loads(out)["items"]
    assert base["evaluation"] == {"tasks": 1, "samples": 1, "reward": {"n": 1, "mean": 1.0, "ci95": None}}
    code, out, _ = rl("policy", "report")
    assert "evaluation Tasks only (never trained on):\n" in out and "\nbase     1      1        1.000   -\n" in out, out
    assert rl("service", "stop")[0] == 0
