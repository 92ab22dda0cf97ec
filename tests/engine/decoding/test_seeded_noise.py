"""The noise of seeded draws (seeded_noise.py): a pure function of (key, token id), computed
by int64 arithmetic that never overflows (equal to the same hash in Python's unbounded
integers), Gumbel distributed, independent between keys, and the same on CUDA as on the CPU
(up to the last bit of a float32 log)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import kstest, pearsonr

from pdserve.engine.decoding.seeded_noise import gumbel_noise, token_key

VOCAB = 5000


def reference_noise(key: int, token: int) -> float:
    """The hash written with Python integers, masked to 32 bits after every step."""

    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    x = lowbias32((token * 0x61C88647) & 0xFFFFFFFF)
    x = lowbias32(x ^ (key & 0xFFFFFFFF))
    u = ((x >> 9) + 0.5) / 2**23
    return -math.log(-math.log(u))


def keys(count: int, n: int = 0) -> torch.Tensor:
    return torch.tensor([token_key(seed, n) for seed in range(count)], dtype=torch.int64)


def test_the_noise_is_the_hash_without_overflow():
    k = keys(4, n=7)
    tokens = torch.tensor([0, 1, 2, 4095, 4999])
    noise = gumbel_noise(k, tokens.expand(4, -1), VOCAB)
    for r, key in enumerate(k.tolist()):
        want = [reference_noise(key, t) for t in tokens.tolist()]
        assert noise[r].tolist() == pytest.approx(want, abs=1e-5)


def test_a_tokens_noise_does_not_depend_on_the_layout():
    k = keys(3)
    whole = gumbel_noise(k, None, VOCAB)
    ids = torch.stack(
        [torch.randperm(VOCAB, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    )
    assert torch.equal(gumbel_noise(k, ids[:, :100], VOCAB), whole.gather(1, ids[:, :100]))
    assert torch.equal(gumbel_noise(k[[2, 0]], None, VOCAB), whole[[2, 0]])


def test_the_noise_is_gumbel_and_independent_between_keys():
    noise = gumbel_noise(keys(40), None, VOCAB).double()
    assert kstest(noise.flatten().numpy(), "gumbel_r").pvalue > 1e-3
    # Neighbouring seeds (choices i and i + 1 of one request) and positions are unrelated.
    for a, b in ((noise[0], noise[1]), (noise[5], gumbel_noise(keys(6, n=1), None, VOCAB)[5])):
        assert abs(pearsonr(a.numpy(), b.double().numpy()).statistic) < 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_noise_is_the_same_on_cuda():
    """The hash is exact on both; the float32 logs may differ in their last bit."""
    k = keys(8, n=3)
    ids = torch.randint(0, VOCAB, (8, 64))
    for on_cuda, on_cpu in (
        (gumbel_noise(k.cuda(), None, VOCAB), gumbel_noise(k, None, VOCAB)),
        (gumbel_noise(k.cuda(), ids.cuda(), VOCAB), gumbel_noise(k, ids, VOCAB)),
    ):
        torch.testing.assert_close(on_cuda.cpu(), on_cpu, rtol=1e-6, atol=1e-6)
