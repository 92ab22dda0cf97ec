"""SamplingParams: how one request picks its tokens and when it stops.

No torch import here: the router validates and builds these before any engine is involved.
Every check raises ValueError whose message starts with the offending field's name; the router
turns it into INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.core.grammar_spec import GrammarSpec

# Temperatures below this are greedy: dividing logits by them overflows float32 to inf, and a
# softmax over infinities samples an arbitrary token instead of the most likely one.
GREEDY_TEMPERATURE = 1e-5

MAX_N = 64  # most choices (samples or returned beams) one request may ask for
MAX_BEAM_WIDTH = 64
# Layer selections of DoLa/SLED: "low"/"high" (transformers' dola_layers) or explicit indices.
LAYER_PRESETS = ("low", "high")
MAX_PREMATURE_LAYERS = 16

LayerSelection = str | list[int] | None


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature < GREEDY_TEMPERATURE (0 included) means greedy
    (top_k/top_p/seed unused).

    n: choices sharing the prompt's KV (prefilled once). Choice i of a seeded request draws its
    tokens exactly as a single request with seed + i would (token t of choice i uses the
    generator seeded by (seed + i, seed_offset + t)); unseeded choices draw independent noise.
    With beam search, n is how many of the best beams are returned (n <= beam_width).

    beam_width >= 2 turns on beam search (greedy only; transformers' `num_beams`), with
    length_penalty (a hypothesis scores sum_logprobs / length ** length_penalty, length counting
    the generated tokens) and early_stopping (transformers' True/False: True stops once
    beam_width hypotheses are finished; False stops when no running beam can beat the worst
    finished one).

    repetition_penalty: transformers' RepetitionPenaltyLogitsProcessor over prompt + output
    tokens (logit / p if positive, logit * p if negative); 1.0 = off.

    dola_layers: DoLa (Chuang et al. 2024) premature layer candidates: "low"/"high" (the lower
    or upper half of the layers, every 2nd one, at most 16, as transformers defines them) or
    explicit layer indices (0 = the embedding output). None = off.
    sled (Zhang et al. 2024) with sled_layers (same forms; None = every earlier layer),
    evolution_rate, evolution_scale (top-k tokens evolved) and evolution_lower_bound.
    """

    max_tokens: int = 64  # most tokens generated, the first one included
    # vLLM's: stop tokens (EOS included) and stop strings end the output only from this many
    # generated tokens on; before, the stop tokens are masked (never chosen, sampler.py).
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    # vLLM's (transformers' MinPLogitsWarper): keep tokens whose probability is at least min_p
    # times the most likely token's; 0.0 = off.
    min_p: float = 0.0
    seed: int | None = None  # token n is drawn from a generator seeded by (seed, seed_offset + n)
    # Tokens generated before this prompt ended: a continuation whose prompt carries them
    # draws from the seeded stream where the interrupted run left off.
    seed_offset: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings; matched text is not emitted
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-probability of each chosen token
    n: int = 1
    beam_width: int = 0  # 0 or 1 = no beam search
    length_penalty: float = 1.0
    early_stopping: bool = False
    repetition_penalty: float = 1.0
    dola_layers: LayerSelection = None
    sled: bool = False
    sled_layers: LayerSelection = None
    evolution_rate: float = 2.0
    evolution_scale: int = 10
    evolution_lower_bound: float = -100.0
    # Whether the engine may speculate on this request (when it runs --speculative); False =
    # every token from its own forward. Speculation never changes the output distribution.
    speculative: bool = True
    # Structured output: every token keeps the output a prefix of the grammar's language, and
    # EOS comes only where the grammar may end (pdserve/engine/decoding/grammar.py), with every
    # decoding rule: greedy, sampling, n, beam search, speculation (docs/decoding.md).
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens: must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1] (0 = off), got {self.min_p}")
        if self.seed_offset < 0:
            raise ValueError(f"seed_offset must be >= 0, got {self.seed_offset}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n: must be in [1, {MAX_N}], got {self.n}")
        if not 0 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width: must be in [0, {MAX_BEAM_WIDTH}], got {self.beam_width}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty: must be finite, got {self.length_penalty}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        _check_layers("dola_layers", self.dola_layers)
        _check_layers("sled_layers", self.sled_layers)
        if not (math.isfinite(self.evolution_rate) and self.evolution_rate > 0):
            raise ValueError(f"evolution_rate: must be > 0, got {self.evolution_rate}")
        if self.evolution_scale < 1:
            raise ValueError(f"evolution_scale: must be >= 1, got {self.evolution_scale}")
        if not math.isfinite(self.evolution_lower_bound):
            raise ValueError(
                f"evolution_lower_bound: must be finite, got {self.evolution_lower_bound}"
            )
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.sled_layers is not None and not self.sled:
            raise ValueError("sled_layers: needs sled")
        if self.dola_layers is not None and self.sled:
            raise ValueError("dola_layers: excludes sled (choose one)")
        if not self.beam_search:
            return
        if self.min_tokens:
            raise ValueError("min_tokens: not supported with beam search (beam_width >= 2)")
        if self.dola_layers is not None or self.sled:
            raise ValueError("beam_width: beam search (>= 2) excludes dola_layers and sled")
        if not self.greedy:
            raise ValueError("beam_width: beam search (>= 2) is greedy only: temperature must be 0")
        if self.n > self.beam_width:
            raise ValueError(
                f"n: {self.n} beams cannot be returned from beam_width {self.beam_width}"
            )
        if self.stop:
            raise ValueError(
                "stop: stop strings are not supported with beam search (beam_width >= 2)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def beam_search(self) -> bool:
        return self.beam_width >= 2


def _check_layers(name: str, layers: LayerSelection) -> None:
    if layers is None:
        return
    if isinstance(layers, str):
        if layers not in LAYER_PRESETS:
            raise ValueError(
                f'{name}: must be "low", "high" or a list of layer indices, got {layers!r}'
            )
        return
    if not layers:
        raise ValueError(f"{name}: must name at least one layer")
    if len(layers) > MAX_PREMATURE_LAYERS:
        raise ValueError(f"{name}: names at most {MAX_PREMATURE_LAYERS} layers, got {len(layers)}")
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
        raise ValueError(f"{name}: must hold layer indices >= 0, got {layers}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name}: must not repeat a layer, got {layers}")
