"""`pdserve make-model DIR`: write a deterministic random-weight model in Hugging Face layout.

The directory (config.json, generation_config.json, model.safetensors, tokenizer.json) loads
in pdserve and in transformers alike. With `--config-only`, only config.json and the tokenizer
are written: enough for sim workers (docs/simulation.md); the published shapes
(`llama-3.1-8b`, `llama-3.1-70b`) get random weights only with `--with-weights` (to measure a
profile on a GPU: `--device cuda` draws them there, `--dtype` sets their type). With
`--draft-of TARGET`, DIR gets a self-speculative draft of TARGET instead (its first layers,
embedding, final norm and LM head: pdserve/models/draft_of.py); `--residual-scale` writes a
target whose first layers predict its output, so that draft agrees with it (models/builtin.py
`random_weights`). `--chat-template llama3|hermes|mistral` writes a tool-calling family's chat
template instead of the plain one (pdserve/models/tool_chat_templates.py), so the OpenAI API's
`tools` can be tried on a random-weight model. No torch import at module level: `pdserve
--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdserve.commands import CommandError
from pdserve.commands.arg_types import bounded
from pdserve.models.presets import WEIGHT_PRESETS
from pdserve.models.tool_chat_templates import TEMPLATES, use_chat_template
from pdserve.sim.shapes import SHAPES

SHAPE_PRESETS = tuple(SHAPES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="where to write the model")
    parser.add_argument(
        "--preset",
        choices=WEIGHT_PRESETS + SHAPE_PRESETS,
        help="tiny: the default/test model; small, medium, small-moe (Qwen3-MoE): for "
        "benchmarks; llama-3.1-8b/70b, qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b: "
        "shapes for sim workers, with --config-only (default: tiny)",
    )
    parser.add_argument("--seed", type=int, help="weight seed (default: 0)")
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json and the tokenizer, no weights (for --engine sim)",
    )
    parser.add_argument(
        "--with-weights",
        action="store_true",
        help="llama-3.1-8b/70b: write random weights too (16 / 141 GB in bfloat16), e.g. to "
        "measure a --sim-profile on a GPU with `pdserve bench engine --profile-out`",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="weights' dtype (default: the preset's, float32 for tiny/small, bfloat16 for the "
        "shapes)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the random weights are drawn: cuda draws an 8B model in seconds "
        "(each device has its own random stream; default: cpu)",
    )
    parser.add_argument(
        "--residual-scale",
        type=bounded(float, above=0.0, maximum=1.0),
        metavar="S",
        help="scale of what each layer adds to the residual stream (o_proj, down_proj; "
        "default: 1). Below 1 the first layers predict what the whole model does, as in a "
        "model trained for early exit, so a --draft-of draft agrees with it: 0.1 on small, "
        "~0.7 of a 2-layer draft's tokens (docs/decoding.md)",
    )
    parser.add_argument(
        "--chat-template",
        choices=("plain", *TEMPLATES),
        default="plain",
        help="the tokenizer's chat template: plain ('role: content' lines), or a tool-calling "
        "family's (Llama 3.x JSON calls, Hermes/Qwen <tool_call>, Mistral [TOOL_CALLS]) "
        "(default: plain)",
    )
    parser.add_argument(
        "--draft-of",
        metavar="TARGET_DIR",
        help="write a self-speculative draft of this model instead: its embedding, first "
        "--draft-layers layers, final norm and LM head, tokenizer copied",
    )
    parser.add_argument(
        "--draft-layers",
        type=bounded(int, minimum=1),
        metavar="N",
        help="layers the draft keeps, with --draft-of (default: a quarter, at least 1)",
    )


def run(args: argparse.Namespace) -> int:
    if args.draft_of is not None:
        return _write_draft(args)
    if args.draft_layers is not None:
        raise CommandError("--draft-layers needs --draft-of TARGET_DIR")
    preset = args.preset or "tiny"
    seed = args.seed or 0
    if args.config_only:
        if args.with_weights or args.dtype or args.residual_scale is not None:
            raise CommandError(
                "--config-only writes no weights: drop --with-weights, --dtype and --residual-scale"
            )
        return _write_config_only(Path(args.directory), preset, args.chat_template)
    if preset in SHAPE_PRESETS and not args.with_weights:
        raise CommandError(
            f"--preset {preset} has no weights: add --config-only, or --with-weights for "
            "random ones"
        )
    from pdserve.models.builtin import write_model

    config = _preset_config(preset)
    dtype = args.dtype or config["torch_dtype"]
    scale = 1.0 if args.residual_scale is None else args.residual_scale
    try:
        out = write_model(args.directory, config, seed, dtype, args.device, scale)
    except (RuntimeError, ValueError) as e:  # e.g. --device cuda on a machine without one
        raise CommandError(f"--device {args.device}: {str(e).splitlines()[0]}") from e
    _chat_template(out, args.chat_template)
    note = f"{dtype} weights, seed {seed}, drawn on {args.device}"
    if scale != 1.0:
        note += f", residual scale {scale:g}"
    _report(preset, out, config, f"({note})")
    return 0


def _write_draft(args: argparse.Namespace) -> int:
    copied = (
        args.residual_scale is not None or args.seed is not None or args.chat_template != "plain"
    )
    if args.config_only or args.with_weights or args.dtype or args.preset or copied:
        raise CommandError(
            "--draft-of copies its target's weights and tokenizer: drop --preset, --seed, "
            "--dtype, --residual-scale, --chat-template, --with-weights and --config-only"
        )
    from pdserve.models.draft_of import write_draft_of
    from pdserve.models.hf_config import ModelLoadError

    try:
        out, layers = write_draft_of(args.draft_of, args.directory, args.draft_layers)
    except ModelLoadError as e:
        raise CommandError(f"--draft-of: {e}") from e
    except OSError as e:
        raise CommandError(f"{args.directory}: {e.strerror or e}") from e
    print(f"wrote a {layers}-layer draft of {args.draft_of} to {out}")
    return 0


def _chat_template(directory: Path | str, family: str) -> None:
    if family != "plain":
        use_chat_template(directory, family)


def _write_config_only(directory: Path, preset: str, chat_template: str) -> int:
    from pdserve.models.tokenizer_builder import write_tokenizer

    config = _preset_config(preset)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        write_tokenizer(directory, config["vocab_size"])
    except OSError as e:
        raise CommandError(f"{directory}: {e.strerror or e}") from e
    _chat_template(directory, chat_template)
    _report(preset, directory, config, "(config only, no weights)")
    return 0


def _preset_config(preset: str) -> dict:
    from pdserve.models.presets import preset_config
    from pdserve.sim.shapes import shape_config

    return shape_config(preset) if preset in SHAPE_PRESETS else preset_config(preset)


def _report(preset: str, out: Path | str, config: dict, note: str) -> None:
    print(
        f"wrote {preset} model to {out}: {config['num_hidden_layers']} layers, "
        f"hidden {config['hidden_size']}, vocab {config['vocab_size']} {note}"
    )
