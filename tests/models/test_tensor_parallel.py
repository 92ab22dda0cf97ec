"""Tensor parallelism against transformers: the engine run as every rank of a TP group (one
process per rank, Gloo) samples the tokens transformers generates, with rank 0's logits within
1e-4 (float32) at every step, at TP 1, 2 and 4; on Llama (GQA, biases), Mistral (MQA: KV heads
replicated), Qwen2 (tied embeddings) and Qwen3 (q/k norms, head_dim 24). Each rank holds 1/N
of the layers' weights; a degree the model cannot split is refused naming the numbers."""

from __future__ import annotations

import pytest
import torch

from pdserve.core import model_limits
from pdserve.engine.model_runner import TorchExecutor
from pdserve.engine_config import EngineConfig
from pdserve.models.loader import load_model
from pdserve.models.tensor_parallel import TensorParallel
from tests.models.hf_reference import hf_greedy
from tests.models.test_llama_matches_transformers import make_hf_model
from tests.models.tp_ranks import serve, serve_on_ranks

pytest.importorskip("transformers")

# vocab 301: the last rank's vocabulary shard is padded at TP 2 and 4.
MODELS = {
    "llama-gqa-bias": ("llama-attention-bias", dict(mlp_bias=True, vocab_size=301)),
    "mistral-mqa": ("mistral", dict(num_key_value_heads=1)),
    "qwen2-tied": ("qwen2", {}),
    "qwen3-head-dim-24": ("qwen3", dict(head_dim=24, attention_bias=True, vocab_size=301)),
}
_gen = torch.Generator().manual_seed(5)
LOGITS_PROMPT = torch.randint(3, 300, (21,), generator=_gen).tolist()
BATCH = [torch.randint(3, 300, (n,), generator=_gen).tolist() for n in (2, 9, 26)]
LOGIT_STEPS, BATCH_TOKENS = 6, 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model directory, transformers model)."""
    built = {}
    for name, (family, overrides) in MODELS.items():
        directory = tmp_path_factory.mktemp(name)
        built[name] = (str(directory), make_hf_model(directory, family, **overrides))
    return built


def jobs(models) -> list[tuple]:
    """Per model: one prompt whose logits are checked, then a batch whose tokens are."""
    out = []
    for directory, _ in models.values():
        out += [(directory, [LOGITS_PROMPT], LOGIT_STEPS), (directory, BATCH, BATCH_TOKENS)]
    return out


def check_against_transformers(hf, logits_run, batch_run) -> None:
    (outputs,), seen = logits_run
    assert len(seen) == LOGIT_STEPS
    with torch.inference_mode():
        reference = hf(torch.tensor([LOGITS_PROMPT + outputs])).logits[0]
    for step, logits in enumerate(seen):
        expected = reference[len(LOGITS_PROMPT) - 1 + step]
        torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)
    assert batch_run[0] == hf_greedy(hf, BATCH, BATCH_TOKENS)


def test_tp1_matches_transformers(models):
    for directory, hf in models.values():
        logits_run = serve(directory, [LOGITS_PROMPT], LOGIT_STEPS, None)
        check_against_transformers(hf, logits_run, serve(directory, BATCH, BATCH_TOKENS, None))


@pytest.mark.parametrize("size", [2, 4])
def test_tp_ranks_match_transformers(models, size, tmp_path):
    by_rank = serve_on_ranks(size, jobs(models), tmp_path)
    for i, (name, (_, hf)) in enumerate(models.items()):
        logits_run, batch_run = by_rank[0][2 * i], by_rank[0][2 * i + 1]
        try:
            check_against_transformers(hf, logits_run, batch_run)
        except AssertionError as e:
            raise AssertionError(f"{name} at TP {size}: {e}") from e
        for rank in range(1, size):  # every rank sampled what rank 0 did
            assert by_rank[rank][2 * i][0] == logits_run[0]
            assert by_rank[rank][2 * i + 1][0] == batch_run[0]


def _layer_numel(model) -> dict[str, int]:
    """Elements of each kind of layer weight (norms apart), summed over the layers."""
    totals: dict[str, int] = {}
    for name, p in model.named_parameters():
        if name.startswith("layers.") and "norm" not in name:
            kind = name.split(".", 2)[2]
            totals[kind] = totals.get(kind, 0) + p.numel()
    return totals


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_its_share_of_the_weights(models, size):
    """GQA with as many KV heads as ranks or more: 1/N of every layer weight, and 1/N of the
    vocabulary rows (rounded up). MQA: 1/N of the query and MLP weights, the one KV head
    replicated. Row-parallel biases on rank 0 only."""
    directory = models["llama-gqa-bias"][0]
    whole = _layer_numel(load_model(directory)[0])
    kv_heads = 2
    for rank in range(size):
        model = load_model(directory, tp=TensorParallel(rank, size))[0]
        held = _layer_numel(model)
        for kind, numel in whole.items():
            if kind.endswith(("o_proj.bias", "down_proj.bias")):
                assert held.get(kind, 0) == (numel if rank == 0 else 0), kind
            elif kind.startswith("self_attn.qkv_proj") and size > kv_heads:
                # q (4 heads: half the rows): 1/N; k and v: one of the 2 KV heads per rank
                q = kv = numel // 2
                assert held[kind] == q // size + kv // kv_heads, kind
            else:
                assert held[kind] * size == numel, kind
        assert model.embed_tokens.weight.shape[0] == -(-301 // size)
        assert model.kv_heads == max(kv_heads // size, 1)


def test_mqa_ranks_each_hold_the_one_kv_head(models):
    directory = models["mistral-mqa"][0]
    full = load_model(directory)[0].layers[0].self_attn.qkv_proj.weight
    q_rows = 4 * 16
    for rank in range(4):
        attn = load_model(directory, tp=TensorParallel(rank, 4))[0].layers[0].self_attn
        assert attn.num_heads == 1 and attn.num_kv_heads == 1
        local = attn.qkv_proj.weight
        torch.testing.assert_close(local[:16], full[rank * 16 : (rank + 1) * 16])
        torch.testing.assert_close(local[16:], full[q_rows:], rtol=0, atol=0)


def test_kv_pool_is_sized_per_rank(models):
    """The same --kv-cache-mb holds N times the blocks when a rank holds 1/N of the heads."""
    directory = models["llama-gqa-bias"][0]
    hf_config = load_model(directory)[1]
    one = model_limits.kv_pool_blocks(hf_config, EngineConfig(kv_cache_bytes=1 << 20))
    two = model_limits.kv_pool_blocks(hf_config, EngineConfig(kv_cache_bytes=1 << 20, tp=2))
    assert two == 2 * one


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "message"),
    [
        (4, 2, 3, "tensor parallel degree 3 does not divide num_attention_heads 4"),
        (24, 6, 4, "tensor parallel degree 4 and num_key_value_heads 6: neither divides"),
    ],
)
def test_a_degree_the_heads_cannot_split_is_refused_naming_the_numbers(
    heads, kv_heads, tp, message
):
    hf_config = dict(num_attention_heads=heads, num_key_value_heads=kv_heads)
    hf_config["intermediate_size"] = 96
    with pytest.raises(ValueError, match=message):
        model_limits.check_tensor_parallel(hf_config, tp)


def test_loading_a_shard_the_model_cannot_split_is_refused(models):
    with pytest.raises(ValueError, match="degree 3 does not divide num_attention_heads 4"):
        load_model(models["qwen2-tied"][0], tp=TensorParallel(0, 3))


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this node has 2 CUDA devices")
def test_more_ranks_than_devices_is_refused(models):
    config = EngineConfig(model=models["qwen2-tied"][0], device="cuda", tp=2)
    with pytest.raises(ValueError, match="tp 2 needs 2 CUDA devices, this node has"):
        TorchExecutor(config, models["qwen2-tied"][0], TensorParallel(0, 2))
