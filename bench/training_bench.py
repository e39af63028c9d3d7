"""Wall time and throughput of one local-backend Training Run on the tiny model.

    .venv/bin/python bench/training_bench.py [--samples 32] [--prompt-tokens 256] [--response-tokens 256]

Builds a tiny random Qwen2 model, samples `--samples` responses with their true logprobs, rewards half of them, and
runs the real local backend (child process, verl core_algos, peft) once with the contract's default PPO settings.
Prints a table and writes bench/results/training.json.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.backends import TrainingJob  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.backends.local import LocalBackend  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings  # noqa: E402
from bench.machine import write_result  # noqa: E402
from tests.support import learning as L  # noqa: E402


async def run(args: argparse.Namespace, tmp: Path) -> dict:
    model_dir = make_tiny_model(tmp / "model", seed=0)
    base = L.load_model(model_dir)
    prompt = (L.prompt_ids(model_dir) * (args.prompt_tokens // 8 + 1))[: args.prompt_tokens]
    responses = L.sample_responses(base, prompt, args.samples, args.response_tokens, seed=0)
    logprobs = [L.sequence_logprobs(base, prompt, r) for r in responses]
    docs = L.documents(prompt, responses, logprobs, [float(i % 2) for i in range(args.samples)], "tiny")
    backend = LocalBackend(LoraRepository(tmp / "loras", model_id="tiny"), settings=PPOSettings(),
                           tmp_root=tmp / "train")
    steps: list[dict] = []

    async def record(m: dict) -> None:
        steps.append(m)

    started = time.perf_counter()
    job = TrainingJob(training_run_id="run-00000000beef", model_id="tiny", base_model_path=str(model_dir),
                      samples=docs, init_lora_name="base", init_lora_path="")
    await backend.train(job, on_progress=record)
    wall = time.perf_counter() - started
    tokens = args.samples * (args.prompt_tokens + args.response_tokens)
    return {
        "samples": args.samples, "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens,
        "wall_seconds": wall, "ppo_seconds": sum(s["seconds"] for s in steps),
        "response_tokens_per_second_ppo": steps[0]["tokens_per_second"],
        "sequence_tokens_per_second_wall": tokens / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "training.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rl-train-bench-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    out = write_result(result, args.out)
    print(f"local backend, tiny model: {result['samples']} samples x ({result['prompt_tokens']}+"
          f"{result['response_tokens']}) tokens")
    print(f"  {'wall s':>8} {'ppo s':>8} {'resp tok/s (ppo)':>18} {'seq tok/s (wall)':>18}")
    print(f"  {result['wall_seconds']:8.1f} {result['ppo_seconds']:8.1f} "
          f"{result['response_tokens_per_second_ppo']:18.0f} {result['sequence_tokens_per_second_wall']:18.0f}")
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
