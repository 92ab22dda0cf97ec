"""The fused seeded draw (seeded_draw.py, csrc/seeded_draw.cpp) draws the torch path's tokens:
its noise table holds the torch noise of every uniform bit for bit (also where torch's log
takes its scalar tail, and the C library's logf would not: it differs on some of them), and
over many keys, rows, vocabulary sizes, scales, filters and both layouts the two draws pick
the same tokens. The sampler draws seeded rows through it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding import sampler, seeded_draw
from pdserve.engine.decoding.sampler import kept_tokens
from pdserve.engine.decoding.seeded_noise import gumbel_noise, noise_table, uniform_bits
from pdserve.models import native_attention

pytestmark = pytest.mark.skipif(
    os.environ.get(native_attention.DISABLE_ENV) == "0", reason="switched off for this run"
)


@pytest.fixture(autouse=True)
def _built():
    """CI has g++ and ninja: a failed build must fail here, not fall back to the torch path
    unnoticed."""
    assert native_attention.enabled()


def random_keys(count: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2**63 - 1, (count,), generator=generator, dtype=torch.int64)


@pytest.mark.parametrize("columns", [1, 17, 31, 1000, 4099])
def test_the_table_holds_the_torch_noise_at_every_position_of_a_row(columns):
    """Tails shorter than a vector go through torch's scalar log: the table (computed in one
    long vectorized pass) must still hold their noise bit for bit."""
    generator = torch.Generator().manual_seed(columns)
    vocab = 50_000
    keys = random_keys(5, generator)
    ids = torch.randint(0, vocab, (5, columns), generator=generator)
    noise = gumbel_noise(keys, ids, vocab)
    assert torch.equal(noise, noise_table()[uniform_bits(keys, ids, vocab)])


def test_the_table_is_every_uniforms_noise_and_bounded():
    table = noise_table()
    assert table.shape == (1 << 23,) and table.dtype == torch.float32
    assert torch.isfinite(table).all()
    assert -2.9 < table.min().item() < -2.7 and 16.5 < table.max().item() < 16.8
    # Increasing in the uniform: the lookup index is the uniform's rank.
    assert (table[1:] >= table[:-1]).all()


def draw_both(scaled, probs, ids, keys):
    fused = seeded_draw.gumbel_max_fused(scaled, probs, ids, keys)
    torch_path = seeded_draw.gumbel_max_torch(scaled, probs, ids, keys)
    return fused, torch_path


@pytest.mark.parametrize("vocab", [2, 7, 1000, 32_000, 131_072])
@pytest.mark.parametrize(
    "scale, offset", [(0.1, 0.0), (1.0, 0.0), (5.0, 0.0), (30.0, 0.0), (1.0, 3e5)]
)
def test_the_fused_draw_is_the_torch_draw_over_the_whole_vocabulary(vocab, scale, offset):
    """Flat rows (every token looked up) to peaked ones (most out of reach), and logits so large
    that scores round to a coarse grid (ties; the skip must still be exact), with some tokens
    dropped (probability 0), many keys each."""
    generator = torch.Generator().manual_seed(vocab + int(scale * 10))
    rows = 64 if vocab < 100_000 else 8
    for _ in range(3):
        scaled = torch.randn(rows, vocab, generator=generator) * scale + offset
        probs = torch.softmax(scaled, dim=-1)
        probs[torch.rand(rows, vocab, generator=generator) < 0.2] = 0.0
        probs[:, 0] = 1e-3  # a row keeps at least one token
        ids = torch.arange(vocab).expand(rows, vocab)
        fused, torch_path = draw_both(scaled, probs, ids, random_keys(rows, generator))
        assert torch.equal(fused, torch_path)


@pytest.mark.parametrize("vocab", [2000, 5000, 131_072])
def test_the_fused_draw_is_the_torch_draw_over_the_kept_tokens(vocab):
    """The [M, K] layout kept_tokens gives for top-k, top-p and min-p rows (a batch mixing them,
    so some rows have dropped tokens among their K columns)."""
    generator = torch.Generator().manual_seed(vocab)
    params = [
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=1.0, top_k=200, top_p=0.9),
        SamplingParams(temperature=1.3, min_p=0.05),
        SamplingParams(temperature=0.5, top_k=5, top_p=0.8),
    ] * 4
    for _ in range(5):
        logits = torch.randn(len(params), vocab, generator=generator) * 4
        probs, ids = kept_tokens(logits, params)
        assert ids.shape[-1] < vocab  # the kept layout, not the whole vocabulary
        scaled = sampler._with_temperature(logits, params)
        fused, torch_path = draw_both(scaled, probs, ids, random_keys(len(params), generator))
        assert torch.equal(fused, torch_path)


def test_ties_go_to_the_lowest_id_as_torch_argmax():
    """Equal scores (the same logit and the same noise: one key, one token, repeated in the kept
    layout) are resolved as torch.argmax resolves them."""
    keys = torch.tensor([12345], dtype=torch.int64)
    scaled = torch.zeros(1, 10)
    ids = torch.tensor([[3, 3, 3]])
    probs = torch.ones(1, 3)
    fused, torch_path = draw_both(scaled, probs, ids, keys)
    assert fused.tolist() == torch_path.tolist() == [3]


def test_the_sampler_draws_seeded_rows_through_the_fused_kernel():
    """A served batch (every row seeded) gives the tokens of the torch path."""
    generator = torch.Generator().manual_seed(1)
    params = [SamplingParams(temperature=0.9, seed=seed) for seed in range(6)]
    logits = torch.randn(len(params), 3000, generator=generator) * 3
    sources = [sampler.noise_key(p, 4) for p in params]
    assert seeded_draw.fused_applies(logits, logits)
    tokens = sampler.draw(logits, params, sources)
    probs, ids = kept_tokens(logits, params)
    keys = torch.tensor(sources, dtype=torch.int64)
    expected = seeded_draw.gumbel_max_torch(
        sampler._with_temperature(logits, params), probs, ids, keys
    )
    assert torch.equal(tokens, expected)


def test_bad_input_is_refused():
    keys = torch.tensor([1], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="scaled"):
        seeded_draw.gumbel_max_fused(
            torch.zeros(1, 8, dtype=torch.float64), torch.ones(1, 8), torch.arange(8)[None], keys
        )


def test_every_uniform_has_the_tables_noise_whichever_loop_torch_takes():
    """Exhaustively: the two logs of all 2^23 uniforms taken on a strided view (torch's
    element-by-element loop, as for a row's tail, not its vectorized one) give the table's
    noise bit for bit."""
    uniforms = torch.arange(1 << 23, dtype=torch.float32).mul_(2.0**-23).add_(2.0**-24)
    buffer = torch.zeros(1 << 23, 2)
    strided = buffer[:, 0]  # every other float of the buffer
    assert not strided.is_contiguous()
    strided.copy_(uniforms)
    strided.log_().neg_().log_().neg_()
    assert torch.equal(strided, noise_table())


def test_switched_off_the_sampler_draws_in_torch():
    """PDSERVE_NATIVE_ATTENTION=0: no fused draw, and seeded rows are still drawn."""
    code = (
        "import torch\n"
        "from pdserve.core.sampling_params import SamplingParams\n"
        "from pdserve.engine.decoding import sampler, seeded_draw\n"
        "logits = torch.randn(2, 500)\n"
        "params = [SamplingParams(seed=3), SamplingParams(seed=4)]\n"
        "tokens = sampler.draw(logits, params, [sampler.noise_key(p, 0) for p in params])\n"
        "print(seeded_draw.fused_applies(logits, logits), tokens.shape[0])\n"
    )
    env = {**os.environ, native_attention.DISABLE_ENV: "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False 2"
