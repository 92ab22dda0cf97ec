"""The noise of seeded draws: a Gumbel noise per (seed, output position, token id), a pure
function of the three (sampler.py, "the seed contract").

A position's key is `token_key(seed, n)`, a 63-bit hash of (seed, n) computed once per row on
the host. A token's noise is a 32-bit hash of (key, token id): the token id's own hash (a table
computed once per vocabulary) xor the key's low 32 bits, mixed by lowbias32, turned into a
uniform in (0, 1) and then into Gumbel noise -log(-log(u)). The hash is vectorized torch integer arithmetic on
int64 tensors: every product is of a value below 2^32 and a constant of magnitude below 2^31,
so it stays inside int64 (nothing relies on how a device wraps an overflow), and results are
masked to 32 bits. The same key and token id therefore give the same hash on any device, in
any batch and in any layout of the row, without a torch.Generator (and the same noise up to
the last bit of a float32 log; the sampler draws on the host).

The uniform keeps 23 of the hash's bits, so u = (v + 0.5) / 2^23 lies in [2^-24, 1 - 2^-24]
and is exact in float32: the noise is finite (in [-2.8, 16.7]), so a kept token always beats a
dropped one (-inf). The truncated tails change a draw's probability by less than the chance
of a token 17 nats below the best, far below what any test can see.
"""

from __future__ import annotations

import functools
import hashlib
import struct

import torch

_MASK32 = 0xFFFFFFFF
# lowbias32 (C. Wellons' hash prospector): x ^= x >> 16; x *= M1; x ^= x >> 15; x *= M2;
# x ^= x >> 16. M2 is taken as M2 - 2^32 (the same product modulo 2^32) to keep |M2| < 2^31.
_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)
# Spreads token ids before the key is added (the golden-ratio constant, below 2^31).
_SPREAD = 0x61C88647
_UNIFORM_BITS = 23


def token_key(seed: int, n: int) -> int:
    """The key of a seeded request's n-th token (the same in every process)."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed & (2**64 - 1), n), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def gumbel_noise(keys: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """[M] int64 keys -> [M, K] float32 Gumbel noise of the tokens `ids` ([M, K] int64), or of
    the whole vocabulary in id order (ids None, K = vocab), on the device of `keys`."""
    return _noise_of_uniform_bits(uniform_bits(keys, ids, vocab))


def uniform_bits(keys: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """gumbel_noise's [M, K] int64 hashes' top 23 bits: the uniform each noise is made of."""
    table = token_hashes(vocab, keys.device)
    hashes = table[None, :] if ids is None else table[ids]
    # In place where possible: at 32 rows of a 128k vocabulary each pass is ~30 MB.
    x = hashes ^ (keys[:, None] & _MASK32)
    x ^= x >> 16
    x.mul_(_M1).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_M2).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x >> (32 - _UNIFORM_BITS)


def _noise_of_uniform_bits(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^23) -> the float32 Gumbel noise of the uniform (v + 0.5) / 2^23."""
    u = v.float().mul_(2.0**-_UNIFORM_BITS).add_(2.0 ** -(_UNIFORM_BITS + 1))
    return u.log_().neg_().log_().neg_()


@functools.cache
def noise_table() -> torch.Tensor:
    """[2^23] float32 (32 MiB, on the host): the noise of each of the uniform's values, computed
    by the same torch ops as gumbel_noise, so a lookup of a hash's top 23 bits is its noise
    bit for bit (the fused draw, seeded_draw.py)."""
    return _noise_of_uniform_bits(torch.arange(1 << _UNIFORM_BITS, dtype=torch.int64))


_TABLES: dict[tuple[int, str], torch.Tensor] = {}


def token_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] int64: each token id's own 32-bit hash (computed once per vocabulary and device),
    which the row's key is mixed into."""
    table = _TABLES.get((vocab, str(device)))
    if table is None:
        ids = torch.arange(vocab, dtype=torch.int64, device=device)
        table = _TABLES[(vocab, str(device))] = _lowbias32((ids * _SPREAD) & _MASK32)
    return table


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)
