"""A seeded row's token: the Gumbel-max draw over its kept tokens (sampler.py, "the seed
contract"), in torch or in one fused pass per row (csrc/seeded_draw.cpp).

The torch path hashes the noise of every kept token into an [M, K] tensor (about ten int64
passes and two logs over it): at a 128k vocabulary without top-k that is the whole row, several
times the cost of an unseeded row's draw. The fused kernel hashes each token once, looks its
noise up in `seeded_noise.noise_table()` (the torch path's own noise of each of the 2^23
uniforms, so the noise is the same float32 bit for bit: the C library's logf differs on 15% of
them) and keeps the running argmax; a token that cannot win (its logit plus the largest noise
of its bucket of uniforms, `bucket_maxima`, below the best score) is not looked up. The tokens
are those of the torch path (tests/engine/decoding/test_seeded_draw.py). It runs where the host
draws (CPU float32) once the pdserve_native library is built; elsewhere, or with
PDSERVE_NATIVE_ATTENTION=0, the torch path runs.
"""

from __future__ import annotations

import functools

import torch

from pdserve.engine.decoding.seeded_noise import gumbel_noise, noise_table, token_hashes
from pdserve.models import native_attention


def gumbel_max(
    scaled: torch.Tensor,  # [M, vocab] logits / temperature
    probs: torch.Tensor,  # [M, K] kept_tokens' probabilities (0: dropped)
    ids: torch.Tensor,  # [M, K] their token ids (the vocabulary in id order when K == vocab)
    keys: torch.Tensor,  # [M] int64 noise keys
) -> torch.Tensor:
    """[M] token ids: the kept token with the largest scaled logit + Gumbel noise of (key, id)."""
    if fused_applies(scaled, probs):
        return gumbel_max_fused(scaled, probs, ids, keys)
    return gumbel_max_torch(scaled, probs, ids, keys)


def fused_applies(scaled: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether the fused kernel draws these rows: float32 on the host, the library built."""
    return (
        scaled.device.type == "cpu"
        and scaled.dtype == torch.float32
        and probs.dtype == torch.float32
        and native_attention.enabled()
    )


def gumbel_max_torch(
    scaled: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """gumbel_max with the noise written out. A token's score is its own, so the winner does not
    depend on the layout of the kept tokens; the scores are compared on the scaled logits, not
    on probabilities whose normaliser may round differently per layout."""
    vocab = scaled.shape[-1]
    whole = ids.shape[-1] == vocab
    noise = gumbel_noise(keys, None if whole else ids, vocab)
    score = noise.add_(scaled if whole else scaled.gather(1, ids))
    score = score.masked_fill_(probs <= 0, float("-inf"))
    return ids.gather(1, score.argmax(dim=-1, keepdim=True)).squeeze(1)


def gumbel_max_fused(
    scaled: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor
) -> torch.Tensor:
    """gumbel_max in one pass per row, never writing the noise (`fused_applies` first)."""
    vocab = scaled.shape[-1]
    whole = ids.shape[-1] == vocab
    table = noise_table()
    return torch.ops.pdserve_native.seeded_gumbel_max(
        scaled.contiguous(),
        probs.contiguous(),
        None if whole else ids.contiguous(),
        keys.cpu(),
        token_hashes(vocab, scaled.device),
        table,
        bucket_maxima(),
    )


# Buckets of the uniform's 2^23 values the kernel bounds the noise by (csrc/seeded_draw.cpp).
BUCKET_BITS = 12


@functools.cache
def bucket_maxima() -> torch.Tensor:
    """[2^12] float32: the largest noise of each bucket of 2^11 consecutive uniforms (16 KiB):
    a token whose logit plus its bucket's largest noise is below the best score cannot win,
    and the kernel skips its lookup."""
    return noise_table().view(1 << BUCKET_BITS, -1).amax(dim=1)
