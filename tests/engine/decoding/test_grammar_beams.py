"""Beam search under a grammar: every beam carries its own matcher (forked with the beam), the
mask drops each beam's disallowed candidates after the log-softmax, and the returned beams and
scores equal transformers' `generate(num_beams=k)` with a logits processor that masks each
row by a matcher rebuilt from that row's own tokens (so it cannot share our forking, or the
order beams are reordered in). Every returned beam matches the grammar: whole when it ended on
EOS, a prefix of a match when it ran out of tokens."""

from __future__ import annotations

import re

import pytest
import torch

from pdserve.core.grammar_spec import GrammarError, GrammarSpec
from pdserve.core.sampling_params import SamplingParams
from tests.engine.conftest import random_prompts

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8
PROMPTS = random_prompts([6, 9, 4], seed=17)
CASES = [
    # (grammar, its language as a Python regex)
    (GrammarSpec("regex", r"[a-p]{1,6}"), r"[a-p]{1,6}"),
    (GrammarSpec("choice", choices=("alpha", "beta", "gamma delta", "pi")), r"alpha|beta|gamma delta|pi"),
]  # fmt: skip
# (beam_width, n, length_penalty)
SETTINGS = [(3, 2, 1.0), (4, 4, 0.0)]


class ReplayedGrammar(transformers.LogitsProcessor):
    """Masks each row of transformers' beam scores by a fresh matcher fed that row's generated
    tokens (a row whose tokens left or ended the grammar, one of transformers' -inf fillers
    when too few candidates were allowed, allows nothing)."""

    def __init__(self, engine, spec: GrammarSpec, prompt_len: int) -> None:
        self.engine, self.spec, self.prompt_len = engine, spec, prompt_len

    def __call__(self, input_ids, scores):
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(scores.shape[0], scores.shape[-1])
        for row, ids in enumerate(input_ids.tolist()):
            try:
                matcher = self.engine.grammars.start(self.spec, ids[self.prompt_len :]).matcher
            except GrammarError:
                matcher = None
            if matcher is None or matcher.is_terminated():
                bitmask[row] = 0
            else:
                matcher.fill_next_token_bitmask(bitmask, row)
        xgrammar.apply_token_bitmask_inplace(scores, bitmask)
        return scores


def hf_beams(hf, engine, spec, prompt, width, n, length_penalty):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            num_beams=width,
            num_return_sequences=n,
            do_sample=False,
            length_penalty=length_penalty,
            eos_token_id=sorted(engine.eos_token_ids),
            pad_token_id=0,
            logits_processor=transformers.LogitsProcessorList(
                [ReplayedGrammar(engine, spec, len(prompt))]
            ),
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    tokens = [out.sequences[i, len(prompt) : len(prompt) + lengths[i]].tolist() for i in range(n)]
    return tokens, out.sequences_scores.tolist()


@pytest.mark.parametrize("width, n, length_penalty", SETTINGS)
def test_constrained_beams_equal_transformers_and_match_the_grammar(
    make_engine, tiny_dir, width, n, length_penalty
):
    engine = make_engine(num_kv_blocks=256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    expected, requests = {}, {}
    for c, (spec, _) in enumerate(CASES):
        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            beam_width=width,
            n=n,
            length_penalty=length_penalty,
            grammar=spec,
        )
        for p, prompt in enumerate(PROMPTS):
            rid = f"c{c}p{p}"
            requests[rid] = (c, prompt, params)
            expected[rid] = hf_beams(hf, engine, spec, prompt, width, n, length_penalty)
    for rid, (_, prompt, params) in requests.items():  # all in one batch
        engine.add_request(rid, prompt, params)
    got: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out)
    for rid, (c, _, _) in requests.items():
        beams = sorted(got[rid], key=lambda out: out.index)
        tokens, scores = expected[rid]
        assert [out.new_token_ids for out in beams] == tokens, rid
        assert [out.score for out in beams] == pytest.approx(scores, abs=1e-4), rid
        pattern = CASES[c][1]
        for out in beams:
            text = out.text_delta
            if out.finish_reason == "stop":
                assert out.new_token_ids[-1] in engine.eos_token_ids
                assert re.fullmatch(pattern, text), (rid, text)
            else:  # out of tokens: a prefix of the language (GrammarError if not)
                engine.grammars.start(CASES[c][0], out.new_token_ids)
