"""The tokens a JSON-schema grammar allows at each step of a response, computed by xgrammar as vLLM 0.32 compiles
the grammar (`vllm/v1/structured_output/backend_xgrammar.py`: `TokenizerInfo.from_huggingface` with the model's
vocabulary size, `compile_json_schema(schema, any_whitespace=True)`).

Runs in the vLLM environment (`.venv-vllm` ships xgrammar with vLLM's CPU build; the project's own environment does
not), as a script: reads {"model_dir", "schema", "responses": [[token id, ...], ...]} as JSON on stdin and writes
{"allowed": [[[allowed ids at step 0], [at step 1], ...], ...], "accepted": [bool, ...]} on stdout, where `accepted`
says whether the grammar accepted every token of that response (a token it refuses ends that response's steps).
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import torch
    import xgrammar as xgr
    from transformers import AutoConfig, AutoTokenizer

    job = json.load(sys.stdin)
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    vocab_size = AutoConfig.from_pretrained(job["model_dir"]).vocab_size
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(job["schema"]), any_whitespace=True)
    allowed_all, accepted_all = [], []
    for response in job["responses"]:
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        allowed, accepted = [], True
        for token in response:
            matcher.fill_next_token_bitmask(bitmask)
            logits = torch.zeros(1, vocab_size)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            allowed.append(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())
            if not matcher.accept_token(token):
                accepted = False
                break
        allowed_all.append(allowed)
        accepted_all.append(accepted)
    json.dump({"allowed": allowed_all, "accepted": accepted_all}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
