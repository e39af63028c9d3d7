"""The local trainer's `detach_prompt` (ppo_math.response_log_probs): the prompt runs without autograd as a key/value
cache, the last prompt token and the response with autograd. The response log-probabilities must be the very ones
of the plain forward pass (left-padded prompts, right-padded responses, as batch.py lays them out), the LoRA must
still get a gradient, and the gradient must differ only by what flowed through the prompt's keys/values."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytest.importorskip("verl")

from transformers import AutoModelForCausalLM  # noqa: E402

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_math import response_log_probs  # noqa: E402
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings, apply_tree  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m = peft.get_peft_model(m, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                               task_type="CAUSAL_LM"))
    for name, p in m.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # a non-zero adapter, as after a first Training Run
    return m


def batch():
    torch.manual_seed(1)
    b, p, r = 3, 24, 6
    ids = torch.randint(3, 300, (b, p + r))
    mask = torch.ones(b, p + r, dtype=torch.long)
    mask[0, :5] = 0  # left padding of a shorter prompt
    mask[1, :2] = 0
    mask[2, -2:] = 0  # right padding of a shorter response
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos, ids[:, p:], mask[:, p:].bool()


def test_detached_prompt_gives_the_same_log_probs(model):
    ids, mask, pos, resp, rmask = batch()
    temps = torch.tensor([0.7, 1.0, 1.3])  # per row, as the samples were drawn
    plain = response_log_probs(model, ids, mask, pos, resp, temps)
    detached = response_log_probs(model, ids, mask, pos, resp, temps, detach_prompt=True)
    assert plain.log_probs.shape == detached.log_probs.shape == resp.shape
    assert torch.allclose(plain.log_probs[rmask], detached.log_probs[rmask], atol=1e-4)


def test_detached_prompt_still_trains_the_lora_but_not_through_the_prompt(model):
    ids, mask, pos, resp, rmask = batch()
    grads = []
    for detach in (False, True):
        model.zero_grad(set_to_none=True)
        response_log_probs(model, ids, mask, pos, resp, torch.ones(3), detach_prompt=detach).log_probs[
            rmask].sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
    full, detached = grads
    assert detached.abs().sum() > 0
    assert not torch.allclose(full, detached)  # the prompt's share of the gradient is gone


def test_detach_prompt_is_read_from_the_local_section_of_the_ppo_yaml():
    assert PPOSettings().detach_prompt is False
    assert apply_tree(PPOSettings(), {"local": {"detach_prompt": True}}).detach_prompt is True


def test_a_shared_prompt_prefix_is_run_once_with_the_same_log_probs(model):
    """Rows that start with the same system prompt (left-padded to different lengths): the shared part is run for
    one row and repeated; the log-probabilities must still be the plain forward pass's."""
    torch.manual_seed(2)
    b, p, r = 4, 30, 5
    shared = torch.randint(3, 300, (12,))
    ids = torch.randint(3, 300, (b, p + r))
    mask = torch.ones(b, p + r, dtype=torch.long)
    for row, pad in enumerate((0, 4, 9, 2)):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
        ids[row, pad : pad + 12] = shared
    mask[3, -1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    resp, rmask = ids[:, p:], mask[:, p:].bool()
    temps = torch.tensor([1.0, 0.5, 1.5, 1.0])
    plain = response_log_probs(model, ids, mask, pos, resp, temps)
    detached = response_log_probs(model, ids, mask, pos, resp, temps, detach_prompt=True)
    assert torch.allclose(plain.log_probs[rmask], detached.log_probs[rmask], atol=1e-4)


def test_trainer_threads_are_read_from_the_local_section_of_the_ppo_yaml():
    assert PPOSettings().num_threads == 0  # one per CPU, as before
    assert apply_tree(PPOSettings(), {"local": {"num_threads": 1}}).num_threads == 1


def shared_prefix_rows(seed: int, rows: int = 4, p: int = 30, r: int = 5, shared_len: int = 12, extra: int = 0):
    """Left-padded rows that start with the same `shared_len` tokens (an agent's system prompt); with `extra`, the
    first `extra` tokens after it are the same too (micro-batches whose own shared prefix is longer)."""
    torch.manual_seed(seed)
    shared = torch.arange(3, 3 + shared_len + extra)
    ids = torch.randint(3, 300, (rows, p + r))
    mask = torch.ones(rows, p + r, dtype=torch.long)
    for row, pad in enumerate((0, 4, 9, 2)[:rows]):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
        ids[row, pad : pad + shared_len + (extra if row else 0)] = shared[: shared_len + (extra if row else 0)]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos, ids[:, p:], mask[:, p:].bool()


def test_a_kept_shared_prefix_gives_each_micro_batch_the_same_log_probs_and_gradient(model):
    """`SharedPrefix` (issue 38): the prefix computed by the first micro-batch is reused, cut to what each later one
    shares with it; log-probs and the LoRA's gradient are those of computing it per micro-batch."""
    from openjiuwen.agent_evolving.agent_rl.online.training.ppo_math import SharedPrefix

    micro_batches = [shared_prefix_rows(3, shared_len=17), shared_prefix_rows(4), shared_prefix_rows(5, extra=5)]
    kept = SharedPrefix()
    for ids, mask, pos, resp, rmask in micro_batches:
        grads, logps = [], []
        for prefix in (None, kept):
            model.zero_grad(set_to_none=True)
            out = response_log_probs(model, ids, mask, pos, resp, torch.ones(4), detach_prompt=True, prefix=prefix)
            out.log_probs[rmask].sum().backward()
            logps.append(out.log_probs.detach())
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
        assert torch.allclose(logps[0][rmask], logps[1][rmask], atol=1e-5)
        assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    # The first micro-batch's 17 shared tokens stay kept: the later ones (12 shared) took a cut copy of them.
    assert kept.agreeing(torch.arange(3, 20)) == 17
