"""`pdserve make-model DIR`: write a deterministic random-weight model in Hugging Face layout.

The directory (config.json, generation_config.json, model.safetensors, tokenizer.json) loads
in pdserve and in transformers alike. No torch import at module level: `pdserve --help` stays
fast.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="where to write the model")
    parser.add_argument(
        "--preset",
        choices=("tiny", "small"),
        default="tiny",
        help="tiny: the default/test model; small: for benchmarks (default: tiny)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")


def run(args: argparse.Namespace) -> int:
    from pdserve.models.builtin import make_model
    from pdserve.models.presets import preset_config

    out = make_model(args.directory, args.preset, args.seed)
    config = preset_config(args.preset)
    print(
        f"wrote {args.preset} model to {out}: {config['num_hidden_layers']} layers, "
        f"hidden {config['hidden_size']}, vocab {config['vocab_size']} (seed {args.seed})"
    )
    return 0
