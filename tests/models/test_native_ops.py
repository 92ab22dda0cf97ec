"""The fused CPU ops (pdserve/models/native_ops.py): each equals the torch formula it replaces
(float32 to rounding, bfloat16 and float16 within one rounding step of the dtype, most of it
bit for bit), a whole model through them equals the plain-torch model, bad input is refused,
and they stay off where they do not apply (autograd, other dtypes, the environment switch)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.models import native_attention, native_ops
from pdserve.models.attention import AttentionContext, store_kv
from pdserve.models.llama import LlamaConfig, LlamaForCausalLM, apply_rope
from pdserve.models.rope import rope_tables

pytestmark = pytest.mark.skipif(
    os.environ.get(native_attention.DISABLE_ENV) == "0", reason="switched off for this run"
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def _built():
    """CI has g++ and ninja: a failed build must fail here, not fall back unnoticed (and the ops
    are called directly, after the library is loaded)."""
    assert native_attention.enabled()


def _close(actual: torch.Tensor, expected: torch.Tensor, steps: int = 1) -> None:
    """float32: within rounding; 16-bit dtypes: within `steps` rounding steps of the dtype (the
    float32 math inside may round differently, e.g. exp), and equal shape and dtype."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        step = torch.finfo(actual.dtype).eps  # one step relative to the magnitude
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-3, rtol=steps * step)


def _data(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(32, 512), (1, 64), (3, 5, 100), (7, 1000)])
def test_rms_norm_equals_the_torch_formula(dtype, shape):
    x = _data(*shape, dtype=dtype, scale=3.0)
    weight = (torch.rand(shape[-1], generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    expected = weight * F.rms_norm(x.float(), (shape[-1],), eps=1e-5).to(dtype)
    _close(native_ops.rms_norm(x, weight, 1e-5), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(32, 512), (1, 64), (3, 5, 100)])
def test_add_rms_norm_equals_the_add_then_the_norm(dtype, shape):
    x, delta = _data(*shape, dtype=dtype), _data(*shape, dtype=dtype, seed=2)
    weight = (torch.rand(shape[-1], generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    total, normed = native_ops.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)  # one op of the dtype either way: bit for bit
    expected = weight * F.rms_norm((x + delta).float(), (shape[-1],), eps=1e-6).to(dtype)
    _close(normed, expected)
    # Non-contiguous inputs are read as their values.
    t_weight = weight[: shape[-2]]
    t_total, t_normed = native_ops.add_rms_norm(x.mT, delta.mT, t_weight, 1e-6)
    assert torch.equal(t_total, x.mT + delta.mT)
    t_sum = (x.mT + delta.mT).float()
    _close(t_normed, t_weight * F.rms_norm(t_sum, (shape[-2],), eps=1e-6).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(32, 2 * 1408), (1, 2), (5, 2 * 99), (2, 3, 2 * 40)])
def test_silu_and_mul_equals_silu_of_gate_times_up(dtype, shape):
    gate_up = _data(*shape, dtype=dtype, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    # silu is rounded to the dtype before the product, as F.silu's output is: a step there
    # (exp's float32 rounding differs from torch's) may become two of the product.
    _close(native_ops.silu_and_mul(gate_up), F.silu(gate) * up, steps=2)


def _rope_tables(dim, positions=256):
    cos, sin = rope_tables(dim, positions, {"rope_type": "default", "rope_theta": 10000.0})
    half = dim // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"), [(32, 8, 4, 64), (1, 4, 1, 32), (7, 12, 12, 128)]
)
def test_rope_store_kv_equals_apply_rope_and_the_store(dtype, tokens, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(tokens)
    qkv = _data(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=tokens)
    cos, sin = _rope_tables(dim)
    positions = torch.randint(0, cos.shape[0], (tokens,), generator=gen)
    cache = _data(2, 10, 4, kv_heads, dim, dtype=dtype, seed=3)
    slots = torch.randperm(40, generator=gen)[:tokens]
    expected_cache = cache.clone()

    qk, v = qkv.split(((heads + kv_heads) * dim, kv_heads * dim), dim=-1)
    rope = (cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1))
    q, k = apply_rope(qk.view(tokens, -1, dim), *rope).split((heads, kv_heads), dim=1)
    store_kv(k, v.view(tokens, kv_heads, dim), expected_cache, slots)

    out = native_ops.rope_store_kv(qkv, positions, cos, sin, cache, slots, heads)
    _close(out, q.contiguous())
    _close(cache, expected_cache)  # the written slots, and nothing else touched
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    flat, expected_flat = cache.view(2, 40, -1), expected_cache.view(2, 40, -1)
    assert torch.equal(flat[:, untouched], expected_flat[:, untouched])


def _model(dtype, hidden_act="silu"):
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=64, hidden_act=hidden_act,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval(), config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden_act", ["silu", "gelu"])
def test_a_model_through_the_fused_ops_equals_plain_torch(dtype, hidden_act, monkeypatch):
    """A prefill of two sequences then a decode step, fused and plain, on the same cache:
    the same hidden states (and early exits), logits and cache."""
    model, config = _model(dtype, hidden_act)
    model.reset_rope()  # float32 tables, as the loader leaves them
    block_size, blocks = 4, 8
    cache = torch.zeros(config.num_layers, 2, blocks, block_size, 2, 16, dtype=dtype)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    # Prefill: 6 and 3 tokens packed; each sequence's queries see their own causal prefix.
    lens = [6, 3]
    ids = torch.randint(0, config.vocab_size, (sum(lens),), generator=torch.Generator())
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2])
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 16, 17, 18])
    mask = torch.zeros(2, 1, 6, 16, dtype=torch.bool)
    for b, n in enumerate(lens):
        mask[b, 0, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    query_index = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 8, 8, 8]])
    unpad = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])
    prefill = AttentionContext(slots, tables, mask, query_index, unpad)
    decode = AttentionContext(
        torch.tensor([6, 19]), tables, None, None, None, context_lens=torch.tensor([7, 4])
    )
    steps = [
        (ids, positions, prefill),
        (torch.tensor([5, 9]), torch.tensor([6, 3]), decode),
    ]

    calls = []
    rope_store_kv = native_ops.rope_store_kv
    monkeypatch.setattr(
        native_ops, "rope_store_kv", lambda *args: calls.append(1) or rope_store_kv(*args)
    )

    def run(fused: bool):
        monkeypatch.setattr(native_ops, "applies", lambda x: fused and x.device.type == "cpu")
        kv = cache.clone()
        outs = []
        with torch.inference_mode():
            for step_ids, step_positions, ctx in steps:
                rows = torch.tensor([0, step_ids.shape[0] - 1])
                hidden, early = model.forward_with_exits(
                    step_ids, step_positions, kv, ctx, rows, [0, 2]
                )
                outs += [hidden, early, model.compute_logits(hidden)]
        return outs, kv

    (plain, plain_kv), (fused, fused_kv) = run(False), run(True)
    assert len(calls) == 2 * config.num_layers  # the fused run took the fused ops
    for a, b in zip(fused, plain, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        else:  # rounding steps of bfloat16 compound over the layers
            torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.05)
    torch.testing.assert_close(fused_kv.float(), plain_kv.float(), atol=1e-5, rtol=0.02)


def test_bad_input_is_an_error_not_a_stray_write():
    x, w = torch.randn(2, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match="last dimension of x"):
        native_ops.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        native_ops.rms_norm(x, w.bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="shapes differ"):
        native_ops.add_rms_norm(x, torch.randn(3, 8), w, 1e-6)
    with pytest.raises(RuntimeError, match="must be even"):
        native_ops.silu_and_mul(torch.randn(2, 7))

    heads, kv_heads, dim = 2, 1, 8
    cos, sin = _rope_tables(dim, positions=16)
    cache = torch.zeros(2, 2, 4, kv_heads, dim)
    qkv, positions, slots = torch.randn(1, 4 * dim), torch.tensor([3]), torch.tensor([5])
    native_ops.rope_store_kv(qkv, positions, cos, sin, cache, slots, heads)
    bad = [
        (qkv, torch.tensor([16]), cos, sin, cache, slots, heads, "outside the RoPE tables"),
        (qkv, torch.tensor([-1]), cos, sin, cache, slots, heads, "outside the RoPE tables"),
        (qkv, positions, cos, sin, cache, torch.tensor([8]), heads, "outside the cache"),
        (qkv, positions, cos, sin, cache, slots.int(), heads, "int64"),
        (qkv, positions, cos, sin, cache, slots, 3, r"\(heads \+ 2 \* kv_heads\)"),
        (qkv, positions, cos.bfloat16(), sin, cache, slots, heads, "float32"),
        (qkv.bfloat16(), positions, cos, sin, cache, slots, heads, "dtypes differ"),
        (qkv, positions, cos, sin, cache[0], slots, heads, "layer_cache must be"),
    ]
    for *args, message in bad:
        before = cache.clone()
        with pytest.raises(RuntimeError, match=message):
            native_ops.rope_store_kv(*args)
        assert torch.equal(cache, before)


def test_they_apply_only_to_eager_cpu_inference():
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert native_ops.applies(x) and native_ops.applies(x.bfloat16())
        assert not native_ops.applies(x.double())
    with torch.inference_mode():
        assert native_ops.applies(x)
    assert not native_ops.applies(x)  # autograd on: the custom ops have no backward
    # A model under autograd takes the torch formulas, and gradients flow.
    model, config = _model(torch.float32)
    hidden = model(
        torch.tensor([1, 2]),
        torch.tensor([0, 1]),
        torch.zeros(config.num_layers, 2, 2, 4, 2, 16),
        AttentionContext(
            torch.tensor([0, 1]),
            torch.tensor([[0, 1]]),
            torch.ones(1, 1, 2, 8, dtype=torch.bool).tril(),
            torch.tensor([[0, 1]]),
            None,
        ),
    )
    hidden.sum().backward()
    assert model.layers[0].input_layernorm.weight.grad is not None


def test_switched_off_by_the_environment():
    code = (
        "import torch\nfrom pdserve.models import native_ops as n\n"
        "with torch.no_grad():\n    print(n.applies(torch.zeros(1, 4)))"
    )
    env = {**os.environ, native_attention.DISABLE_ENV: "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"
