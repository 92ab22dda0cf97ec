"""`pdserve make-model DIR`: write a deterministic random-weight model in Hugging Face layout.

The directory (config.json, generation_config.json, model.safetensors, tokenizer.json) loads
in pdserve and in transformers alike. With `--config-only`, only config.json and the tokenizer
are written: enough for sim workers (docs/simulation.md), and the only form of the published
shapes (`llama-3.1-8b`, `llama-3.1-70b`). No torch import at module level: `pdserve --help`
stays fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdserve.commands import CommandError

WEIGHT_PRESETS = ("tiny", "small")
SHAPE_PRESETS = ("llama-3.1-8b", "llama-3.1-70b")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="where to write the model")
    parser.add_argument(
        "--preset",
        choices=WEIGHT_PRESETS + SHAPE_PRESETS,
        default="tiny",
        help="tiny: the default/test model; small: for benchmarks; llama-3.1-8b/70b: shapes "
        "for sim workers, with --config-only (default: tiny)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json and the tokenizer, no weights (for --engine sim)",
    )


def run(args: argparse.Namespace) -> int:
    if args.config_only:
        return _write_config_only(Path(args.directory), args.preset)
    if args.preset in SHAPE_PRESETS:
        raise CommandError(f"--preset {args.preset} has no weights: add --config-only")
    from pdserve.models.builtin import make_model
    from pdserve.models.presets import preset_config

    out = make_model(args.directory, args.preset, args.seed)
    _report(args.preset, out, preset_config(args.preset), f"(seed {args.seed})")
    return 0


def _write_config_only(directory: Path, preset: str) -> int:
    from pdserve.models.presets import preset_config
    from pdserve.models.tokenizer_builder import write_tokenizer
    from pdserve.sim.shapes import shape_config

    config = shape_config(preset) if preset in SHAPE_PRESETS else preset_config(preset)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        write_tokenizer(directory, config["vocab_size"])
    except OSError as e:
        raise CommandError(f"{directory}: {e.strerror or e}") from e
    _report(preset, directory, config, "(config only, no weights)")
    return 0


def _report(preset: str, out: Path | str, config: dict, note: str) -> None:
    print(
        f"wrote {preset} model to {out}: {config['num_hidden_layers']} layers, "
        f"hidden {config['hidden_size']}, vocab {config['vocab_size']} {note}"
    )
