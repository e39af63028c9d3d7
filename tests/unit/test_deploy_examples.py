"""The shipped example configs load with the real loaders (docs and deploy/ stay true)."""

from __future__ import annotations

from pathlib import Path

from openjiuwen.agent_evolving.agent_rl.gateway.config import load_gateway_config

ROOT = Path(__file__).resolve().parents[2]


def test_gateway_example_loads() -> None:
    config = load_gateway_config(ROOT / "deploy" / "gateway.example.json")
    assert [i.name for i in config.instances] == ["vllm-0", "vllm-1"]
    assert config.online_rl.hook_timeout_s == 30.0 and config.lora.operation_timeout_s == 60.0
    assert (config.instance_health.interval_s, config.instance_health.failure_threshold) == (10.0, 3)
    assert config.registration.max_instances == 64
    from openjiuwen.agent_evolving.agent_rl.online.config import load_config

    rl = load_config(ROOT / "deploy" / "rl-service.example.yaml")
    assert config.online_rl.model_id == rl.model_id


def test_deploy_configs_load() -> None:
    from openjiuwen.agent_evolving.agent_rl.online.config import load_config

    for host in ("one-machine", "gpu-host"):
        rl = load_config(ROOT / "deploy" / host / "rl-service.yaml")
        gw = load_gateway_config(ROOT / "deploy" / host / "gateway.json")
        assert rl.lora_repository_path == str(gw.lora.root)
        assert rl.model_id == gw.instances[0].model == gw.online_rl.model_id
        assert gw.online_rl.control_timeout_s > rl.lora_activation_timeout > gw.lora.operation_timeout_s
    assert load_config(ROOT / "deploy" / "gpu-host" / "rl-service.yaml").trainer_backend == "verl"
