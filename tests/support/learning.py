"""Helpers of the learning tests: sample from a tiny model with the true logprobs, reward by a rule, measure.

Everything runs where the model is (`model.device`): the CPU in tests, a GPU in bench/gpu/verl_run.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def load_model(model_dir: Path, adapter_dir: Path | None = None, device: str = "cpu") -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.to(device)
    model.eval()
    return model


def prompt_ids(model_dir: Path, text: str = "Say something.") -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


@torch.no_grad()
def sequence_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
    ids = torch.tensor([prompt + response], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    picked = torch.tensor(response, device=model.device).unsqueeze(-1)
    return F.log_softmax(logits, -1).gather(-1, picked).squeeze(-1).tolist()


@torch.no_grad()
def sample_responses(model: Any, prompt: list[int], count: int, length: int, seed: int) -> list[list[int]]:
    """Plain ancestral sampling at temperature 1 (no top-k/top-p), so the logprobs are the behaviour policy's."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt] * count, device=model.device)
    out: list[list[int]] = [[] for _ in range(count)]
    for _ in range(length):
        logits = model(input_ids=ids).logits[:, -1].float().cpu()  # draws on the CPU: same seed, same samples
        nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=gen).to(ids.device)
        ids = torch.cat([ids, nxt], dim=1)
        for i, t in enumerate(nxt[:, 0].tolist()):
            out[i].append(t)
    return out


def target_share(response: list[int]) -> float:
    """The rule: share of even token ids. Rewarded = the half of the responses richest in them."""
    return sum(1 for t in response if t % 2 == 0) / len(response)


def documents(prompt: list[int], responses: list[list[int]], logprobs: list[list[float]],
              rewards: list[float], model_id: str, sampling: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Samples in the captured shape; `sampling`: the record a capture at that sampling would carry (none: drawn at
    the neutral defaults, like a rail upload)."""
    docs = []
    for i, (resp, lps, r) in enumerate(zip(responses, logprobs, rewards)):
        docs.append({
            **({"sampling": sampling} if sampling is not None else {}),
            "sample_id": f"learn-{i:03d}", "trajectory_id": f"learn-{i:03d}", "rl_task_id": f"t{i}",
            "session_id": f"s{i}", "policy_version": "base", "source": "rl_task", "user_id": model_id,
            "created_at": f"2026-01-01T00:00:00.{i:06d}+00:00", "judge": {"score": r, "source": "terminal"},
            "request": {"model": model_id, "messages": []}, "response": {"choices": [{"message": {"content": ""}}]},
            "trajectory": {"prompt_ids": prompt, "response_ids": resp, "response_logprobs": lps},
        })
    return docs


def margin(model: Any, prompt: list[int], responses: list[list[int]], rewards: list[float]) -> float:
    """Mean per-token logprob of rewarded responses minus that of unrewarded ones."""
    good, bad = [], []
    for resp, r in zip(responses, rewards):
        lps = sequence_logprobs(model, prompt, resp)
        (good if r > 0.5 else bad).extend(lps)
    return sum(good) / len(good) - sum(bad) / len(bad)


@torch.no_grad()
def sample_responses_cached(model: Any, prompt: list[int], count: int, length: int, seed: int,
                            temperature: float = 1.0) -> list[list[int]]:
    """Ancestral sampling like `sample_responses` (no top-k/top-p, seeded draws on the CPU) at `temperature`, with
    a KV cache: a fraction of the compute, which a 30-layer model on 2 cores needs."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt] * count, device=model.device)
    out = model(input_ids=ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    drawn: list[torch.Tensor] = []
    for step in range(length):
        nxt = torch.multinomial(F.softmax(logits.float().cpu() / temperature, -1), 1, generator=gen).to(ids.device)
        drawn.append(nxt)
        if step + 1 < length:
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
    return torch.cat(drawn, dim=1).tolist()


@torch.no_grad()
def batch_logprobs(model: Any, prompt: list[int], responses: list[list[int]],
                   temperature: float = 1.0) -> list[list[float]]:
    """`sequence_logprobs` of equally long responses to one prompt, in one forward pass."""
    ids = torch.tensor([prompt + r for r in responses], device=model.device)
    logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1].float() / temperature
    picked = torch.tensor(responses, device=model.device).unsqueeze(-1)
    return F.log_softmax(logits, -1).gather(-1, picked).squeeze(-1).tolist()


def batch_margin(model: Any, prompt: list[int], responses: list[list[int]], rewards: list[float],
                 temperature: float = 1.0) -> float:
    """`margin` over equally long responses, in one forward pass, at `temperature`."""
    good, bad = [], []
    for lps, r in zip(batch_logprobs(model, prompt, responses, temperature), rewards):
        (good if r > 0.5 else bad).extend(lps)
    return sum(good) / len(good) - sum(bad) / len(bad)
