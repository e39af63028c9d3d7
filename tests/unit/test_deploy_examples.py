"""The shipped example configs load with the real loaders (docs and deploy/ stay true)."""

from __future__ import annotations

from pathlib import Path

from openjiuwen.agent_evolving.agent_rl.gateway.config import load_gateway_config

ROOT = Path(__file__).resolve().parents[2]


def test_gateway_example_loads() -> None:
    config = load_gateway_config(ROOT / "deploy" / "gateway.example.json")
    assert [i.name for i in config.instances] == ["vllm-0", "vllm-1"]
    assert config.online_rl.hook_timeout_s == 30.0 and config.lora.operation_timeout_s == 60.0
