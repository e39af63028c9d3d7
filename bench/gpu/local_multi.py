"""K lineages' LoRA adapters trained on one device: one after another (today: a run per lineage, each loading the
base model) vs interleaved in one process (the base model loaded once, one adapter and optimizer per lineage,
their PPO steps taking turns). Prints per-lineage and total times and checks that each interleaved adapter equals
the one trained alone (no lineage's update touches another's adapter).

    python bench/gpu/local_multi.py MODEL_DIR --device cuda              # on the GPU machine
    python bench/gpu/local_multi.py --random-model 0.4b --device cuda    # a generated 0.4 B Qwen2 model instead
    python bench/gpu/local_multi.py MODEL_DIR --device cpu --quick       # here (tests/unit/test_local_multi_bench.py)

MODEL_DIR: a Hugging Face causal-LM directory: the tiny model (`openjiuwen-rl tiny-model --out DIR`) or a converted
SmolLM2 (`openjiuwen-rl model smollm2`). `--random-model`: a randomly initialised Qwen2-architecture model written
to a temporary directory first (no download, no tokenizer needed: the samples are random token ids); `0.4b` is the
GPU check's generated size (24 layers, hidden 1024). Results go to stdout and, as JSON, to `--out` and to
`$OUT/local_multi_<model>_k<K>.json` when `OUT` is set (`<model>`: the `--random-model` size or the directory's
name).

Self-contained on purpose: it imports torch, transformers and peft only (no verl, no Ray, nothing of this project),
so it runs on a GPU machine that has just those. The PPO step restates the local trainer's
(training/local_worker.py + ppo_math.py, which import verl's core_algos): per-row response logprobs, the captured
logprobs as PPO's old side (bypass mode), REINFORCE++ advantages with the KL to the frozen base (adapter disabled) in
the reward, PPO-clip (0.2 / 0.28) token-mean minus an entropy bonus, AdamW, gradient clipping, mini-batches of
micro-batches, `epochs` passes. The same work in both modes, so the difference is what loading once and taking
turns changes.
"""

from __future__ import annotations

import time

_STARTED = time.perf_counter()  # before the heavy imports: their cost is what a separate run process pays each time

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


@dataclass(frozen=True)
class Spec:
    lineages: int = 2
    samples: int = 64
    prompt_tokens: int = 16
    response_tokens: int = 48
    epochs: int = 2
    mini_batch: int = 16
    micro_batch: int = 8
    lr: float = 5e-4
    lora_rank: int = 16
    kl_coef: float = 0.001
    entropy_coeff: float = 0.01
    clip_low: float = 0.2
    clip_high: float = 0.28
    grad_clip: float = 1.0
    seed: int = 1
    dtype: str = "float32"


QUICK = {"samples": 8, "prompt_tokens": 8, "response_tokens": 8, "epochs": 1, "mini_batch": 4, "micro_batch": 4}


@dataclass
class Batch:
    """One lineage's claimed samples, already tensors on the device (right-padded responses of equal length)."""

    input_ids: torch.Tensor  # [n, prompt + response]
    response_mask: torch.Tensor  # [n, response]
    behaviour: torch.Tensor  # captured logprobs [n, response]
    scores: torch.Tensor  # [n]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def load_model(model_dir: Path, spec: Spec, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)


def response_log_probs(model: Any, input_ids: torch.Tensor, response_len: int, *,
                       entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = model(input_ids=input_ids).logits[:, -response_len - 1:-1].float()
    logp = F.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, input_ids[:, -response_len:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if entropy else None
    return chosen, ent


def make_batches(model: Any, spec: Spec, vocab: int, device: str) -> list[Batch]:
    """Per lineage: random prompts and responses, their base-model logprobs as the captured ones, and a reward rule
    of its own (lineage k rewards the responses richest in token ids ≡ k mod 2), so the adapters part ways."""
    batches = []
    for k in range(spec.lineages):
        gen = torch.Generator().manual_seed(1000 + k)
        ids = torch.randint(3, vocab, (spec.samples, spec.prompt_tokens + spec.response_tokens), generator=gen)
        ids = ids.to(device)
        with torch.no_grad():
            model.eval()
            behaviour = torch.cat([response_log_probs(model, ids[i:i + spec.micro_batch], spec.response_tokens)[0]
                                   for i in range(0, spec.samples, spec.micro_batch)])
        share = ((ids[:, -spec.response_tokens:] % 2) == (k % 2)).float().mean(-1)
        scores = (share >= share.median()).float()
        mask = torch.ones(spec.samples, spec.response_tokens, device=device)
        batches.append(Batch(ids, mask, behaviour.detach(), scores))
    return batches


class Lineage:
    """One lineage's PPO state on a (shared or own) peft model: its adapter name, optimizer and fixed batch terms."""

    def __init__(self, model: Any, name: str, batch: Batch, spec: Spec) -> None:
        self.model, self.name, self.batch, self.spec = model, name, batch, spec
        self.model.set_adapter(name)
        params = [p for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n]
        assert params, f"adapter {name} has no parameters"
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.01)
        with torch.no_grad(), model.disable_adapter():
            model.eval()
            ref = torch.cat([response_log_probs(model, batch.input_ids[i:i + spec.micro_batch],
                                                spec.response_tokens)[0]
                             for i in range(0, spec.samples, spec.micro_batch)])
        self.advantages = reinforce_pp(batch, ref, spec)
        self.train_seconds = 0.0
        self.metrics: list[dict[str, float]] = []

    def mini_batches(self) -> list[list[int]]:
        rows = list(range(self.spec.samples))
        return [rows[i:i + self.spec.mini_batch] for _ in range(self.spec.epochs)
                for i in range(0, len(rows), self.spec.mini_batch)]

    def step(self, rows: list[int], device: str) -> None:
        """One optimizer step over `rows` (micro-batches of one backward each)."""
        spec, batch, model = self.spec, self.batch, self.model
        sync(device)
        started = time.perf_counter()
        model.set_adapter(self.name)
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for u in range(0, len(rows), spec.micro_batch):
            idx = torch.tensor(rows[u:u + spec.micro_batch], device=batch.input_ids.device)
            logp, ent = response_log_probs(model, batch.input_ids[idx], spec.response_tokens, entropy=True)
            mask, adv, old = batch.response_mask[idx], self.advantages[idx], batch.behaviour[idx]
            ratio = torch.exp(logp - old)
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - spec.clip_low, 1 + spec.clip_high))
            loss = ((pg - spec.entropy_coeff * ent) * mask).sum() / mask.sum()
            (loss * (len(idx) / len(rows))).backward()
            total += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, spec.grad_clip)
        self.optimizer.step()
        sync(device)
        self.train_seconds += time.perf_counter() - started
        self.metrics.append({"loss": total, "grad_norm": float(grad_norm)})

    def adapter(self) -> dict[str, torch.Tensor]:
        return {n.replace(f".{self.name}.", "."): p.detach().float().cpu().clone()
                for n, p in self.model.named_parameters() if f".{self.name}." in n and "lora_" in n}


def reinforce_pp(batch: Batch, ref: torch.Tensor, spec: Spec) -> torch.Tensor:
    """REINFORCE++ (γ = 1): the score on the last response token minus the per-token KL penalty to the base, summed
    to the end of the response, whitened over the batch's response tokens."""
    mask = batch.response_mask
    rewards = -spec.kl_coef * (batch.behaviour - ref) * mask
    last = mask.sum(-1).long() - 1
    rewards[torch.arange(len(last)), last] += batch.scores
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    mean = (returns * mask).sum() / mask.sum()
    var = (((returns - mean) ** 2) * mask).sum() / mask.sum()
    return ((returns - mean) / (var.sqrt() + 1e-8) * mask).detach()


def add_adapter(model: Any, name: str, spec: Spec) -> Any:
    """The lineage's fresh LoRA (seeded: a lineage starts from the same weights in both modes)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(r=spec.lora_rank, lora_alpha=2 * spec.lora_rank, target_modules="all-linear",
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    torch.manual_seed(spec.seed + int(name.rsplit("-", 1)[-1]))
    if isinstance(model, PeftModel):
        model.add_adapter(name, config)
        return model
    return get_peft_model(model, config, adapter_name=name)


def save(model: Any, name: str, out: Path) -> None:
    model.save_pretrained(out / name, selected_adapters=[name])


def sequential(model_dir: Path, spec: Spec, batches: list[Batch], device: str, out: Path) -> dict[str, Any]:
    """Today: one run per lineage after another, each loading the base model, training, saving its adapter."""
    sync(device)
    started = time.perf_counter()
    runs, adapters = [], []
    for k, batch in enumerate(batches):
        t0 = time.perf_counter()
        model = add_adapter(load_model(model_dir, spec, device), f"lineage-{k}", spec)
        sync(device)
        loaded = time.perf_counter() - t0
        lineage = Lineage(model, f"lineage-{k}", batch, spec)
        for rows in lineage.mini_batches():
            lineage.step(rows, device)
        save(model, lineage.name, out / "sequential")
        adapters.append(lineage.adapter())
        sync(device)
        runs.append({"lineage": k, "load_seconds": loaded, "train_seconds": lineage.train_seconds,
                     "run_seconds": time.perf_counter() - t0, "last_loss": lineage.metrics[-1]["loss"]})
        del model, lineage
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {"runs": runs, "total_seconds": time.perf_counter() - started, "adapters": adapters}


def interleaved(model_dir: Path, spec: Spec, batches: list[Batch], device: str, out: Path) -> dict[str, Any]:
    """One process: the base model loaded once, K adapters on it, their steps taking turns."""
    sync(device)
    started = time.perf_counter()
    model = load_model(model_dir, spec, device)
    for k in range(len(batches)):
        model = add_adapter(model, f"lineage-{k}", spec)
    sync(device)
    loaded = time.perf_counter() - started
    lineages = [Lineage(model, f"lineage-{k}", batch, spec) for k, batch in enumerate(batches)]
    schedules = [lineage.mini_batches() for lineage in lineages]
    for turn in range(max(len(s) for s in schedules)):
        for lineage, schedule in zip(lineages, schedules):
            if turn < len(schedule):
                lineage.step(schedule[turn], device)
    for lineage in lineages:
        save(model, lineage.name, out / "interleaved")
    sync(device)
    runs = [{"lineage": k, "train_seconds": lineage.train_seconds, "last_loss": lineage.metrics[-1]["loss"]}
            for k, lineage in enumerate(lineages)]
    result = {"load_seconds": loaded, "runs": runs, "total_seconds": time.perf_counter() - started,
              "adapters": [lineage.adapter() for lineage in lineages]}
    del model, lineages
    gc.collect()
    return result


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), "the adapters hold different parameters"
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def run(model_dir: Path, spec: Spec, device: str, log: Any = print) -> dict[str, Any]:
    import peft  # noqa: F401  (imported here so that the import time below holds it)
    from transformers import AutoConfig

    imports = time.perf_counter() - _STARTED

    torch.manual_seed(spec.seed)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    base = load_model(model_dir, spec, device)
    params = sum(p.numel() for p in base.parameters())
    batches = make_batches(base, spec, vocab, device)
    del base
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="local-multi-") as tmp:
        seq = sequential(model_dir, spec, batches, device, Path(tmp))
        inter = interleaved(model_dir, spec, batches, device, Path(tmp))
    # Each lineage's adapter trained in turns equals the one trained alone: nothing of another lineage reached it.
    same = [max_diff(s, i) for s, i in zip(seq.pop("adapters"), inter["adapters"])]
    apart = max_diff(inter["adapters"][0], inter["adapters"][1]) if spec.lineages > 1 else None
    inter.pop("adapters")
    result = {
        "model_dir": str(model_dir), "parameters": params, "device": device,
        "device_name": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "spec": asdict(spec), "import_seconds": imports,
        "sequential": seq, "interleaved": inter,
        "speedup": seq["total_seconds"] / inter["total_seconds"] if inter["total_seconds"] else None,
        "max_abs_diff_interleaved_vs_alone": same, "max_abs_diff_between_lineages": apart,
    }
    log(f"model {model_dir} ({params / 1e6:.1f} M parameters) on {result['device_name']}, torch {torch.__version__}; "
        f"{spec.lineages} lineages x {spec.samples} samples x {spec.response_tokens} response tokens, "
        f"{spec.epochs} epoch(s), mini-batch {spec.mini_batch}, {spec.dtype}")
    for r in seq["runs"]:
        log(f"  one after another: lineage {r['lineage']}: load {r['load_seconds']:.2f} s, "
            f"train {r['train_seconds']:.2f} s, run {r['run_seconds']:.2f} s")
    log(f"  one after another: total {seq['total_seconds']:.2f} s (separate run processes would also pay the "
        f"imports each: {imports:.2f} s here, x{spec.lineages} = {imports * spec.lineages:.2f} s)")
    log(f"  interleaved: load once {inter['load_seconds']:.2f} s; " + ", ".join(
        f"lineage {r['lineage']} train {r['train_seconds']:.2f} s" for r in inter["runs"]))
    log(f"  interleaved: total {inter['total_seconds']:.2f} s (speed-up x{result['speedup']:.2f})")
    log(f"  each interleaved adapter vs trained alone: max |diff| {max(same):.2e}; "
        f"between lineages: {apart if apart is None else f'{apart:.2e}'}")
    return result


# Qwen2 shapes of the generated models: the GPU check's 0.37 B model (bench/gpu/verl_run.py) and a tiny one.
RANDOM_MODELS = {
    "0.4b": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4,
             "intermediate_size": 4096, "vocab_size": 32000},
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
             "intermediate_size": 256, "vocab_size": 384},
}


def random_model(name: str, out: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**RANDOM_MODELS[name], tie_word_embeddings=True, max_position_embeddings=512)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, nargs="?", default=None,
                        help="a Hugging Face causal-LM directory (tiny model or SmolLM2)")
    parser.add_argument("--random-model", choices=sorted(RANDOM_MODELS), default=None,
                        help="generate a random Qwen2 model of this size instead of MODEL_DIR")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lineages", type=int, default=Spec.lineages)
    parser.add_argument("--samples", type=int, default=Spec.samples)
    parser.add_argument("--response-tokens", type=int, default=Spec.response_tokens)
    parser.add_argument("--epochs", type=int, default=Spec.epochs)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=Spec.dtype)
    parser.add_argument("--quick", action="store_true", help="a seconds-long size (the CPU smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    if (args.model_dir is None) == (args.random_model is None):
        parser.error("name either MODEL_DIR or --random-model")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        parser.error(f"{args.model_dir} holds no config.json (a Hugging Face model directory)")
    if args.lineages < 1:
        parser.error("--lineages must be at least 1")
    fields = {"lineages": args.lineages, "samples": args.samples, "response_tokens": args.response_tokens,
              "epochs": args.epochs, "dtype": args.dtype}
    spec = Spec(**{**fields, **(QUICK if args.quick else {})})
    if spec.samples % spec.mini_batch:
        parser.error(f"--samples must be a multiple of the mini-batch ({spec.mini_batch})")
    with tempfile.TemporaryDirectory(prefix="local-multi-model-") as tmp:
        model_dir = random_model(args.random_model, Path(tmp)) if args.random_model else args.model_dir.resolve()
        result = run(model_dir, spec, args.device)
        if args.random_model:
            result["model_dir"] = f"random {args.random_model}"
    text = json.dumps(result, indent=2)
    targets = [args.out] if args.out else []
    if os.environ.get("OUT"):
        model = args.random_model or args.model_dir.resolve().name
        targets.append(Path(os.environ["OUT"]) / f"local_multi_{model}_k{spec.lineages}.json")
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
