"""transformers as the reference: greedy continuations of prompts, one prompt at a time (no
padding, so nothing but the model itself decides the tokens)."""

from __future__ import annotations

import torch


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' `generate` greedy output, EOS disabled (the engine runs with ignore_eos)."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,  # also stops transformers from suppressing EOS
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
