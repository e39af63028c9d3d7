"""The tiny model maker: loads offline in transformers and peft, generates with logprobs, and is deterministic."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

# huggingface_hub reads this when first imported; every load below must work without a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from openjiuwen.agent_evolving.agent_rl.cli.main import COMMANDS  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import (  # noqa: E402
    IM_END,
    IM_START,
    PAD_TOKEN,
    main,
    make_tiny_model,
)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_files_and_shape(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM CPU rejects head_dim 16
    assert config["dtype"] == "float32"


def test_transformers_load_chat_template_forward_generate(model_dir: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.dtype == torch.float32
    assert model.model.layers[0].self_attn.head_dim == 64
    assert model.config.vocab_size == len(tok)
    assert tok.eos_token == IM_END and tok.pad_token == PAD_TOKEN
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather like in Paris?"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the weather like in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids(IM_START)
    assert ids.count(tok.eos_token_id) == 2  # specials stay single tokens
    assert tok.decode(ids) == text
    # AutoTokenizer (what vLLM loads through) must agree with tokenizer.json itself.
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for sample in (text, "x=100000; café 中文 🙂\n\n  spaces"):
        assert tok(sample, add_special_tokens=False)["input_ids"] == raw.encode(sample, add_special_tokens=False).ids

    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits
    assert logits.shape == (1, len(ids), len(tok))
    assert torch.isfinite(logits).all()

    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new_tokens = out.sequences[0, len(ids) :]
    assert new_tokens.shape == (6,)
    logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    assert logprobs.shape == (6,)
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()
    # The generated token is the greedy argmax and its logprob the log-softmax of its score.
    for step, token in enumerate(new_tokens.tolist()):
        step_logprobs = torch.log_softmax(out.scores[step][0].float(), dim=-1)
        assert int(step_logprobs.argmax()) == token
        assert torch.allclose(step_logprobs[token], logprobs[step], atol=1e-5)


def test_peft_lora_all_linear_saves_adapter(model_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, lora)
    trainable, total = peft_model.get_nb_trainable_parameters()
    assert 0 < trainable < total

    out = tmp_path / "adapter"
    peft_model.save_pretrained(out)
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin", "adapter_model.bin"}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["lora_alpha"] == 32
    # peft expands "all-linear" to full module paths (every projection of every layer, never lm_head).
    targets = config["target_modules"]
    assert len(targets) == 7 * 2
    assert {t.rsplit(".", 1)[-1] for t in targets} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }


def test_same_seed_same_bytes_other_seed_other_weights(model_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(again / name) == _digest(model_dir / name), name
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert _digest(other / "model.safetensors") != _digest(model_dir / "model.safetensors")
    assert _digest(other / "tokenizer.json") == _digest(model_dir / "tokenizer.json")


def test_bad_shapes_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="divisible"):
        make_tiny_model(tmp_path / "bad", hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_tiny_model(tmp_path / "bad", vocab_size=10)


def test_cli_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "tiny-model" in COMMANDS
    out_dir = tmp_path / "cli"
    assert COMMANDS["tiny-model"][1](["--out", str(out_dir), "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "head_dim 64" in printed and "model.safetensors" in printed and str(out_dir) in printed
    assert (out_dir / "model.safetensors").is_file()
    with pytest.raises(SystemExit):
        main([])  # --out is required
