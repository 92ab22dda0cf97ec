"""DoLa, SLED and the repetition penalty computed in the engine, against references written here
from transformers' model (`output_hidden_states=True`, no KV cache) and the papers' formulas,
one token at a time: greedy tokens must be equal, colocated and across a prefill/decode handoff.

Early-layer logits are the final norm and the LM head on `hidden_states[layer]` (0 = the
embedding output); the final logits are the model's own. The models are 6 layers deep so that
"low"/"high" leave several candidate layers and DoLa's layer selection matters.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine_config import EngineConfig
from tests.engine.test_disaggregation import handoff
from tests.models.hf_reference import hf_greedy
from tests.models.test_llama_matches_transformers import VOCAB, make_hf_model

transformers = pytest.importorskip("transformers")

NUM_LAYERS = 6
MAX_TOKENS = 8
# Qwen2 ties its embeddings: "low"/"high" and SLED's default then skip layers 0 and 1. Its
# unit-scale random weights make the final distribution one-hot, which leaves DoLa and SLED
# nothing to change; a smaller final norm weight (scaling every layer's exit logits) flattens it.
FINAL_NORM_SCALE = {"llama3": 1.0, "qwen2": 0.03}
GEN = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=GEN).tolist() for n in (3, 11, 26)]
MODES = {
    "dola-low": dict(dola_layers="low"),
    "dola-high": dict(dola_layers="high"),
    "dola-list": dict(dola_layers=[0, 1, 3, 4]),
    "dola-high-penalty": dict(dola_layers="high", repetition_penalty=1.2),
    "sled": dict(sled=True),
    "sled-list": dict(
        sled=True,
        sled_layers=[1, 2, 4],
        evolution_rate=1.0,
        evolution_scale=5,
        evolution_lower_bound=-50.0,
    ),
}


def params_of(mode: str) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **MODES[mode])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a shared machine: one torch thread avoids oversubscribing its cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(FINAL_NORM_SCALE))
def style(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(directory, request.param, num_hidden_layers=NUM_LAYERS)
    with torch.no_grad():
        hf.model.norm.weight.mul_(FINAL_NORM_SCALE[request.param])
    hf.save_pretrained(directory)
    return hf, directory


def make_engine(directory) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(directory), block_size=8, num_kv_blocks=128))


# ---- the references ----------------------------------------------------------------------
def candidates(hf, selection) -> list[int]:
    """transformers' DoLa layer sets; None (SLED's default) = every layer from the first one."""
    n = hf.config.num_hidden_layers
    # Tied embeddings: the embedding output's early exit is skipped (and layer 1 if n > 2).
    first = min(2, n - 1) if hf.config.tie_word_embeddings else 0
    if selection == "low":
        return [first] if first == n // 2 else list(range(first, n // 2, 2))
    if selection == "high":
        return list(range(n // 2, n, 2))
    return list(range(first, n)) if selection is None else [i for i in selection if i < n]


def reference_dola(final: torch.Tensor, early: dict[int, torch.Tensor]) -> torch.Tensor:
    log_p = final.log_softmax(-1)
    chosen, best = None, -math.inf
    for layer, logits in early.items():  # ascending: ties keep the lower layer
        log_q = logits.log_softmax(-1)
        log_m = ((log_p.exp() + log_q.exp()) / 2).log()
        m = log_m.exp()
        divergence = 0.5 * ((m * (log_m - log_p)).mean() + (m * (log_m - log_q)).mean())
        if divergence > best:
            chosen, best = layer, divergence
    contrast = log_p - early[chosen].log_softmax(-1)
    plausible = log_p >= log_p.max() + math.log(0.1)
    return torch.where(plausible, contrast, torch.tensor(-math.inf))


def reference_sled(final, early, rate: float, scale: int, lower_bound: float) -> torch.Tensor:
    p = final.softmax(-1)
    top = p.topk(scale).indices
    per_layer = []
    for logits in early.values():
        q = logits.softmax(-1)
        weights = []
        for t in top:
            gradient = q - F.one_hot(t, p.numel()).float()
            cosine = F.cosine_similarity(gradient, logits - final, dim=0)
            weights.append(cosine.clamp_min(0) ** 2)
        w = torch.stack(weights)
        per_layer.append((w / w.sum() if w.sum() > 0 else w, w.sum()))
    total = sum(s for _, s in per_layer)
    latent = torch.zeros_like(p)
    for w, s in per_layer:
        latent[top] += w * (s / total if total > 0 else s)
    evolved = final - rate * (p - latent)
    out = torch.full_like(final, lower_bound)
    out[top] = evolved[top]
    return out


_REFERENCES: dict[tuple[int, tuple[int, ...], str], list[int]] = {}


def reference_of(hf, prompt: list[int], mode: str) -> list[int]:
    """reference_generate of a mode, computed once per model and prompt (it is slow)."""
    key = (id(hf), tuple(prompt), mode)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_generate(hf, prompt, params_of(mode))
    return _REFERENCES[key]


def reference_generate(hf, prompt: list[int], params: SamplingParams) -> list[int]:
    if params.dola_layers is not None:
        layers = candidates(hf, params.dola_layers)
        rule = reference_dola
    else:
        layers = candidates(hf, params.sled_layers)

        def rule(final, early):
            return reference_sled(
                final,
                early,
                params.evolution_rate,
                params.evolution_scale,
                params.evolution_lower_bound,
            )

    penalty = transformers.RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(params.max_tokens):
            out = hf(torch.tensor([ids]), output_hidden_states=True)
            final = out.logits[0, -1].float()
            early = {
                layer: hf.lm_head(hf.model.norm(out.hidden_states[layer][0, -1])).float()
                for layer in layers
            }
            scores = rule(final, early)
            if params.repetition_penalty != 1.0:
                scores = penalty(torch.tensor([ids]), scores[None])[0]
            ids.append(int(scores.argmax()))
    return ids[len(prompt) :]


# ---- the tests ---------------------------------------------------------------------------
def test_rules_equal_the_references_in_one_mixed_batch(style):
    """Every mode and plain greedy requests share the running batch; each equals its own
    reference, and each rule changes some output (the comparison could fail)."""
    hf, directory = style
    engine = make_engine(directory)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    requests = [(mode, prompt) for mode in MODES for prompt in PROMPTS]
    outputs = engine.generate(
        [prompt for _, prompt in requests] + PROMPTS,
        [params_of(mode) for mode, _ in requests] + [greedy] * len(PROMPTS),
    )
    got, plain = outputs[: len(requests)], outputs[len(requests) :]
    assert plain == hf_greedy(hf, PROMPTS, MAX_TOKENS)
    for (mode, prompt), tokens in zip(requests, got, strict=True):
        assert tokens == reference_of(hf, prompt, mode), (mode, prompt)
    for rule in ("dola", "sled"):
        changed = [
            got[i] != plain[i % len(PROMPTS)] for i, (m, _) in enumerate(requests) if rule in m
        ]
        assert any(changed), f"{rule} never departs from greedy on these prompts"


@pytest.mark.parametrize("mode", ["dola-high-penalty", "sled"])
def test_prefill_worker_applies_the_rule_and_handoff_continues_it(style, mode):
    """The first token comes from the prefill engine's own forward pass: it must already be
    the rule's; the decode engine continues with the same rule after the KV handoff."""
    hf, directory = style
    prompt = PROMPTS[2]
    expected = reference_of(hf, prompt, mode)
    prefill, decode = make_engine(directory), make_engine(directory)
    got, _ = handoff(prefill, decode, "r", prompt, params_of(mode))
    assert got == expected
    assert prefill.runner.early_exit_steps == 1  # the prompt's one sampling step
    assert decode.runner.early_exit_steps == MAX_TOKENS - 1
    for engine in (prefill, decode):
        assert engine.stats()["num_used_blocks"] == 0


def test_repetition_penalty_equals_transformers_generate(style):
    hf, directory = style
    engine = make_engine(directory)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    got = engine.generate(PROMPTS, params)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                repetition_penalty=1.3,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert tokens == out[0, len(prompt) :].tolist()
    assert got != hf_greedy(hf, PROMPTS, MAX_TOKENS)


def test_no_early_exit_work_unless_a_request_asks(style):
    _, directory = style
    engine = make_engine(directory)
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.generate(PROMPTS, plain)
    assert engine.runner.early_exit_steps == 0
    # One DoLa request among plain ones: only the steps where it samples keep early states.
    engine.generate(PROMPTS + [PROMPTS[0]], [plain] * len(PROMPTS) + [params_of("dola-low")])
    assert engine.runner.early_exit_steps == MAX_TOKENS


def test_layers_the_model_lacks_are_refused_naming_the_field(style):
    _, directory = style
    engine = make_engine(directory)
    with pytest.raises(ValueError, match="^dola_layers: layer 6 "):
        engine.add_request("a", PROMPTS[0], SamplingParams(dola_layers=[2, 6]))
    with pytest.raises(ValueError, match="^sled_layers: layer 9 "):
        engine.add_request("b", PROMPTS[0], SamplingParams(sled=True, sled_layers=[9]))
    with pytest.raises(ValueError, match="^dola_layers: layer 6 "):
        engine.reserve("c", PROMPTS[0], SamplingParams(dola_layers=[6]))
    assert engine.stats()["num_used_blocks"] == 0
