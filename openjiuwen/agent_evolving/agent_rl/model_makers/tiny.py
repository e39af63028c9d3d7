"""A tiny, randomly initialised Qwen2-architecture causal LM with a locally trained tokenizer.

Nothing is downloaded: the byte-level BPE tokenizer is trained with `tokenizers` on a few built-in sentences and the
weights come from a seeded random initialisation. The directory it writes loads offline (`HF_HUB_OFFLINE=1`) in
transformers (`AutoModelForCausalLM` / `AutoTokenizer`), in peft (LoRA on all linear layers) and in vLLM's CPU build,
which rejects head_dim 16 — so the default shape keeps head_dim = hidden_size / num_heads = 64.

The same arguments and seed give byte-identical weights and tokenizer files. Heavy imports (torch, transformers,
tokenizers) happen inside the functions, never at import time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (copied so this module needs no transformers import).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Size the BPE trainer aims for (specials + 256 byte symbols + merges); the corpus below can supply that many merges.
TOKENIZER_TARGET_VOCAB = 384

# Qwen-style ChatML. Content may be a string, a list of OpenAI content parts (text parts are kept) or null; assistant
# tool calls are rendered as Qwen's <tool_call> blocks so agent histories with tool use still render.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}"
    "{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CORPUS = (
    "You are a helpful assistant.",
    "The quick brown fox jumps over the lazy dog.",
    "Please book a table for two at seven o'clock tonight.",
    "What is the weather like in Hangzhou tomorrow?",
    "The answer is 42, and the reason is simple arithmetic.",
    "Call the search tool with the query and summarise the results.",
    "I could not find the file; please check the path and try again.",
    "Thank you! That solved the problem.",
    "Reinforcement learning improves the policy from rewards.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "<tool_call>\n</tool_call>\n<think>\n</think>\n",
    "user assistant system tool function arguments content role",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2025 3.14 -1 +1 = < > ( ) [ ] { } : ; , . ! ?",
    "Hello, world! Hello again. Goodbye for now.",
    "A tiny model for tests: random weights, real shapes.",
)


def _train_tokenizer(target_vocab: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # The exact pipeline transformers' Qwen2Tokenizer rebuilds when it loads a `model_type: qwen2` directory (NFC,
    # Qwen's split regex, byte-level without its own regex). With any other pipeline AutoTokenizer (and vLLM, which
    # loads through it) would tokenize differently from tokenizer.json.
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=target_vocab,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so merge counts are well separated; training is deterministic for a given input.
    tok.train_from_iterator([s for s in _CORPUS for _ in range(3)], trainer=trainer)
    return tok


def make_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = True,
) -> Path:
    """Write a tiny random Qwen2 causal LM (float32 safetensors) and its tokenizer into `out_dir`; return the path.

    `vocab_size` is the model's embedding size; None means exactly the tokenizer's size, a larger value pads the
    embedding matrix (ids past the tokenizer are never produced by it). `num_kv_heads` defaults to `num_heads`,
    `intermediate_size` to 2 × `hidden_size`. head_dim = hidden_size / num_heads must be a whole number (use 64 for
    vLLM's CPU attention).
    """
    if hidden_size <= 0 or num_layers <= 0 or num_heads <= 0:
        raise ValueError("hidden_size, num_layers and num_heads must be positive")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if kv_heads <= 0 or num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {kv_heads}")

    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)

    raw = _train_tokenizer(TOKENIZER_TARGET_VOCAB)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tok_len = len(tokenizer)
    model_vocab = tok_len if vocab_size is None else vocab_size
    if model_vocab < tok_len:
        raise ValueError(f"vocab_size {model_vocab} is smaller than the tokenizer's {tok_len} tokens")

    config = Qwen2Config(
        vocab_size=model_vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_layers,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        dtype="float32",
    )
    # Seed a private RNG stream so the caller's global torch RNG state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = None

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def describe(model_dir: str | Path) -> dict[str, Any]:
    """What `make_tiny_model` wrote: the shape from config.json and every file with its size."""
    path = Path(model_dir)
    config = json.loads((path / "config.json").read_text())
    return {
        "path": str(path),
        "architecture": (config.get("architectures") or ["?"])[0],
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config["hidden_size"] // config["num_attention_heads"],
        "files": {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()},
    }


def main(argv: list[str] | None = None) -> int:
    """`openjiuwen-rl tiny-model --out DIR [--seed N]`: write the tiny model and print what was written."""
    parser = argparse.ArgumentParser(
        prog="openjiuwen-rl tiny-model",
        description="Write a tiny random Qwen2 model + locally trained tokenizer (no download).",
    )
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=None, help="model vocab (default: the tokenizer's size)")
    args = parser.parse_args(argv)
    try:
        path = make_tiny_model(
            args.out,
            seed=args.seed,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
        )
    except ValueError as exc:
        parser.error(str(exc))
    info = describe(path)
    print(
        f"wrote {info['architecture']} to {info['path']}: vocab {info['vocab_size']}, hidden {info['hidden_size']}, "
        f"{info['num_layers']} layers, {info['num_heads']} heads (head_dim {info['head_dim']}), seed {args.seed}"
    )
    for name, size in info["files"].items():
        print(f"  {name:32} {size:>10} bytes")
    return 0
