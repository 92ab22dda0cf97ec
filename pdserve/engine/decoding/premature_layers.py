"""Which earlier layers DoLa and SLED contrast with the final one (no torch: the engine checks
a request's layers when it arrives).

Layer 0 is the embedding output and layer i the output of decoder layer i, as in transformers'
`hidden_states`; a premature layer is below the model's `num_layers`. "low" and "high" follow
transformers' `dola_layers`: with N layers, every 2nd layer of the lower half
(`range(start, N // 2, 2)`) or of the upper half (`range(N // 2, N, 2)`); above 40 layers,
`range(start, 20, 2)` and `range(N - 20, N, 2)`. With tied word embeddings, `start` skips the
embedding output, whose early exit is nearly the identity map: 2 (1 for a 2-layer model).
SLED without `sled_layers` contrasts every earlier layer from `start` on.
"""

from __future__ import annotations

from pdserve.core.sampling_params import SamplingParams

# transformers' DoLa: models deeper than this take 10 candidates at a fixed distance from the ends.
DEEP_MODEL_LAYERS = 40


def first_candidate_layer(num_layers: int, tied_embeddings: bool) -> int:
    if not tied_embeddings:
        return 0
    if num_layers > 2:
        return 2
    return 1 if num_layers == 2 else 0


def resolve_layers(
    field_name: str, selection: str | list[int] | None, num_layers: int, tied_embeddings: bool
) -> list[int]:
    """The ascending candidate layers of a selection ("low", "high", explicit indices, or None
    = every earlier layer). Raises ValueError naming `field_name` for a layer the model lacks."""
    start = first_candidate_layer(num_layers, tied_embeddings)
    half = num_layers // 2
    deep = num_layers > DEEP_MODEL_LAYERS
    if selection is None:
        return list(range(start, num_layers))
    if selection == "low":
        if start == half:
            return [start]
        return list(range(start, 20 if deep else half, 2))
    if selection == "high":
        return list(range(num_layers - 20 if deep else half, num_layers, 2))
    if isinstance(selection, str):
        raise ValueError(f'{field_name} must be "low", "high" or layer indices, got {selection!r}')
    beyond = [i for i in selection if i >= num_layers]
    if beyond:
        raise ValueError(
            f"{field_name}: layer {beyond[0]} is not an earlier layer of this "
            f"{num_layers}-layer model (0 = embedding output .. {num_layers - 1})"
        )
    return sorted(selection)


def request_layers(
    params: SamplingParams, num_layers: int, tied_embeddings: bool
) -> list[int] | None:
    """The premature layers a request contrasts with (None: neither DoLa nor SLED)."""
    if params.dola_layers is not None:
        name, selection = "dola_layers", params.dola_layers
    elif params.sled:
        name, selection = "sled_layers", params.sled_layers
    else:
        return None
    layers = resolve_layers(name, selection, num_layers, tied_embeddings)
    if not layers:
        raise ValueError(f"{name}: {selection!r} leaves no layer of this {num_layers}-layer model")
    return layers
