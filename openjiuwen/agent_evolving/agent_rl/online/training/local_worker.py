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
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:  # torch, peft and transformers load in the worker only, inside the functions that use them
    from .batch import ConvertedBatch
    from .ppo_settings import PPOSettings


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
    from .adapter_files import save_peft_adapter
    from .ppo_settings import PPOSettings

    settings = PPOSettings.from_dict(spec["settings"])
    _seed_torch(settings)
    model, tokenizer = _load_policy(spec, settings)
    batch = _load_batch(spec, settings, tokenizer)
    update = _PPOUpdate(model, batch, settings)
    step_metrics: list[dict[str, Any]] = []
    for step, rows in enumerate(update.slices(), start=1):
        metrics = update.step(step, rows)
        step_metrics.append(metrics)
        emit({"event": "step", "metrics": metrics})
    save_peft_adapter(model, Path(spec["output_dir"]))
    return {
        "metrics": update.run_record(step_metrics),
        "dropped_sample_ids": batch.dropped_sample_ids,
    }


def _seed_torch(settings: PPOSettings) -> None:
    import torch

    torch.manual_seed(settings.seed)  # before the LoRA exists: a new adapter's initial weights come from it
    torch.set_num_threads(settings.num_threads if settings.num_threads > 0 else max(1, os.cpu_count() or 1))


def _load_policy(spec: dict[str, Any], settings: PPOSettings) -> tuple[Any, Any]:
    """The base model with the parent adapter (trainable) when there is one, else a new LoRA; and its tokenizer."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        settings.dtype, torch.float32
    )
    base_path = spec["base_model_path"]
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    if spec.get("init_lora_path"):
        return PeftModel.from_pretrained(model, spec["init_lora_path"], is_trainable=True), tokenizer
    lora = LoraConfig(
        r=settings.lora_rank, lora_alpha=settings.lora_alpha, target_modules=settings.target_modules,
        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora), tokenizer


def _load_batch(spec: dict[str, Any], settings: PPOSettings, tokenizer: Any) -> ConvertedBatch:
    from .batch import convert_samples

    samples = json.loads(Path(spec["batch_path"]).read_bytes())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return convert_samples(
        samples, pad_token_id=pad, max_prompt_length=settings.max_prompt_length,
        max_response_length=settings.max_response_length,
        filter_overlong_prompts=settings.filter_overlong_prompts,
        advantage_estimator=settings.advantage_estimator,
    )


class _PPOUpdate:
    """One run's PPO state: the policy and its optimizer, the converted batch, and the log-probs fixed before any
    update, each row at its sample's temperature: the frozen base model as KL reference, and π_old with the parent
    weights (the sampling report's recomputed logprobs; the PPO "old" logprobs too under TIS, and for the rows of
    constrained samples, which are always decoupled: ppo_math.behaviour_correction)."""

    def __init__(self, model: Any, batch: ConvertedBatch, settings: PPOSettings) -> None:
        import torch

        from . import ppo_math

        self._model = model
        self._batch = batch
        self._settings = settings
        self._actor = ppo_math.actor_config(settings)
        want_kl = settings.use_kl_in_reward and settings.kl_coef > 0
        self._ref_log_probs = self._forward_all(disable_adapter=True) if want_kl else None
        pi_old = self._forward_all()
        # Kept for decoupled rows: every row under `tis_cap`, the constrained rows otherwise (`behaviour_correction`).
        self._pi_old = pi_old if settings.tis_cap or bool(batch.corrected.any()) else None
        self.sampling = ppo_math.sampling_report(
            captured=batch.old_log_probs, recomputed=pi_old, response_mask=batch.response_mask,
            temperatures=batch.temperatures, truncated=batch.truncated, settings=settings, corrected=batch.corrected,
        )
        self._optimizer = torch.optim.AdamW(self._trainable(), lr=settings.learning_rate, weight_decay=0.01)

    def _trainable(self) -> list[Any]:
        return [p for p in self._model.parameters() if p.requires_grad]

    def slices(self) -> list[list[int]]:
        from .batch import chunk_rows

        batch = self._batch
        grpo = self._settings.advantage_estimator == "grpo"  # a group is never split across steps
        return chunk_rows(
            len(batch), self._settings.ppo_samples_per_step, uids=batch.uid if grpo else None,
            created_at=batch.created_at if grpo else None,
        )

    def _forward(self, rows: list[int], *, grad: bool, entropy: bool = False) -> Any:
        import torch

        from . import ppo_math

        batch = self._batch
        idx = torch.tensor(rows, dtype=torch.long)
        with torch.set_grad_enabled(grad):
            return ppo_math.response_log_probs(
                self._model, batch.input_ids[idx], batch.attention_mask[idx], batch.position_ids[idx],
                batch.responses[idx], batch.temperatures[idx], with_entropy=entropy,
                detach_prompt=grad and self._settings.detach_prompt,
            )

    def _forward_all(self, *, disable_adapter: bool = False) -> Any:
        import torch

        micro = max(1, self._settings.ppo_micro_batch_size)
        parts = []
        self._model.eval()
        for start in range(0, len(self._batch), micro):
            rows = list(range(start, min(start + micro, len(self._batch))))
            if disable_adapter:
                with self._model.disable_adapter():
                    parts.append(self._forward(rows, grad=False).log_probs)
            else:
                parts.append(self._forward(rows, grad=False).log_probs)
        return torch.cat(parts).detach()

    def step(self, step: int, rows: list[int]) -> dict[str, Any]:
        """One PPO step over the batch rows `rows`: rewards and advantages of the slice, then the update; its
        metrics record."""
        import torch

        from . import ppo_math

        batch, settings = self._batch, self._settings
        started = time.perf_counter()
        idx = torch.tensor(rows, dtype=torch.long)
        behaviour = batch.old_log_probs[idx]
        slice_mask = batch.response_mask[idx]
        ref = None if self._ref_log_probs is None else self._ref_log_probs[idx]
        rewards, kl = ppo_math.token_level_rewards(
            batch.token_level_scores[idx], slice_mask, behaviour_log_probs=behaviour, ref_log_probs=ref,
            settings=settings,
        )
        adv = ppo_math.advantages(rewards, slice_mask, [batch.uid[i] for i in rows], settings)
        old, weights = ppo_math.behaviour_correction(
            behaviour, None if self._pi_old is None else self._pi_old[idx], batch.corrected[idx], settings)
        totals = self._update(rows, old=old, adv=adv, mask=slice_mask, weights=weights)
        elapsed = time.perf_counter() - started
        return ppo_math.step_record(
            totals, step=step, samples=len(rows), response_mask=slice_mask, kl=kl,
            scores=batch.token_level_scores[idx], epochs=settings.ppo_epochs, elapsed_s=elapsed, meta=batch.meta,
        )

    def _update(self, rows: list[int], *, old: Any, adv: Any, mask: Any, weights: Any) -> dict[str, float]:
        """`ppo_epochs` passes over the slice in mini-batches (one optimizer step each) of micro-batches (one
        backward each); the loss parts averaged over the micro-batches, and the mean gradient norm."""
        import torch

        from . import ppo_math

        settings = self._settings
        self._model.train()
        totals: dict[str, float] = {}
        grad_norms: list[float] = []
        micro_count = 0
        mini = max(1, settings.ppo_mini_batch_size)
        micro = max(1, settings.ppo_micro_batch_size)
        for _ in range(settings.ppo_epochs):
            for m_start in range(0, len(rows), mini):
                mini_rows = list(range(m_start, min(m_start + mini, len(rows))))
                self._optimizer.zero_grad(set_to_none=True)
                for u_start in range(0, len(mini_rows), micro):
                    local = mini_rows[u_start : u_start + micro]
                    stats = self._forward([rows[i] for i in local], grad=True, entropy=bool(settings.entropy_coeff))
                    loc = torch.tensor(local, dtype=torch.long)
                    loss, parts = ppo_math.policy_loss(
                        old_log_probs=old[loc], log_probs=stats.log_probs, adv=adv[loc],
                        response_mask=mask[loc], entropy=stats.entropy,
                        is_weights=None if weights is None else weights[loc], actor=self._actor, settings=settings,
                    )
                    (loss * (len(local) / len(mini_rows))).backward()
                    parts["loss"] = float(loss.detach())
                    for key, value in parts.items():
                        totals[key] = totals.get(key, 0.0) + value
                    micro_count += 1
                grad_norm = torch.nn.utils.clip_grad_norm_(self._trainable(), settings.grad_clip)
                grad_norms.append(float(grad_norm))
                self._optimizer.step()
        totals = {key: value / max(1, micro_count) for key, value in totals.items()}
        totals["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
        return totals

    def run_record(self, step_metrics: list[dict[str, Any]]) -> dict[str, Any]:
        from . import ppo_math

        return ppo_math.run_record(step_metrics, self._batch.meta, self.sampling)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m openjiuwen.agent_evolving.agent_rl.online.training.local_worker SPEC.json",
              file=sys.stderr)
        return 2
    # Everything the trainer writes (the adapter, peft's model card before it is removed, library caches) is private
    # while it is written; the LoRA repository sets the published modes when it seals the version.
    os.umask(0o077)
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
