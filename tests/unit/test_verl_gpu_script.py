"""What of the GPU check (bench/gpu/verl_run.sh + verl_run.py) can be checked without a GPU. Its CPU size runs in
tests/learning/test_verl_backend.py (the same code path as on the GPU, with the tiny model)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench.gpu import verl_run
from openjiuwen.agent_evolving.agent_rl.online.training.verl.compose import compose_ppo_config, settings_from_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "verl_run.sh"


def test_the_shell_script_parses_and_explains_itself() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30, check=True)
    assert "Python 3.12" in out.stdout and "redis-server" in out.stdout and "WHEELS" in out.stdout
    assert "--model smollm2" in out.stdout and "--lineages K" in out.stdout and "verl_gpu_k2.json" in out.stdout
    for wrong in (["--bogus"], ["--model", "gpt2"], ["--dry-run", "--model"], ["--lineages", "0"],
                  ["--lineages", "two"], ["--dry-run", "--lineages"]):
        bad = subprocess.run(["bash", str(SCRIPT), *wrong], capture_output=True, text=True, timeout=30)
        assert bad.returncode == 2 and "usage:" in bad.stderr, wrong


def test_every_model_has_both_sizes() -> None:
    assert sorted(verl_run.SIZES) == sorted((m, s) for m in verl_run.MODELS for s in ("cpu", "gpu"))


@pytest.mark.parametrize("size", sorted(verl_run.SIZES))
def test_each_size_composes_into_a_valid_ppo_config(tmp_path: Path, size: tuple[str, str]) -> None:
    spec = verl_run.SIZES[size]
    (tmp_path / "ppo.yaml").write_text(verl_run.ppo_yaml(spec))
    tree = compose_ppo_config(advantage_estimator="reinforce_plus_plus", tis_cap=None,
                              ppo_config_path=str(tmp_path / "ppo.yaml"), env={})
    settings = settings_from_config(tree, tis_cap=None, ppo_samples_per_step=0)
    assert (settings.learning_rate, settings.ppo_epochs) == (spec.lr, spec.epochs)
    assert (settings.ppo_mini_batch_size, settings.ppo_micro_batch_size) == (spec.mini_batch, spec.micro_batch)
    assert spec.mini_batch % spec.micro_batch == 0 and spec.samples % spec.mini_batch == 0


def test_the_gpu_model_has_a_few_hundred_million_parameters() -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    m = verl_run.SIZES[("generated", "gpu")].model
    config = Qwen2Config(hidden_size=m["hidden_size"], num_hidden_layers=m["num_layers"],
                         num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
                         intermediate_size=m["intermediate_size"], vocab_size=400, tie_word_embeddings=True)
    with torch.device("meta"):
        count = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    assert 2e8 < count < 6e8, count


def test_concurrent_lineages_share_one_gpu_unless_there_are_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--lineages K` on the GPU machine: one GPU per run with K GPUs, else 1/K of one each (Ray's fractions), so
    the K runs are placed at once either way."""
    import torch

    assert verl_run.default_gpus_per_rank(2, "cpu") is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert verl_run.default_gpus_per_rank(2, "cuda") == 0.5
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert verl_run.default_gpus_per_rank(2, "cuda") is None
    rewards = [verl_run.lineage_rewards([[2, 2], [1, 1], [2, 1], [1, 3]], k) for k in (0, 1)]
    assert rewards[0] == [1.0 - r for r in rewards[1]] and sum(rewards[0]) == 2.0
