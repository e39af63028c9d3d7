"""The premise of training constrained samples (issue 35 item 3), proven on a REAL vLLM (CPU build) serving the tiny
model as instances serving captured traffic run (`--logprobs-mode processed_logprobs`, plus
`--enable-auto-tool-choice` as agents need):

- under a `json_schema` grammar (vLLM's CPU build runs structured outputs with xgrammar), each returned logprob is
  log-softmax, at the sample's temperature, over the tokens the grammar allowed at that step: recomputed from the
  model's logits (transformers, same weights) and the mask xgrammar gives (tests/support/grammar_masks.py, run in
  `.venv-vllm`), within 1e-4; the unmasked log-softmax is far off, so the check can fail;
- the same with penalties (repetition, presence, frequency) applied to the logits as vLLM's sampler does, and with
  `logit_bias` added to them;
- greedy decoding (`temperature: 0`) returns the temperature-1 log-softmax of the processed logits: not the point
  mass the token was drawn from (why greedy samples are excluded by default, docs/training.md);
- one structured-output agent (the OpenAI Agents SDK, `output_type`, seeded) runs outside and inside a Task through
  the gateway and finishes the same way; its captured logprobs are the masked log-softmax too;
- bench/constrained_learning_bench.py's experiment runs once, tiny, on this vLLM (its command keeps working).

`make test` runs it (about 2 min: most of it vLLM's start-up). Needs `.venv-vllm` (and `.venv-compat` for the
agent); without them the tests are reported as skipped, never as passed. `-s` prints the measured gaps.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F

from bench import constrained_learning_bench as bench
from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model
from tests.compat.frameworks import COMPAT_PYTHON, AgentProcess
from tests.support import learning as L
from tests.support.gateway_process import GatewayProcess
from tests.support.real_vllm import MISSING, VLLM_PYTHON, RealVLLM

pytestmark = [pytest.mark.system, pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=MISSING)]

ROOT = Path(__file__).resolve().parents[2]
EXACT_ATOL = 1e-4
FAR = 0.1  # the check without the constraint must miss by more than this, or it could not fail
# tests/compat/agents/common.py Forecast, as pydantic writes it; short, so a random model closes it.
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Hangzhou"]},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
GRAMMAR = {"response_format": {"type": "json_schema", "json_schema": {"name": "Forecast", "schema": SCHEMA}}}
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3}
BIAS = {"7": 3.0, "100": -2.0, "200": 5.0}


@dataclass(frozen=True)
class Sample:
    prompt: list[int]
    response: list[int]
    logprobs: list[float]
    finish_reason: str


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[RealVLLM]:
    with RealVLLM.start(model_dir, tmp_path_factory.mktemp("vllm"),
                        extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                    *bench.LORA_ARGS]) as server:
        yield server


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return L.load_model(model_dir)


def _sample(vllm: RealVLLM, extra: dict[str, Any], count: int = 4) -> list[Sample]:
    out = []
    for n in range(count):
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"Which city, and is it sunny? ({n})"}],
                "max_tokens": 48, "logprobs": True, "top_logprobs": 0, "return_token_ids": True, "seed": 100 + n,
                **extra}
        r = httpx.post(vllm.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        choice = answer["choices"][0]
        out.append(Sample(answer["prompt_token_ids"], choice["token_ids"],
                          [entry["logprob"] for entry in choice["logprobs"]["content"]], choice["finish_reason"]))
    return out


Transform = Callable[[torch.Tensor, list[int], list[int], int], torch.Tensor]


@torch.no_grad()
def _gap(model: Any, samples: list[Sample], temperature: float, transform: Transform | None = None) -> float:
    """The largest |returned − recomputed| logprob over every token of `samples`: recomputed as log-softmax of
    transform(logits) / temperature, `transform(logits, prompt, output so far, sample index)` being what the
    constraint does to the logits at that step."""
    worst = 0.0
    for index, s in enumerate(samples):
        ids = torch.tensor([s.prompt + s.response])
        logits = model(input_ids=ids).logits[0, len(s.prompt) - 1 : -1].float()
        for step, (token, returned) in enumerate(zip(s.response, s.logprobs)):
            x = logits[step].clone()
            if transform is not None:
                x = transform(x, s.prompt, s.response[:step], index)
            mine = F.log_softmax(x / temperature, -1)[token].item()
            worst = max(worst, abs(mine - returned))
    return worst


def grammar_masks(model_dir: Path, responses: list[list[int]],
                  schema: dict[str, Any] = SCHEMA) -> list[list[list[int]]]:
    """The tokens `schema`'s grammar allowed at each step of each response (xgrammar, in vLLM's environment)."""
    job = {"model_dir": str(model_dir), "schema": schema, "responses": responses}
    done = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "support" / "grammar_masks.py")],
                          input=json.dumps(job), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert all(result["accepted"]), "vLLM produced a token its own grammar forbids"
    return result["allowed"]


def _masked(masks: list[list[list[int]]]) -> Transform:
    def transform(x: torch.Tensor, prompt: list[int], out: list[int], index: int) -> torch.Tensor:
        keep = torch.full_like(x, float("-inf"))
        keep[masks[index][len(out)]] = 0.0
        return x + keep
    return transform


def _penalized(x: torch.Tensor, prompt: list[int], out: list[int], index: int) -> torch.Tensor:
    """vLLM's sampler (v1/sample/ops/penalties.py): repetition over prompt and output tokens (positive logits
    divided, negative multiplied), then frequency by output count and presence by output occurrence."""
    seen = torch.zeros_like(x, dtype=torch.bool)
    seen[prompt + out] = True
    rep = PENALTIES["repetition_penalty"]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    counts = torch.zeros_like(x)
    for token in out:
        counts[token] += 1
    return x - PENALTIES["frequency_penalty"] * counts - PENALTIES["presence_penalty"] * (counts > 0).float()


def _biased(x: torch.Tensor, *_: Any) -> torch.Tensor:
    for token, bias in BIAS.items():
        x[int(token)] += bias
    return x


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grammar_logprobs_are_log_softmax_over_the_allowed_tokens(vllm, model, model_dir, temperature):
    samples = _sample(vllm, {**GRAMMAR, "temperature": temperature})
    masks = grammar_masks(model_dir, [s.response for s in samples])
    assert any(s.finish_reason == "stop" for s in samples)
    masked, unmasked = _gap(model, samples, temperature, _masked(masks)), _gap(model, samples, temperature)
    print(f"json_schema T={temperature}: masked gap {masked:.2e}, unmasked gap {unmasked:.2f}")
    assert masked < EXACT_ATOL and unmasked > FAR


def test_penalized_logprobs_are_log_softmax_of_the_penalized_logits(vllm, model):
    samples = _sample(vllm, {**PENALTIES, "temperature": 0.9})
    penalized, plain = _gap(model, samples, 0.9, _penalized), _gap(model, samples, 0.9)
    print(f"penalties: gap {penalized:.2e}, without them {plain:.2f}")
    assert penalized < EXACT_ATOL and plain > FAR


def test_biased_logprobs_are_log_softmax_of_the_biased_logits(vllm, model):
    samples = _sample(vllm, {"logit_bias": BIAS, "temperature": 1.0})
    biased, plain = _gap(model, samples, 1.0, _biased), _gap(model, samples, 1.0)
    print(f"logit_bias: gap {biased:.2e}, without it {plain:.2f}")
    assert biased < EXACT_ATOL and plain > FAR


def test_greedy_logprobs_are_temperature_one_not_the_point_mass(vllm, model):
    samples = _sample(vllm, {"temperature": 0}, count=2)
    gap = _gap(model, samples, 1.0)
    point_mass_gap = max(abs(lp) for s in samples for lp in s.logprobs)  # log 1 = 0 for the drawn token
    print(f"greedy: gap to T=1 log-softmax {gap:.2e}, to the point mass {point_mass_gap:.2f}")
    assert gap < EXACT_ATOL and point_mass_gap > FAR


@pytest.mark.skipif(not COMPAT_PYTHON.exists(), reason=f"no framework environment at {COMPAT_PYTHON}")
def test_structured_agent_on_real_vllm_runs_the_same_inside_a_task(redis, redis_url, tmp_path, vllm, model,
                                                                    model_dir):
    online = {"hookTimeout": "30s", "controlTimeout": "60s"}
    agent = AgentProcess("openai_agents", tmp_path)
    try:
        with GatewayProcess(tmp_path, redis_url, instances=[vllm], online_overrides=online) as gw:
            gw.start_service()
            outside = agent.run("output_type_seeded", gw.url, "real-outside")
            assert "error" not in outside, (outside, agent.stderr()[-3000:])
            started = gw.start_task("real-inside")
            assert started.status_code == 201, started.text
            task_id = started.json()["rl_task_id"]
            inside = agent.run("output_type_seeded", gw.url, "real-inside")
            assert "error" not in inside, (inside, agent.stderr()[-3000:])
            assert gw.signed("POST", f"/v1/rl/tasks/{task_id}/stop").json()["status"] == "finalized"
            rewarded = gw.signed("POST", f"/v1/rl/tasks/{task_id}/reward", json={"reward": 1.0})
            assert rewarded.json() == {"sample_count": 1}, rewarded.text  # one completion, captured and published
            assert inside == outside  # same seed, same sampling: the same tokens
            items = gw.signed("GET", "/v1/rl/trajectories", params={"limit": 100}).json()["items"]
            [summary] = [s for s in items if s["task_id"] == task_id]
            assert set(summary["sampling"]["constraints"]) == {"json_schema"}
            detail = gw.signed("GET", f"/v1/rl/trajectories/{summary['trajectory_id']}").json()
    finally:
        agent.close()
    trajectory = detail["trajectory"]
    sample = Sample(trajectory["prompt_ids"], trajectory["response_ids"], trajectory["response_logprobs"], "stop")
    temperature = summary["sampling"]["temperature"]
    schema = detail["request"]["response_format"]["json_schema"]["schema"]  # the agent's, as sent to vLLM
    masks = grammar_masks(model_dir, [sample.response], schema)
    gap = _gap(model, [sample], temperature, _masked(masks))
    print(f"captured json_schema sample of the Agents SDK: masked gap {gap:.2e}")
    assert gap < EXACT_ATOL


def test_the_constrained_learning_bench_runs(vllm, model_dir, tmp_path):
    """bench/constrained_learning_bench.py's experiment, once and tiny on this vLLM (its real run is on SmolLM2,
    docs/learning.md), so the documented command keeps working: constrained samples, a corrected Training Run, the
    trained adapter loaded in vLLM and evaluated without the grammar."""
    with httpx.Client(base_url=vllm.url, timeout=300) as client:
        results = bench.run(client, model_dir, tmp_path, seeds=[0], per_prompt=1, eval_per_prompt=1, arms=["correct"],
                            train_cities=bench.TRAIN_CITIES[:4], held_out_cities=bench.HELD_OUT_CITIES[:2])
    row = results["seeds"]["0"]
    assert row["samples"] == 4 * len(bench.QUESTIONS)
    assert row["correct"]["n"] == row["base"]["n"] == 2 * len(bench.QUESTIONS)
    assert row["correct"]["sampling"]["constrained_samples"] == row["samples"]  # every row corrected
    assert 0.0 <= row["correct"]["valid"] <= 1.0 and set(results["summary"]) >= {"correct.valid.delta"}
