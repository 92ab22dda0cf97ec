"""Mixture-of-experts layers under tensor parallelism are expert-parallel: each rank of a Gloo
group (spawned processes, tests/models/tp_ranks.py) holds disjoint experts, and the ranks'
summed outputs give transformers' logits and tokens."""

from __future__ import annotations

import pytest

from pdserve.models.loader import load_model
from pdserve.models.tensor_parallel import TensorParallel
from tests.models.test_llama_matches_transformers import make_hf_model
from tests.models.test_tensor_parallel import check_against_transformers, jobs
from tests.models.tp_ranks import serve_on_ranks

pytest.importorskip("transformers")

# 5 and 7 experts: uneven shares (at TP 4, 1-2 experts a rank); a dense layer among sparse ones;
# Qwen2-MoE's shared expert on rank 0 only; Mixtral's naming.
MODELS = {
    "qwen3-moe": ("qwen3-moe-top2", {}),
    "qwen2-moe-shared": ("qwen2-moe-shared", {}),
    "mixtral": ("mixtral", {}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    built = {}
    for name, (family, overrides) in MODELS.items():
        directory = tmp_path_factory.mktemp(name)
        built[name] = (str(directory), make_hf_model(directory, family, **overrides))
    return built


@pytest.mark.parametrize("dispatch", ["all-reduce", "all_to_all"])
@pytest.mark.parametrize("size", [2, 4])
def test_expert_parallel_ranks_match_transformers(models, size, dispatch, tmp_path):
    """Both ways of running the experts over the ranks: every rank on every token and an
    all-reduce (the default), or --expert-parallel's all_to_all dispatch and combine. The
    prompts (21 tokens, then 2, 9 and 26) split unevenly over the ranks; a decode step of the
    one-prompt job has 1 token, which only rank 0 routes (the other ranks send nothing), and
    top-2 of 5 or 7 experts leaves most experts without a token."""
    expert_parallel = dispatch == "all_to_all"
    by_rank = serve_on_ranks(size, jobs(models), tmp_path, expert_parallel=expert_parallel)
    for i, (name, (_, hf)) in enumerate(models.items()):
        logits_run, batch_run = by_rank[0][2 * i], by_rank[0][2 * i + 1]
        try:
            check_against_transformers(hf, logits_run, batch_run)
        except AssertionError as e:
            raise AssertionError(f"{name} at TP {size}, {dispatch}: {e}") from e
        for rank in range(1, size):
            assert by_rank[rank][2 * i + 1][0] == batch_run[0]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_ranks_hold_disjoint_experts_that_make_up_the_whole(models, expert_parallel):
    """The shared expert on rank 0 (added once by the all-reduce), or under --expert-parallel
    whole on every rank (each runs it on its own share of the tokens)."""
    directory = models["qwen2-moe-shared"][0]
    whole = load_model(directory)[0].layers[0].mlp
    held = []
    for rank in range(2):
        tp = TensorParallel(rank, 2, expert_parallel=expert_parallel)
        mlp = load_model(directory, tp=tp)[0].layers[0].mlp
        first = mlp.first_expert
        count = mlp.experts.gate_up_proj.shape[0]
        assert (mlp.shared_expert is not None) == (rank == 0 or expert_parallel)
        if mlp.shared_expert is not None:
            for mine, reference in zip(
                mlp.shared_expert.parameters(), whole.shared_expert.parameters(), strict=True
            ):
                assert mine.equal(reference)
            assert mlp.shared_expert_gate.weight.equal(whole.shared_expert_gate.weight)
        assert mlp.experts.gate_up_proj.equal(whole.experts.gate_up_proj[first : first + count])
        assert mlp.experts.down_proj.equal(whole.experts.down_proj[first : first + count])
        held += range(first, first + count)
    assert held == list(range(7))  # 7 experts over 2 ranks: 3 and 4
