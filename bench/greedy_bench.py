"""What training on greedy samples does (issue 35: the default of `constrained_samples.greedy`).

    .venv/bin/python bench/greedy_bench.py [--seeds 0 1 2] [--prompts 32] [--held-out 16] [--length 12]

A tiny random model answers `--prompts` prompts (random token ids, so that their greedy answers differ); the half of
the answers richest in even token ids gets reward 1 (the rule of the learning tests), and one local-backend Training
Run trains on them (lr 2e-3, 4 PPO epochs, the learning tests' settings), under each condition:

- `greedy+correct`: the answers are greedy (argmax) and carry the `greedy` constraint, trained as `correct` does it
  (behaviour logprob 0, temperature 1, decoupled with truncated weights min(π_old, 2));
- `sampled`: the answers are drawn at temperature 1 with their true logprobs (what a Task at temperature 1 captures),
  the same rule and the same number of samples;
- `exclude`: no run (the policy stays the parent).

Measured, parent → trained: `margin`, the mean per-token logprob of the condition's rewarded training answers minus
its unrewarded ones (does the update follow the reward?); on `--held-out` other prompts, `even_mass`, the policy's
mean probability of an even token along answers sampled at temperature 1 (does it learn the rewarded behaviour?),
and `entropy` (nats) along them; and `weight`, the mean truncated importance weight of the greedy rows
(π_old(argmax), what `correct` scales them by). Prints a table and writes bench/results/greedy.json.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.backends import TrainingJob  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.backends.local import LocalBackend  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings  # noqa: E402
from bench.machine import write_result  # noqa: E402
from tests.support import learning as L  # noqa: E402

SETTINGS = dict(learning_rate=2e-3, ppo_epochs=4, max_prompt_length=64, max_response_length=64)
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
          "frequency_penalty": 0.0, "repetition_penalty": 1.0, "constraints": {"greedy": {}}}


@torch.no_grad()
def greedy(model: Any, prompt: list[int], length: int) -> list[int]:
    ids = list(prompt)
    for _ in range(length):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def half_rewards(answers: list[list[int]]) -> list[float]:
    order = sorted(range(len(answers)), key=lambda i: (L.target_share(answers[i]), i))
    rewards = [0.0] * len(answers)
    for i in order[len(answers) // 2:]:
        rewards[i] = 1.0
    return rewards


def documents(prompts: list[list[int]], answers: list[list[int]], logprobs: list[list[float]],
              rewards: list[float], sampling: dict[str, Any] | None) -> list[dict[str, Any]]:
    docs = []
    for i, (prompt, answer, lps, reward) in enumerate(zip(prompts, answers, logprobs, rewards)):
        [doc] = L.documents(prompt, [answer], [lps], [reward], "tiny", sampling=sampling)
        docs.append(dict(doc, sample_id=f"g-{i:03d}", trajectory_id=f"g-{i:03d}", rl_task_id=f"t{i}"))
    return docs


def margin(model: Any, docs: list[dict[str, Any]]) -> float:
    good, bad = [], []
    for doc in docs:
        traj = doc["trajectory"]
        lps = L.sequence_logprobs(model, traj["prompt_ids"], traj["response_ids"])
        (good if doc["judge"]["score"] > 0.5 else bad).extend(lps)
    return sum(good) / len(good) - sum(bad) / len(bad)


@torch.no_grad()
def behaviour(model: Any, prompts: list[list[int]], length: int, seed: int) -> dict[str, float]:
    """`even_mass` and `entropy` along answers sampled at temperature 1 (4 per prompt, seeded)."""
    even, entropy = [], []
    for n, prompt in enumerate(prompts):
        for answer in L.sample_responses_cached(model, prompt, 4, length, seed=seed * 1000 + n):
            ids = torch.tensor([prompt + answer])
            logp = F.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
            even.append(float(logp.exp()[:, 0::2].sum(-1).mean()))
            entropy.append(float(-(logp.exp() * logp).sum(-1).mean()))
    return {"even_mass": sum(even) / len(even), "entropy": sum(entropy) / len(entropy)}


async def train(model_dir: Path, tmp: Path, docs: list[dict[str, Any]], seed: int, name: str) -> dict[str, Any]:
    backend = LocalBackend(LoraRepository(tmp / f"loras-{name}", model_id="tiny"),
                           settings=PPOSettings(seed=seed, **SETTINGS), tmp_root=tmp / "train")
    job = TrainingJob(training_run_id=f"run-{seed:04d}{abs(hash(name)) % 10**8:08d}", model_id="tiny",
                      base_model_path=str(model_dir), samples=docs, init_lora_name="base", init_lora_path="")

    async def ignore(_: dict[str, Any]) -> None:
        return None

    artifact = await backend.train(job, on_progress=ignore)
    return {"adapter": Path(artifact.lora_path), "sampling": artifact.metadata["sampling"]}


async def one_seed(args: argparse.Namespace, tmp: Path, seed: int) -> dict[str, Any]:
    model_dir = make_tiny_model(tmp / f"model-{seed}", seed=seed)
    base = L.load_model(model_dir)
    gen = torch.Generator().manual_seed(seed)
    vocab = int(base.config.vocab_size)
    prompts = [torch.randint(3, vocab, (8,), generator=gen).tolist() for _ in range(args.prompts + args.held_out)]
    train_prompts, held_out = prompts[: args.prompts], prompts[args.prompts:]
    # Greedy answers: vLLM reports the temperature-1 logprob of the argmax for them (kept, as captured).
    greedy_answers = [greedy(base, p, args.length) for p in train_prompts]
    greedy_lps = [L.sequence_logprobs(base, p, a) for p, a in zip(train_prompts, greedy_answers)]
    sampled_answers = [L.sample_responses(base, p, 1, args.length, seed=seed * 1000 + n)[0]
                       for n, p in enumerate(train_prompts)]
    docs = {
        "greedy+correct": documents(train_prompts, greedy_answers, greedy_lps, half_rewards(greedy_answers), GREEDY),
        "sampled": documents(train_prompts, sampled_answers,
                             [L.sequence_logprobs(base, p, a) for p, a in zip(train_prompts, sampled_answers)],
                             half_rewards(sampled_answers), None),
    }
    parent = behaviour(base, held_out, args.length, seed)
    weights = [min(math.exp(lp), 2.0) for lps in greedy_lps for lp in lps]
    out: dict[str, Any] = {"seed": seed, "distinct_greedy_answers": len({tuple(a) for a in greedy_answers}),
                           "greedy_weight_mean": sum(weights) / len(weights),
                           "exclude": {"margin_before": margin(base, docs["greedy+correct"]),
                                       "margin_after": margin(base, docs["greedy+correct"]),
                                       **{f"{k}_before": v for k, v in parent.items()},
                                       **{f"{k}_after": v for k, v in parent.items()}}}
    for name, condition_docs in docs.items():
        trained = await train(model_dir, tmp, condition_docs, seed, name)
        model = L.load_model(model_dir, trained["adapter"])
        after = behaviour(model, held_out, args.length, seed)
        out[name] = {"margin_before": margin(base, condition_docs), "margin_after": margin(model, condition_docs),
                     **{f"{k}_before": v for k, v in parent.items()}, **{f"{k}_after": v for k, v in after.items()},
                     "correction": trained["sampling"]["correction"],
                     "constrained_samples": trained["sampling"]["constrained_samples"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--held-out", type=int, default=16)
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "greedy.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            results.append(asyncio.run(one_seed(args, Path(tmp), seed)))
    keys = ("margin", "even_mass", "entropy")
    print(f"{'seed':>4} {'condition':>15} " + " ".join(f"{k:>22}" for k in keys))
    for r in results:
        for name in ("exclude", "greedy+correct", "sampled"):
            cells = [f"{r[name][k + '_before']:.4f} -> {r[name][k + '_after']:.4f}".rjust(22) for k in keys]
            print(f"{r['seed']:>4} {name:>15} " + " ".join(cells))
    print("distinct greedy answers per seed:", [r["distinct_greedy_answers"] for r in results],
          "; mean weight of a greedy token (π_old of the argmax, capped at 2):",
          [round(r["greedy_weight_mean"], 4) for r in results])
    write_result({"settings": SETTINGS, "args": vars(args), "results": results}, args.out)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
