"""Mixture-of-experts models beyond the logits check (test_llama_matches_transformers.py runs
every MoE family through that): prefix-cache hits, both checkpoint layouts of the experts, and
what the loader refuses."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from pdserve.models.hf_config import ModelLoadError, read_config
from pdserve.models.loader import load_model
from tests.models.hf_reference import hf_greedy
from tests.models.test_llama_matches_transformers import VOCAB, make_hf_model

pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("family", ["qwen3-moe-top2", "mixtral", "qwen2-moe-shared"])
def test_prefix_cache_hits_give_transformers_tokens(tmp_path, family):
    hf = make_hf_model(tmp_path, family)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=4, num_kv_blocks=128))
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(3, VOCAB, (24,), generator=gen).tolist()
    prompts = [system + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 7)]
    expected = hf_greedy(hf, prompts, 8)
    assert engine.generate(prompts[:1], GREEDY) == expected[:1]
    assert engine.generate(prompts, GREEDY) == expected
    assert engine.stats()["prefix_hit_tokens"] >= 2 * 24


def _restack_experts(directory) -> None:
    """Rewrites a per-expert checkpoint in transformers 5's stacked layout
    (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I])."""
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    experts = json.loads((directory / "config.json").read_text())["num_local_experts"]
    sparse = {int(name.split(".")[2]) for name in tensors if ".mlp.experts." in name}
    assert sparse
    for layer in sparse:
        p = f"model.layers.{layer}.mlp.experts."

        def pop(part: str, e: int, p: str = p) -> torch.Tensor:
            return tensors.pop(f"{p}{e}.{part}.weight")

        tensors[p + "gate_up_proj"] = torch.stack(
            [torch.cat((pop("gate_proj", e), pop("up_proj", e))) for e in range(experts)]
        )
        tensors[p + "down_proj"] = torch.stack([pop("down_proj", e) for e in range(experts)])
    save_file(tensors, str(path), {"format": "pt"})


def test_stacked_expert_checkpoint_loads_the_same_model(tmp_path):
    per_expert, stacked = tmp_path / "per-expert", tmp_path / "stacked"
    make_hf_model(per_expert, "qwen3-moe-top8-norm")
    make_hf_model(stacked, "qwen3-moe-top8-norm")
    _restack_experts(stacked)
    a, b = load_model(per_expert)[0].state_dict(), load_model(stacked)[0].state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert a["layers.1.mlp.experts.gate_up_proj"].shape == (9, 64, 48)


def _edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"topk_method": "noaux_tc"}, "topk_method"),
        ({"e_score_correction_bias": True, "n_group": 8}, "e_score_correction_bias, n_group"),
        ({"scoring_func": "sigmoid"}, "scoring_func"),
        ({"num_experts_per_tok": 6}, "num_experts_per_tok 6"),
    ],
)
def test_routing_it_does_not_implement_is_refused_by_name(tmp_path, changes, named):
    make_hf_model(tmp_path, "mixtral")
    _edit_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=named):
        read_config(tmp_path)


def test_a_router_bias_tensor_is_refused_by_name(tmp_path):
    make_hf_model(tmp_path, "qwen3-moe-top2")
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.mlp.gate.e_score_correction_bias"] = torch.zeros(5)
    save_file(tensors, str(path), {"format": "pt"})
    with pytest.raises(ModelLoadError, match="layers.0.mlp.gate.e_score_correction_bias"):
        load_model(tmp_path)


@pytest.mark.parametrize("tokens", [3, 40])
def test_both_expert_paths_equal_a_token_by_token_reference(tokens):
    """The oneDNN path (CPU inference) and the grouped GEMM (elsewhere; here under autograd)
    give each token the weighted sum of its top-k experts; with 3 tokens most of the 7 experts
    go unchosen and are skipped."""
    import torch.nn.functional as F

    from pdserve.models.moe import MoeConfig, SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(32, MoeConfig(7, 2, 24, True), F.silu, None)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(tokens, 32)
    with torch.inference_mode():
        experts, weights = block.route(x)
        packed = block(x)
    expected = torch.zeros_like(x)
    for t in range(tokens):
        for e, w in zip(experts[t].tolist(), weights[t], strict=True):
            gate, up = (x[t] @ block.experts.gate_up_proj[e].detach()).chunk(2)
            expected[t] += w * ((F.silu(gate) * up) @ block.experts.down_proj[e].detach())
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    grouped = block(x).detach()  # parameters requiring grad: not the oneDNN path
    torch.testing.assert_close(grouped, expected, atol=1e-5, rtol=0)


def test_engine_counts_the_tokens_routed_to_each_expert(tmp_path):
    """Each sparse layer routes every computed token to top-k experts: 10 prompt tokens and 3
    decode steps (the 4th token is sampled from the 3rd) give 13 x 2 routings per layer; the
    dense layer 1 (mlp_only_layers) has none."""
    from pdserve.metrics import expert_load

    make_hf_model(tmp_path, "qwen3-moe-top2")
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=4, num_kv_blocks=32))
    assert engine.stats()["expert_tokens"] == [[0] * 5, [0] * 5]
    engine.generate([list(range(5, 15))], SamplingParams(max_tokens=4, ignore_eos=True))
    per_layer = engine.stats()["expert_tokens"]
    assert len(per_layer) == 2 and all(len(layer) == 5 for layer in per_layer)
    assert [sum(layer) for layer in per_layer] == [26, 26]
    per_expert, imbalance = expert_load(per_layer)
    assert sum(per_expert) == 52 and imbalance >= 1.0
    assert imbalance == max(map(max, per_layer)) * 10 / 52
