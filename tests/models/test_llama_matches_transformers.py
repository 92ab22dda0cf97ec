"""Our Llama-family model against transformers on the same weights (the definition of correct):
logits within 1e-4 in float32 at prefill and at every decode step, through the engine's own
paged-attention path."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.tokenizer_builder import write_tokenizer
from tests.models.hf_reference import hf_greedy

transformers = pytest.importorskip("transformers")

VOCAB = 300
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
)
FAMILIES = {
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "llama-linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
    ),
    "llama-dynamic": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_scaling=dict(rope_type="dynamic", factor=4.0)),
    ),
    "llama-yarn": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_scaling=dict(
                rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=8
            )
        ),
    ),
    "llama-yarn-mscale": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_scaling=dict(
                rope_type="yarn",
                factor=8.0,
                mscale=1.0,
                mscale_all_dim=0.5,
                original_max_position_embeddings=400,
                beta_fast=4,
                truncate=False,  # the ramp then starts and ends between dimensions 2 and 4
            )
        ),
    ),
    "llama-attention-bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True)),
    "llama-mlp-bias": ("LlamaConfig", "LlamaForCausalLM", dict(mlp_bias=True)),
    # head_dim 32 != hidden_size / heads = 16: q/k/v widen to 128, o_proj narrows back to 64.
    "llama-head-dim": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=32, rms_norm_eps=1e-2)),
    "llama-gelu": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_act="gelu")),
    "llama-gelu-tanh": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_act="gelu_pytorch_tanh")),
    "llama-gelu-new": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_act="gelu_new")),
    "llama-relu": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_act="relu")),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # Per-head q/k norms before RoPE; head_dim must be set (Qwen3's default is 128).
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "qwen3-bias-head-dim": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=24, attention_bias=True, tie_word_embeddings=True),
    ),
    # Mixtures of experts: odd expert counts, top-k 1, 2 and 8, norm_topk_prob both ways, dense
    # layers among sparse ones (mlp_only_layers, decoder_sparse_step), Qwen2-MoE's shared expert.
    "qwen3-moe-top2": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            num_hidden_layers=3,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3-moe-top8-norm": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=9,
            num_experts_per_tok=8,
            moe_intermediate_size=24,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    ),
    "qwen3-moe-top1-norm": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=7, num_experts_per_tok=1, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=5)),
    "qwen2-moe-shared": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=7,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
        ),
    ),
    "qwen2-moe-shared-norm": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            qkv_bias=False,
        ),
    ),
}


def make_hf_model(directory, family: str, **overrides):
    """A random transformers model saved with save_pretrained, plus our tokenizer files.
    `overrides`: config fields replacing the common ones (e.g. num_hidden_layers).

    Weights are re-drawn at unit-preserving scale (transformers' std 0.02 leaves attention
    nearly a no-op, which would hide attention bugs)."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))  # fan-in, also of stacked experts
    model.save_pretrained(directory)
    write_tokenizer(directory, VOCAB)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(directory, request.param)
    engine = LLMEngine(EngineConfig(model=str(directory), block_size=8, num_kv_blocks=64))
    return hf, engine


def record_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """Captures the logits the engine samples from, step by step."""
    seen: list[torch.Tensor] = []
    run = engine.runner.run

    def wrapped(batch):
        logits, idx = run(batch)
        seen.append(logits.clone())
        return logits, idx

    engine.runner.run = wrapped
    return seen


def test_logits_match_at_prefill_and_every_decode_step(family_model):
    hf, engine = family_model
    prompt = torch.randint(3, VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    seen = record_logits(engine)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(seen) == 12

    ids = torch.tensor([prompt + out])
    with torch.inference_mode():
        reference = hf(ids).logits[0]  # [T, vocab]: position t predicts token t + 1
    for step, logits in enumerate(seen):
        expected = reference[len(prompt) - 1 + step]
        torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=0)


def test_prefill_logits_of_every_prompt_position(family_model):
    """Chunked prefill of one token per step exposes every prompt position's logits."""
    hf, engine = family_model
    prompt = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        reference = hf(torch.tensor([prompt])).logits[0]
    for cut in (1, 7, 8, 9, 20):
        seen = record_logits(engine)
        engine.generate([prompt[:cut]], SamplingParams(max_tokens=1))
        torch.testing.assert_close(seen[0][0], reference[cut - 1], atol=1e-4, rtol=0)


def test_greedy_batch_matches_transformers_generate(family_model):
    hf, engine = family_model
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (2, 9, 16, 25)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert outputs == hf_greedy(hf, prompts, 10)


@pytest.mark.parametrize("in_place", [False, True])
def test_decode_in_length_groups_matches_transformers_generate(family_model, in_place):
    """Short and long contexts in one decode batch: gathered, they attend in separate length
    groups; read in place (the CPU kernel, models/native_attention.py), as one batch."""
    hf, engine = family_model
    if in_place and not engine.runner.reads_kv_in_place:
        pytest.skip("the CPU decode kernel is not built here")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 150, 4, 160)]
    shapes: list[tuple[int, bool]] = []  # (groups, read in place) of each decode-only step
    prepare, reads_in_place = engine.runner._prepare, engine.runner.reads_kv_in_place

    def recording(batch):
        prepared = prepare(batch)
        if all(n == 1 for n in batch.num_tokens):
            ctx = prepared[2]
            shapes.append((len(ctx.groups or [ctx]), ctx.context_lens is not None))
        return prepared

    engine.runner._prepare = recording
    engine.runner.reads_kv_in_place = in_place
    try:
        outputs = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    finally:
        engine.runner._prepare, engine.runner.reads_kv_in_place = prepare, reads_in_place
    assert shapes and all(shape == ((1, True) if in_place else (2, False)) for shape in shapes)
    assert outputs == hf_greedy(hf, prompts, 10)
