"""The local trainer process: `python -m ...training.local_worker SPEC.json`.

Loads the base model from its Hugging Face directory, starts from the parent adapter when there is one (else a new
LoRA over all linear layers), converts the claimed samples (captured token ids, never re-tokenized), runs one PPO
update per slice of `ppo_samples_per_step`, and saves the adapter in PEFT format into the output directory. Events
go to stdout as JSON lines (`step`, then `done`); everything else a library prints goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def _events_stream() -> TextIO:
    # Keep the real stdout for our events only; route fd 1 (library prints) to stderr.
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return events


def _emit(stream: TextIO, event: dict[str, Any]) -> None:
    stream.write(json.dumps(event) + "\n")
    stream.flush()


def train(spec: dict[str, Any], emit: Any) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import ppo_math
    from .adapter_files import save_peft_adapter
    from .batch import chunk_rows, convert_samples
    from .ppo_settings import PPOSettings

    settings = PPOSettings.from_dict(spec["settings"])
    torch.manual_seed(settings.seed)
    torch.set_num_threads(settings.num_threads if settings.num_threads > 0 else max(1, os.cpu_count() or 1))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        settings.dtype, torch.float32
    )
    base_path = spec["base_model_path"]
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    if spec.get("init_lora_path"):
        model = PeftModel.from_pretrained(model, spec["init_lora_path"], is_trainable=True)
    else:
        model = get_peft_model(
            model,
            LoraConfig(
                r=settings.lora_rank, lora_alpha=settings.lora_alpha, target_modules=settings.target_modules,
                lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
            ),
        )
    samples = json.loads(Path(spec["batch_path"]).read_bytes())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = convert_samples(
        samples, pad_token_id=pad, max_prompt_length=settings.max_prompt_length,
        max_response_length=settings.max_response_length,
        filter_overlong_prompts=settings.filter_overlong_prompts,
        advantage_estimator=settings.advantage_estimator,
    )
    actor = ppo_math.actor_config(settings)
    mask = batch.response_mask

    def forward(rows: list[int], *, grad: bool, entropy: bool = False) -> ppo_math.TokenStats:
        idx = torch.tensor(rows, dtype=torch.long)
        with torch.set_grad_enabled(grad):
            return ppo_math.response_log_probs(
                model, batch.input_ids[idx], batch.attention_mask[idx], batch.position_ids[idx],
                batch.responses[idx], with_entropy=entropy, detach_prompt=grad and settings.detach_prompt,
            )

    def forward_all(*, disable_adapter: bool = False) -> torch.Tensor:
        micro = max(1, settings.ppo_micro_batch_size)
        parts = []
        model.eval()
        for start in range(0, len(batch), micro):
            rows = list(range(start, min(start + micro, len(batch))))
            if disable_adapter:
                with model.disable_adapter():
                    parts.append(forward(rows, grad=False).log_probs)
            else:
                parts.append(forward(rows, grad=False).log_probs)
        return torch.cat(parts).detach()

    # The frozen base model is the KL reference; π_old (parent weights before any update) only matters with TIS.
    want_kl = settings.use_kl_in_reward and settings.kl_coef > 0
    ref_log_probs = forward_all(disable_adapter=True) if want_kl else None
    pi_old = forward_all() if settings.tis_cap else None
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=settings.learning_rate, weight_decay=0.01
    )
    grpo = settings.advantage_estimator == "grpo"
    slices = chunk_rows(
        len(batch), settings.ppo_samples_per_step, uids=batch.uid if grpo else None,
        created_at=batch.created_at if grpo else None,
    )
    step_metrics: list[dict[str, Any]] = []
    for step, rows in enumerate(slices, start=1):
        started = time.perf_counter()
        idx = torch.tensor(rows, dtype=torch.long)
        behaviour = batch.old_log_probs[idx]
        slice_mask = mask[idx]
        rewards, kl = ppo_math.token_level_rewards(
            batch.token_level_scores[idx], slice_mask, behaviour_log_probs=behaviour,
            ref_log_probs=None if ref_log_probs is None else ref_log_probs[idx], settings=settings,
        )
        adv = ppo_math.advantages(rewards, slice_mask, [batch.uid[i] for i in rows], settings)
        old = behaviour if pi_old is None else pi_old[idx]
        weights = None if pi_old is None else ppo_math.truncated_is_weights(pi_old[idx], behaviour, settings.tis_cap)
        model.train()
        totals: dict[str, float] = {}
        grad_norms: list[float] = []
        micro_count = 0
        mini = max(1, settings.ppo_mini_batch_size)
        micro = max(1, settings.ppo_micro_batch_size)
        for _ in range(settings.ppo_epochs):
            for m_start in range(0, len(rows), mini):
                mini_rows = list(range(m_start, min(m_start + mini, len(rows))))
                optimizer.zero_grad(set_to_none=True)
                for u_start in range(0, len(mini_rows), micro):
                    local = mini_rows[u_start : u_start + micro]
                    stats = forward([rows[i] for i in local], grad=True, entropy=bool(settings.entropy_coeff))
                    loc = torch.tensor(local, dtype=torch.long)
                    loss, parts = ppo_math.policy_loss(
                        old_log_probs=old[loc], log_probs=stats.log_probs, adv=adv[loc],
                        response_mask=slice_mask[loc], entropy=stats.entropy,
                        is_weights=None if weights is None else weights[loc], actor=actor, settings=settings,
                    )
                    (loss * (len(local) / len(mini_rows))).backward()
                    parts["loss"] = float(loss.detach())
                    for key, value in parts.items():
                        totals[key] = totals.get(key, 0.0) + value
                    micro_count += 1
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.requires_grad], settings.grad_clip
                )
                grad_norms.append(float(grad_norm))
                optimizer.step()
        elapsed = time.perf_counter() - started
        totals = {key: value / max(1, micro_count) for key, value in totals.items()}
        totals["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
        metrics = ppo_math.step_record(
            totals, step=step, samples=len(rows), response_mask=slice_mask, kl=kl,
            scores=batch.token_level_scores[idx], epochs=settings.ppo_epochs, elapsed_s=elapsed, meta=batch.meta,
        )
        step_metrics.append(metrics)
        emit({"event": "step", "metrics": metrics})
    save_peft_adapter(model, Path(spec["output_dir"]))
    return {
        "metrics": ppo_math.run_record(step_metrics, batch.meta),
        "dropped_sample_ids": batch.dropped_sample_ids,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m openjiuwen.agent_evolving.agent_rl.online.training.local_worker SPEC.json",
              file=sys.stderr)
        return 2
    events = _events_stream()
    from ..watchdog import install_parent_death_watchdog

    install_parent_death_watchdog()  # a trainer never outlives the service that started it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = json.loads(Path(argv[0]).read_bytes())
    result = train(spec, lambda event: _emit(events, event))
    _emit(events, {"event": "done", **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
