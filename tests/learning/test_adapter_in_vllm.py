"""A trained adapter loads in a real vLLM server through `/v1/load_lora_adapter` and serves a completion.

Needs the CPU build of vLLM in its own environment (`.venv-vllm`, created by `make demo`; or the interpreter named by
RL_TEST_VLLM_PYTHON). Without it the test is reported as skipped, never as passed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.online.training.backends import TrainingJob
from openjiuwen.agent_evolving.agent_rl.online.training.backends.local import LocalBackend
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings
from tests.support import learning as L
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("RL_TEST_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
START_TIMEOUT_S = 240


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM environment (.venv-vllm); run `make demo` first")
async def test_trained_adapter_loads_and_serves_in_vllm(tmp_path):
    model_dir = make_tiny_model(tmp_path / "model", seed=0)
    base = L.load_model(model_dir)
    prompt = L.prompt_ids(model_dir)
    responses = L.sample_responses(base, prompt, 8, 6, seed=0)
    docs = L.documents(prompt, responses, [L.sequence_logprobs(base, prompt, r) for r in responses],
                       [float(i % 2) for i in range(8)], "tiny")
    backend = LocalBackend(LoraRepository(tmp_path / "loras", model_id="tiny"),
                           settings=PPOSettings(max_prompt_length=64, max_response_length=64),
                           tmp_root=tmp_path / "train")

    async def ignore(_: dict) -> None:
        return None

    artifact = await backend.train(TrainingJob(
        training_run_id="run-0000000000aa", model_id="tiny", base_model_path=str(model_dir), samples=docs,
        init_lora_name="base", init_lora_path=""), on_progress=ignore)
    port = free_port()
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="true", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    log = open(tmp_path / "vllm.log", "wb")
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
         "--served-model-name", "tiny", "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
         "--dtype", "float32", "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + START_TIMEOUT_S
            while True:
                assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
                try:
                    if (await client.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert loop.time() < deadline, "vLLM did not start"
                await asyncio.sleep(1)
            load = await client.post("/v1/load_lora_adapter",
                                     json={"lora_name": artifact.lora_name, "lora_path": artifact.lora_path})
            assert load.status_code == 200, load.text
            chat = await client.post("/v1/chat/completions", json={
                "model": artifact.lora_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "logprobs": True, "top_logprobs": 0, "return_token_ids": True})
            assert chat.status_code == 200, chat.text
            body = chat.json()
            assert body["model"] == artifact.lora_name and body["choices"][0]["token_ids"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
