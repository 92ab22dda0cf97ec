"""SamplingParams validation: every bad value or combination names its field."""

from __future__ import annotations

import pytest

from pdserve.core.sampling_params import MAX_N, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n:"),
        ({"n": MAX_N + 1}, "n:"),
        ({"beam_width": -1}, "beam_width:"),
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"dola_layers": "middle"}, "dola_layers"),
        ({"dola_layers": []}, "dola_layers"),
        ({"dola_layers": [-1]}, "dola_layers"),
        ({"dola_layers": [1, 1]}, "dola_layers"),
        ({"dola_layers": list(range(17))}, "dola_layers"),
        ({"sled": True, "sled_layers": "mid"}, "sled_layers"),
        ({"sled_layers": "low"}, "sled_layers"),
        ({"evolution_rate": 0.0}, "evolution_rate"),
        ({"evolution_scale": 0}, "evolution_scale"),
        ({"evolution_lower_bound": float("-inf")}, "evolution_lower_bound"),
        ({"dola_layers": "high", "sled": True}, "dola_layers: excludes sled"),
        ({"beam_width": 2, "dola_layers": "low"}, "beam_width"),
        ({"beam_width": 2, "sled": True}, "beam_width"),
        ({"beam_width": 2, "temperature": 0.7}, "beam_width"),
        ({"beam_width": 2, "n": 3}, "n: 3 beams"),
        ({"beam_width": 2, "stop": ["x"]}, "stop"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_valid_combinations() -> None:
    beam = SamplingParams(beam_width=4, n=4, length_penalty=0.5, early_stopping=True)
    assert beam.beam_search and beam.n == 4
    assert not SamplingParams(beam_width=1, n=3, temperature=1.0, seed=7).beam_search
    assert SamplingParams(dola_layers=[0, 2], repetition_penalty=1.2).dola_layers == [0, 2]
    assert SamplingParams(sled=True, sled_layers="high").sled
