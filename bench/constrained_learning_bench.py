"""Does training on grammar-constrained samples teach the UNCONSTRAINED policy? (issue 35 item 3, docs/learning.md
"Learning from constrained samples").

SmolLM2-135M-Instruct on a real vLLM (CPU build, `--logprobs-mode processed_logprobs`, LoRA enabled) answers weather
questions under a `json_schema` grammar (`response_format`), as an agent with structured output would inside a Task:
each sample's logprobs are the processed, masked ones (the behaviour policy mu; tests/system/
test_constrained_real_vllm.py proves them exact). Reward (the task, from the text): 1 when the JSON names the city
asked about, else 0 (a truncated answer is 0). Each arm trains one LoRA version with the project's local backend
on the same samples:

- `correct`: the samples' records carry `sampling.constraints` and the run uses `tis_cap`, so each token is weighted
  by min(pi_old / mu, cap) against the unconstrained pi_old (issue 35's `correct`);
- `naive`: the same samples without the correction (PPO's ratio against mu itself, as if mu were the policy's).

`exclude` needs no arm: an excluded sample is never claimed, so no version is trained and the policy stays the base
(tests/learning/test_constrained_learning.py checks it through the service).

Measured on held-out cities (never in a training prompt), with NO grammar: the rate of answers that are one JSON
object valid for the schema (`valid`), and of valid answers naming the right city (`success`); and under the grammar,
as the agent runs: the rate of answers naming the right city (`constrained_success`). For the base model and each
trained version; per seed, then the mean and a 95% t-interval over seeds.

    .venv/bin/python bench/constrained_learning_bench.py --seeds 0 1 2 [--json out.json]

Needs `.venv-vllm` and the provisioned SmolLM2 (`make model`). Took 15-19 min per seed on 2 busy cores (64 samples,
two Training Runs of one PPO step, 3 x 32 held-out answers). `run()` is what tests/system/test_constrained_real_vllm.py
runs once, tiny, on its own vLLM (the tiny model), so the command keeps working.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openjiuwen.agent_evolving.agent_rl.model_makers import smollm2  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.backends import TrainingJob  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.backends.local import LocalBackend  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings, apply_tree  # noqa: E402
from tests.support.real_vllm import RealVLLM  # noqa: E402

SYSTEM = 'Reply with only a JSON object with the keys "city" (the city asked about) and "sunny" (true or false).'
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
GRAMMAR = {"type": "json_schema", "json_schema": {"name": "Weather", "schema": SCHEMA}}
TRAIN_CITIES = ("Paris", "Rome", "Tokyo", "Cairo", "Lima", "Oslo", "Madrid", "Berlin", "Vienna", "Dublin",
                "Lisbon", "Athens", "Prague", "Warsaw", "Moscow", "Beijing")
HELD_OUT_CITIES = ("London", "Sydney", "Toronto", "Mumbai", "Seoul", "Nairobi", "Bangkok", "Chicago")
QUESTIONS = ("Is it sunny in {} today?", "What is the weather like in {}?")
MAX_TOKENS = 40
TEMPERATURE = 1.0
TIS_CAP = 2.0
PPO = {"actor_rollout_ref": {"actor": {"optim": {"lr": 5.0e-4}, "ppo_epochs": 2, "ppo_mini_batch_size": 16,
                                       "ppo_micro_batch_size_per_gpu": 8}},
       "data": {"max_prompt_length": 128, "max_response_length": MAX_TOKENS}}
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "4"]
SAMPLING = {"temperature": TEMPERATURE, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def messages(city: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question.format(city)}]


def parse(text: str) -> dict[str, Any] | None:
    """The answer as one JSON object valid for SCHEMA, else None (prose, fences, extra keys or a cut answer)."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    if not (isinstance(value, dict) and set(value) == {"city", "sunny"} and isinstance(value["city"], str)
            and isinstance(value["sunny"], bool)):
        return None
    return value


def reward(city: str, text: str) -> float:
    value = parse(text)
    return 1.0 if value is not None and value["city"].strip().lower() == city.lower() else 0.0


def complete(client: httpx.Client, model: str, city: str, question: str, seed: int, grammar: bool) -> dict[str, Any]:
    body = {"model": model, "messages": messages(city, question), "max_tokens": MAX_TOKENS, "seed": seed,
            "temperature": TEMPERATURE, "logprobs": True, "top_logprobs": 0, "return_token_ids": True,
            **({"response_format": GRAMMAR} if grammar else {})}
    r = client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()


def constrained_samples(client: httpx.Client, seed: int, per_prompt: int,
                        cities: tuple[str, ...] = TRAIN_CITIES) -> list[dict[str, Any]]:
    """Samples in the captured shape (what a capture inside a Task stores), rewarded by the task rule."""
    docs = []
    for c, city in enumerate(cities):
        for q, question in enumerate(QUESTIONS):
            for k in range(per_prompt):
                answer = complete(client, "tiny", city, question, seed * 100003 + c * 101 + q * 11 + k, True)
                choice = answer["choices"][0]
                text = choice["message"]["content"] or ""
                n = len(docs)
                docs.append({
                    "sample_id": f"s{seed}-{n:04d}", "trajectory_id": f"s{seed}-{n:04d}", "rl_task_id": f"t{c}-{q}",
                    "session_id": f"sess{c}-{q}", "policy_version": "base", "source": "rl_task", "user_id": "smollm2",
                    "created_at": f"2026-01-01T00:00:00.{n:06d}+00:00",
                    "judge": {"score": reward(city, text), "source": "terminal"},
                    "request": {"model": "tiny", "messages": messages(city, question), "response_format": GRAMMAR},
                    "response": {"choices": [{"message": {"content": text}}]},
                    "sampling": {**SAMPLING, "constraints": {"json_schema": {"source": "response_format"}}},
                    "trajectory": {"prompt_ids": answer["prompt_token_ids"], "response_ids": choice["token_ids"],
                                   "response_logprobs": [e["logprob"] for e in choice["logprobs"]["content"]]},
                })
    return docs


def evaluate(client: httpx.Client, model: str, seed: int, per_prompt: int,
             cities: tuple[str, ...] = HELD_OUT_CITIES) -> dict[str, float]:
    """Rates on the held-out prompts: without the grammar (`valid`, `success`: does the policy produce the structure
    itself?) and with it (`constrained_success`: the task as the agent runs it, under structured output)."""
    valid = success = constrained = total = 0
    for c, city in enumerate(cities):
        for q, question in enumerate(QUESTIONS):
            for k in range(per_prompt):
                seed_k = 7 + seed * 7919 + c * 97 + q * 13 + k
                text = complete(client, model, city, question, seed_k, False)["choices"][0]["message"]["content"]
                total += 1
                valid += parse(text or "") is not None
                success += reward(city, text or "") > 0
                answer = complete(client, model, city, question, seed_k, True)
                constrained += reward(city, answer["choices"][0]["message"]["content"] or "") > 0
    return {"valid": valid / total, "success": success / total, "constrained_success": constrained / total,
            "n": total}


async def train(model_dir: Path, docs: list[dict[str, Any]], work: Path, name: str, tis_cap: float | None,
                seed: int) -> Any:
    settings = apply_tree(PPOSettings(tis_cap=tis_cap, seed=seed, num_threads=1), PPO)
    backend = LocalBackend(LoraRepository(work / f"loras-{name}", model_id="tiny"), settings=settings,
                           tmp_root=work / f"train-{name}")

    async def ignore(_: dict) -> None:
        return None

    return await backend.train(TrainingJob(
        training_run_id=f"run-{abs(hash(name)) % (1 << 48):012x}", model_id="tiny",
        base_model_path=str(model_dir), samples=docs, init_lora_name="base", init_lora_path=""), on_progress=ignore)


def t_interval(values: list[float]) -> tuple[float, float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    t95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571}.get(len(values), 2.45)
    half = t95 * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def run(client: httpx.Client, model_dir: Path, work: Path, *, seeds: list[int], per_prompt: int,
        eval_per_prompt: int, arms: list[str], train_cities: tuple[str, ...] = TRAIN_CITIES,
        held_out_cities: tuple[str, ...] = HELD_OUT_CITIES) -> dict[str, Any]:
    """The experiment against a running vLLM (`client`, serving `model_dir` as `tiny`, LoRA enabled): per seed, the
    base rates, the constrained samples, one trained version per arm and its rates; then the summary."""
    results: dict[str, Any] = {"seeds": {}, "config": {"per_prompt": per_prompt, "tis_cap": TIS_CAP,
                                                       "eval_per_prompt": eval_per_prompt, "ppo": PPO}}
    base = {seed: evaluate(client, "tiny", seed, eval_per_prompt, held_out_cities) for seed in seeds}
    for seed in seeds:
        t0 = time.monotonic()
        docs = constrained_samples(client, seed, per_prompt, train_cities)
        row: dict[str, Any] = {
            "base": base[seed], "samples": len(docs),
            "sample_reward": statistics.fmean(d["judge"]["score"] for d in docs),
            "sample_valid": statistics.fmean(parse(d["response"]["choices"][0]["message"]["content"]) is not None
                                             for d in docs)}
        for arm in arms:
            # naive: the same samples as if unconstrained (no `constraints`, so no trainer corrects them)
            arm_docs = docs if arm == "correct" else [
                {**d, "sampling": {k: v for k, v in d["sampling"].items() if k != "constraints"}} for d in docs]
            artifact = asyncio.run(train(model_dir, arm_docs, work, f"{arm}{seed}",
                                         TIS_CAP if arm == "correct" else None, seed))
            name = f"{arm}-s{seed}"
            r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": artifact.lora_path})
            r.raise_for_status()
            row[arm] = {**evaluate(client, name, seed, eval_per_prompt, held_out_cities),
                        "sampling": artifact.metadata.get("sampling"), "ppo": artifact.metadata.get("ppo_metrics")}
            client.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
        row["seconds"] = round(time.monotonic() - t0, 1)
        results["seeds"][str(seed)] = row
        print(json.dumps({"seed": seed, **row}), flush=True)
    summary = {}
    for arm in ["base", *arms]:
        for metric in ("valid", "success", "constrained_success"):
            summary[f"{arm}.{metric}"] = t_interval([results["seeds"][str(s)][arm][metric] for s in seeds])
            if arm != "base":
                summary[f"{arm}.{metric}.delta"] = t_interval(
                    [results["seeds"][str(s)][arm][metric] - results["seeds"][str(s)]["base"][metric] for s in seeds])
    results["summary"] = summary
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--per-prompt", type=int, default=2, help="constrained samples per training prompt")
    parser.add_argument("--eval-per-prompt", type=int, default=2, help="unconstrained answers per held-out prompt")
    parser.add_argument("--arms", nargs="+", default=["correct", "naive"], choices=["correct", "naive"])
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    model_dir, _ = smollm2.provision(smollm2.default_cache_dir())
    work = Path(tempfile.mkdtemp(prefix="constrained-bench-"))
    started = time.monotonic()
    try:
        with RealVLLM.start(model_dir, work, extra_args=LORA_ARGS) as vllm, \
                httpx.Client(base_url=vllm.url, timeout=300) as client:
            results = run(client, model_dir, work, seeds=args.seeds, per_prompt=args.per_prompt,
                          eval_per_prompt=args.eval_per_prompt, arms=args.arms)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["seconds"] = round(time.monotonic() - started, 1)
    for key, (mean, low, high) in results["summary"].items():
        print(f"{key:24s} {mean:+.3f}  95% CI [{low:+.3f}, {high:+.3f}]")
    print(f"total {results['seconds']} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
