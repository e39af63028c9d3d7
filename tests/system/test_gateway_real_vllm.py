"""The whole loop against a REAL vLLM (CPU build) serving the tiny model, started as instances serving captured
traffic must be (`--logprobs-mode processed_logprobs`, docs/training.md "Sampling"):

- capture + reward through the gateway, a Training Run with the real local backend, activation that really loads
  the adapter in vLLM, and a new Task served by it (CONTRACT §3.4, §3.5, §3.8, §3.9, §4.7);
- completions at the agent's own sampling (temperatures 0.7 and 1.3, with and without top_p 0.9): the trainer's
  recomputed logprobs equal the captured ones within 1e-4 where no truncation cut the distribution, and the gap
  where top_p did is exactly -log(kept mass), which the Training Run reports (issue 29);
- two lineages' adapters loaded at once on the one vLLM, each lineage's Task served by its own adapter: the captured
  logprobs are that adapter's, not the other's (docs/lineages.md, issue 27 item 7).

Needs the CPU build of vLLM in its own environment (`.venv-vllm` in the repository root, created by `make demo`, or
the interpreter named by RL_TEST_VLLM_PYTHON; tests/support/real_vllm.py). Without it the tests are reported as
skipped, never as passed. One vLLM serves the module (its start-up takes about a minute on 2 cores); each test unloads the adapters it loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from redis import Redis as SyncRedis

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.training.batch import convert_samples
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_math import response_log_probs
from tests.support.gateway_process import GatewayProcess
from tests.support.real_vllm import MISSING, VLLM_PYTHON, RealVLLM

RUN_TIMEOUT_S = 180.0

pytestmark = [pytest.mark.system, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=MISSING)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[RealVLLM]:
    with RealVLLM.start(model_dir, tmp_path_factory.mktemp("vllm"),
                        extra_args=["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2"]) as vllm:
        yield vllm


@pytest.fixture
def real_vllm(vllm_server: RealVLLM) -> Iterator[RealVLLM]:
    """The module's vLLM, left as the test found it: serving the base model only."""
    yield vllm_server
    for name in _served_models(vllm_server) - {"tiny"}:
        r = httpx.post(vllm_server.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)
        assert r.status_code == 200, r.text


def _chat(client: openai.OpenAI, session: str, content: str) -> None:
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                         max_tokens=8, extra_headers={"X-Agent-Session-Id": session})
    assert out.choices[0].finish_reason in ("stop", "length")


def _task_samples(gw: GatewayProcess, rl_task_id: str) -> list[dict[str, Any]]:
    r = gw.signed("GET", "/v1/rl/trajectories", params={"status": "pending", "limit": 1000})
    assert r.status_code == 200, r.text
    return [s for s in r.json()["items"] if s["task_id"] == rl_task_id]


def _served_models(vllm: RealVLLM) -> set[str]:
    return {m["id"] for m in httpx.get(vllm.url + "/v1/models", timeout=10).json()["data"]}


def test_real_vllm_train_activate_and_serve_the_new_adapter(redis, redis_url, tmp_path, model_dir, real_vllm):
    rl = {"trainer_backend": "local", "base_model_path": str(model_dir), "lora_activation_timeout": 60.0}
    online = {"hookTimeout": "30s", "controlTimeout": "120s"}
    with GatewayProcess(tmp_path, redis_url, instances=[real_vllm], rl_overrides=rl, online_overrides=online,
                        lora_overrides={"operationTimeout": "30s"}) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        gw.start_service()
        for n, reward in enumerate((1.0, 0.0)):
            session = f"train-{n}"
            r = gw.start_task(session)
            assert r.status_code == 201, r.text
            task = r.json()
            assert task["policy_model"] == "tiny"
            _chat(client, session, "Say something.")
            _chat(client, session, "Say more.")
            stopped = gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/stop")
            assert stopped.json()["status"] == "finalized", stopped.text
            rewarded = gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/reward", json={"reward": reward})
            assert rewarded.json() == {"sample_count": 2}, rewarded.text
        assert _served_models(real_vllm) == {"tiny"}

        started = gw.signed("POST", "/v1/rl/training/runs")
        assert started.status_code == 201, started.text
        run_id = started.json()["training_run_id"]
        run = gw.wait_run(run_id, RUN_TIMEOUT_S)

        assert run["status"] == "succeeded", (run, (gw.dir / "rl-service.log").read_text()[-3000:])
        assert (run["lora_name"], run["sample_count"]) == ("tiny:v1", 4)
        assert run["lora_path"] == str(gw.lora_root / "tiny" / "v1")
        assert run["metrics"]["steps"] >= 1
        # Activation really loaded the adapter in vLLM.
        assert _served_models(real_vllm) == {"tiny", "tiny:v1"}
        status = gw.signed("GET", "/v1/loras/tiny").json()
        assert status == {"status": "active", "active_lora": {"lora_name": "tiny:v1", "lora_path": run["lora_path"]},
                          "instances": {"ready": 1, "failed": 0}}
        assert gw.signed("GET", "/v1/rl/trajectories/stats").json()["by_status"]["trained"] == 4

        r = gw.start_task("served-by-v1")
        assert r.status_code == 201, r.text
        task = r.json()
        assert (task["policy_lora_name"], task["policy_model"]) == ("tiny:v1", "tiny:v1")
        _chat(client, "served-by-v1", "Say something new.")
        assert gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/stop").json()["status"] == "finalized"
        rewarded = gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/reward", json={"reward": 1.0})
        assert rewarded.json() == {"sample_count": 1}, rewarded.text

        [summary] = _task_samples(gw, task["rl_task_id"])
        assert summary["policy_version"] == "tiny:v1"
        detail = gw.signed("GET", f"/v1/rl/trajectories/{summary['trajectory_id']}").json()
        # vLLM's own answer, as the RL Service captured it: served by the adapter.
        assert detail["response"]["model"] == "tiny:v1"
        assert detail["request"]["model"] == "tiny:v1"
        assert detail["trajectory"]["response_ids"] and len(detail["trajectory"]["response_logprobs"]) == len(
            detail["trajectory"]["response_ids"])


# (temperature, top_p) of each Task's completions: the agent's own sampling, mixed in one Training Run.
SAMPLINGS = ((0.7, 1.0), (1.3, 1.0), (0.7, 0.9), (1.3, 0.9))
EXACT_ATOL = 1e-4  # float32 vLLM (CPU) against float32 transformers, the tiny model


def _kept_mass(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[R] the probability mass vLLM's top-p keeps at each position of `logits` [R, V] (already divided by the
    temperature): sorted ascending, the tokens whose cumulative mass stays <= 1 - p are cut, the largest always
    kept (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p)."""
    probs = torch.softmax(logits, -1).sort(-1).values
    cut = probs.cumsum(-1) <= 1 - top_p
    cut[:, -1] = False
    return probs.masked_fill(cut, 0.0).sum(-1)


def test_captured_logprobs_are_the_trainers_at_each_samples_own_sampling(redis, redis_url, tmp_path, model_dir,
                                                                        real_vllm):
    rl = {"trainer_backend": "local", "base_model_path": str(model_dir), "lora_activation_timeout": 60.0}
    online = {"hookTimeout": "30s", "controlTimeout": "120s"}
    with GatewayProcess(tmp_path, redis_url, instances=[real_vllm], rl_overrides=rl, online_overrides=online,
                        lora_overrides={"operationTimeout": "30s"}) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        gw.start_service()
        for n, (temperature, top_p) in enumerate(SAMPLINGS):
            session = f"sampling-{n}"
            task = gw.start_task(session).json()
            for turn in range(2):
                out = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"Say thing {turn}."}], max_tokens=12,
                    temperature=temperature, top_p=top_p, seed=10 * n + turn,
                    extra_headers={"X-Agent-Session-Id": session})
                assert out.choices[0].finish_reason in ("stop", "length")
            assert gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/stop").json()["status"] == "finalized"
            rewarded = gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/reward", json={"reward": float(n % 2)})
            assert rewarded.json() == {"sample_count": 2}, rewarded.text
        listing = gw.signed("GET", "/v1/rl/trajectories", params={"status": "pending", "limit": 100}).json()["items"]
        docs = [gw.signed("GET", f"/v1/rl/trajectories/{item['trajectory_id']}").json() for item in listing]
        assert sorted((d["sampling"]["temperature"], d["sampling"]["top_p"]) for d in docs) == sorted(SAMPLINGS * 2)

        # The trainer's own conversion and logprobs (the parent = base weights drew every sample). The detail view
        # spans the mask over prompt + response (§4.5); the trainer reads the stored, response-only one.
        from transformers import AutoModelForCausalLM

        for doc in docs:
            traj = doc["trajectory"]
            traj["response_mask"] = traj["response_mask"][len(traj["prompt_ids"]):]
        batch = convert_samples(docs, pad_token_id=0, max_prompt_length=1024, max_response_length=1024)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            recomputed = response_log_probs(model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                            batch.responses, batch.temperatures).log_probs
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids).logits[:, -batch.responses.shape[1] - 1 : -1].float()
        expected_gaps = []
        for row, doc in enumerate(docs):
            length = len(doc["trajectory"]["response_ids"])
            captured, mine = batch.old_log_probs[row, :length], recomputed[row, :length]
            top_p = doc["sampling"]["top_p"]
            if top_p == 1.0:  # nothing cut: the very same quantity
                assert torch.allclose(captured, mine, atol=EXACT_ATOL), (doc["sampling"], captured - mine)
                expected_gaps.append(torch.zeros(length))
            else:  # vLLM renormalized over the nucleus: higher by exactly -log(kept mass)
                kept = _kept_mass(logits[row, :length] / batch.temperatures[row], top_p)
                assert torch.allclose(captured - mine, -kept.log(), atol=EXACT_ATOL), (doc["sampling"], kept)
                assert bool((kept < 1.0).all())
                expected_gaps.append(-kept.log())
        gaps = torch.cat(expected_gaps)
        del model

        started = gw.signed("POST", "/v1/rl/training/runs")
        assert started.status_code == 201, started.text
        run_id = started.json()["training_run_id"]
        run = gw.wait_run(run_id, RUN_TIMEOUT_S)
        assert run["status"] == "succeeded", (run, (gw.dir / "rl-service.log").read_text()[-3000:])
        # The run's report is what the truncation explains: no gap on the untruncated rows, -log(kept) on the rest.
        report = run["metrics"]["sampling"]
        assert report["temperatures"] == {"0.7": 4, "1.3": 4} and report["truncated_samples"] == 4
        assert report["tokens"] == gaps.numel()
        assert report["untruncated_mismatch_max"] < EXACT_ATOL
        assert report["logprob_mismatch_max"] == pytest.approx(float(gaps.max()), abs=EXACT_ATOL)
        assert report["logprob_mismatch_mean"] == pytest.approx(float(gaps.mean()), abs=EXACT_ATOL)
        # Bypass mode (no tis_cap): ratios exp(-gap) below PPO's 0.8 are the clipped ones.
        assert report["ratio_clipped_share"] == pytest.approx(float((torch.exp(-gaps) < 0.8).float().mean()),
                                                              abs=1 / gaps.numel())


# Two lineages, one adapter each (`tiny:<lineage>:v1`), loaded at once on the one vLLM (`--max-loras 2`).
LINEAGE_SEEDS = {"a": 1, "b": 2}
LORA_B_STD = 0.05  # random B (peft starts it at zero: the base model), so the adapters differ from base and each other
OTHER_ADAPTER_MIN_GAP = 0.01  # the other adapter's logprobs of the same tokens differ by more than this, at least once


def _random_adapter(model_dir: Path, path: Path, seed: int) -> str:
    """A LoRA on all linear layers as the local trainer makes one, but with seeded random B so that it measurably
    changes the model's outputs (an untrained adapter is exactly the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                                  bias="none", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, LORA_B_STD)
    peft_model.save_pretrained(path)
    return str(path)


def _token_logprobs(vllm: RealVLLM, model: str, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """vLLM's own logprobs of `response_ids` after `prompt_ids` under `model` (an adapter's name), asked directly as
    prompt logprobs: no sampling, so no greedy decoding inside a Task is needed to compare."""
    ids = prompt_ids + response_ids
    r = httpx.post(vllm.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    positions = r.json()["choices"][0]["prompt_logprobs"][len(prompt_ids):]
    return [entry[str(token)]["logprob"] for entry, token in zip(positions, response_ids, strict=True)]


def _line_task_samples(redis_url: str, line: str, rl_task_id: str) -> list[tuple[str, str]]:
    """(sample id, policy_version) of the Task's pending samples, read from its line's own pending index (the
    trajectory listing shows the default line only)."""
    with SyncRedis.from_url(redis_url) as client:
        found = []
        for member in client.zrange(keys.traj_index(line, "pending"), 0, -1):
            task_id, version = client.hmget(keys.traj(member.decode()), ["rl_task_id", "policy_version"])
            if task_id is not None and task_id.decode() == rl_task_id:
                found.append((member.decode(), version.decode()))
        return found


# The RL Service child as the gateway starts it, which first leaves its bearer token (a fresh one per child) where the
# test reads it: the test then calls the internal activation route exactly as the RL Service does.
_TOKEN_WRAPPER = (
    "import os, pathlib, runpy, sys; "
    "pathlib.Path(os.environ['RL_TEST_TOKEN_FILE']).write_text(os.environ['RL_SERVICE_TOKEN']); "
    "sys.argv[0] = 'service'; "
    "runpy.run_module('openjiuwen.agent_evolving.agent_rl.online.service', run_name='__main__', alter_sys=True)"
)


def test_two_lineages_adapters_loaded_at_once_each_task_served_by_its_own(redis, redis_url, tmp_path, model_dir,
                                                                          real_vllm):
    online = {"hookTimeout": "30s", "controlTimeout": "120s", "command": [sys.executable, "-c", _TOKEN_WRAPPER]}
    token_file = tmp_path / "child-token"
    with GatewayProcess(tmp_path, redis_url, instances=[real_vllm], online_overrides=online,
                        rl_overrides={"base_model_path": str(model_dir)}, lora_overrides={"operationTimeout": "30s"},
                        env={"RL_TEST_TOKEN_FILE": str(token_file)}) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        gw.start_service()
        bearer = {"Authorization": f"Bearer {token_file.read_text()}"}
        for lineage, seed in LINEAGE_SEEDS.items():
            path = _random_adapter(model_dir, gw.lora_root / "tiny" / "lineages" / lineage / "v1", seed)
            r = gw.http.post("/internal/v1/rl/loras/activate", headers=bearer, json={
                "base_model": str(model_dir), "lora_name": f"tiny:{lineage}:v1", "lora_path": path,
                "expected_lora_name": "base"})
            assert r.status_code == 200, r.text
        # Both adapters at once on the one instance, each line active with its own version.
        assert _served_models(real_vllm) == {"tiny", "tiny:a:v1", "tiny:b:v1"}
        for lineage in LINEAGE_SEEDS:
            status = gw.signed("GET", f"/v1/loras/tiny:{lineage}").json()
            assert status["active_lora"]["lora_name"] == f"tiny:{lineage}:v1", status
        assert gw.signed("GET", "/v1/loras/tiny").json()["status"] == "base"  # the default line untouched

        captured: dict[str, dict[str, Any]] = {}
        for n, lineage in enumerate(LINEAGE_SEEDS):
            session = f"lineage-{lineage}"
            r = gw.signed("POST", "/v1/rl/tasks/start", json={"reward_mode": "terminal", "lineage": lineage},
                          headers={"X-Agent-Session-Id": session})
            assert r.status_code == 201, r.text
            task = r.json()
            assert (task["policy_lora_name"], task["policy_model"]) == (f"tiny:{lineage}:v1",) * 2
            # The same prompt and sampling for both: only the adapter differs.
            out = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Say something."}], max_tokens=12,
                temperature=1.0, top_p=1.0, seed=n, extra_headers={"X-Agent-Session-Id": session})
            assert out.choices[0].finish_reason in ("stop", "length")
            assert gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/stop").json()["status"] == "finalized"
            rewarded = gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/reward", json={"reward": 1.0})
            assert rewarded.json() == {"sample_count": 1}, rewarded.text
            [(sample_id, version)] = _line_task_samples(redis_url, f"tiny:{lineage}", task["rl_task_id"])
            assert version == f"tiny:{lineage}:v1"
            detail = gw.signed("GET", f"/v1/rl/trajectories/{sample_id}").json()
            assert detail["request"]["model"] == detail["response"]["model"] == f"tiny:{lineage}:v1"
            assert detail["lineage"] == lineage
            captured[lineage] = detail

        # Each capture's logprobs are its own adapter's (asked of vLLM directly for the captured tokens), and not the
        # other lineage's nor the base model's: the response really came from its own adapter.
        for lineage, detail in captured.items():
            traj = detail["trajectory"]
            prompt_ids, response_ids = traj["prompt_ids"], traj["response_ids"]
            assert response_ids and len(traj["response_logprobs"]) == len(response_ids)
            got = torch.tensor(traj["response_logprobs"], dtype=torch.float64)
            under = {name: torch.tensor(_token_logprobs(real_vllm, name, prompt_ids, response_ids),
                                        dtype=torch.float64)
                     for name in ("tiny", "tiny:a:v1", "tiny:b:v1")}
            own = f"tiny:{lineage}:v1"
            assert torch.allclose(got, under[own], atol=EXACT_ATOL), (lineage, got - under[own])
            for name in set(under) - {own}:
                gap = float((got - under[name]).abs().max())
                assert gap > OTHER_ADAPTER_MIN_GAP, (lineage, name, gap)
        assert _served_models(real_vllm) == {"tiny", "tiny:a:v1", "tiny:b:v1"}  # still both: nothing paged out
