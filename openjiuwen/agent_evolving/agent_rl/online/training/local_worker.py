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
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ...common.policy_names import BASE_POLICY
from .phase_clock import PhaseClock

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
    """The run, timed per phase (`metrics.timings`: load, pi_old, steps, save; the backend adds publish)."""
    clock = PhaseClock()
    with clock.phase("load"):
        from .adapter_files import save_peft_adapter
        from .ppo_settings import PPOSettings
        from .ppo_update import PPOUpdate

        settings = PPOSettings.from_dict(spec["settings"])
        _seed_torch(settings)
        model, tokenizer = _load_policy(spec, settings)
        batch = _load_batch(spec, settings, tokenizer)
        update = PPOUpdate(model, batch, settings)
    with clock.phase("pi_old"):
        update.fix_log_probs(spec.get("parent_version") or BASE_POLICY)
    step_metrics: list[dict[str, Any]] = []
    with clock.phase("steps"):
        for step, rows in enumerate(update.slices(), start=1):
            metrics = update.step(step, rows)
            step_metrics.append(metrics)
            emit({"event": "step", "metrics": metrics})
    with clock.phase("save"):
        save_peft_adapter(model, Path(spec["output_dir"]))
    return {
        "metrics": {**update.run_record(step_metrics), "timings": clock.seconds},
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
