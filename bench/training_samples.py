"""Captured-shape samples for the training bench: SmolLM2-135M-Instruct answering the calculator family's first
turn (system prompt, two worked examples, a word problem; docs/learning.md), drawn by the model itself at
temperature 1 with its own logprobs, as a captured sample carries them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from openjiuwen.agent_evolving.agent_rl.demo import calculator_family as calc


@torch.no_grad()
def calculator_samples(model_dir: Path, count: int, *, seed: int = 0, max_tokens: int = 24,
                       chunk: int = 16) -> list[dict[str, Any]]:
    """`count` samples in the captured shape (policy "base", rewarded by the calculator family's first-turn rule:
    1 for a call whose value is the answer, else 0). Drawn in chunks with a KV cache: minutes on 2 cores otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    problems = calc.problems("train", count, seed)
    docs: list[dict[str, Any]] = []
    for start in range(0, count, chunk):
        part = problems[start : start + chunk]
        prompts = [list(tok.apply_chat_template(calc.first_messages(p), add_generation_prompt=True, tokenize=True,
                                                return_dict=False)) for p in part]
        for prompt, (resp, lps), problem in zip(prompts, _sample(model, prompts, max_tokens, gen, tok.eos_token_id),
                                                part):
            value, _ = calc.tool_call(tok.decode(resp))
            i = len(docs)
            docs.append({
                "sample_id": f"bench-{i:03d}", "trajectory_id": f"bench-{i:03d}", "rl_task_id": f"t{i}",
                "session_id": f"s{i}", "policy_version": "base", "source": "rl_task", "user_id": "smollm2",
                "created_at": f"2026-01-01T00:00:00.{i:06d}+00:00",
                "judge": {"score": 1.0 if value == problem.answer else 0.0, "source": "terminal"},
                "sampling": {"temperature": 1.0},
                "request": {"model": "smollm2", "messages": []},
                "response": {"choices": [{"message": {"content": ""}}]},
                "trajectory": {"prompt_ids": prompt, "response_ids": resp, "response_logprobs": lps},
            })
    return docs


def _sample(model: Any, prompts: list[list[int]], length: int, gen: torch.Generator,
            eos: int | None) -> list[tuple[list[int], list[float]]]:
    """Ancestral sampling at temperature 1 over left-padded prompts; each response ends at its first EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    pos = torch.clamp(mask.cumsum(1) - 1, min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    drawn: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(length):
        logp = F.log_softmax(out.logits[:, -1].float(), -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)
        picked = logp.gather(1, nxt)[:, 0].tolist()
        for i, (t, lp) in enumerate(zip(nxt[:, 0].tolist(), picked)):
            if not done[i]:
                drawn[i].append(t)
                lps[i].append(lp)
                done[i] = t == eos
        if all(done):
            break
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], 1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=out.past_key_values,
                    use_cache=True)
    return list(zip(drawn, lps))
