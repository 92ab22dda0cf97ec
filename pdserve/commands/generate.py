"""`pdserve generate "prompt"`: send one prompt to a running server and print the completion.

The text goes to stdout (as it is produced with --stream); usage and timings go to stderr so
`pdserve generate ... > out.txt` keeps only the text. With --json, stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator

import grpc

from pdserve.client import DEFAULT_TARGET, Completion, GenerationClient, GenerationError
from pdserve.commands.arg_types import INT32_MAX, UINT32_MAX, UINT64_MAX, bounded
from pdserve.pb import generate_pb2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help='the prompt text ("-" reads it from stdin)')
    parser.add_argument(
        "--target",
        metavar="HOST:PORT",
        default=os.environ.get("PDSERVE_TARGET", DEFAULT_TARGET),
        help="host:port of the router (env PDSERVE_TARGET; default %(default)s)",
    )
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument(
        "--max-tokens", type=bounded(int, minimum=1, maximum=UINT32_MAX), help="server default: 64"
    )
    parser.add_argument(
        "--temperature", type=bounded(float, minimum=0), help="0 = greedy (default)"
    )
    parser.add_argument(
        "--top-k", type=bounded(int, minimum=0, maximum=INT32_MAX), help="0 = off (default)"
    )
    parser.add_argument(
        "--top-p", type=bounded(float, above=0, maximum=1), help="1 = off (default)"
    )
    parser.add_argument("--seed", type=bounded(int, minimum=0, maximum=UINT64_MAX))
    parser.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable)", metavar="TEXT"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="generate past EOS")
    parser.add_argument(
        "--min-tokens",
        type=bounded(int, minimum=0, maximum=UINT32_MAX),
        help="EOS and --stop end the output only after this many tokens (default 0)",
    )
    _add_decoding_arguments(parser)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="sent as 'authorization: Bearer KEY' (env PDSERVE_API_KEY)",
    )
    parser.add_argument("--timeout", type=bounded(float, above=0), help="deadline in seconds")
    tls = parser.add_argument_group("TLS (on when any of these is given)")
    tls.add_argument("--tls", action="store_true", help="TLS trusting the system's root CAs")
    tls.add_argument("--tls-ca", metavar="PEM", help="CA that signed the server's certificate")
    tls.add_argument("--tls-cert", metavar="PEM", help="client certificate (mutual TLS)")
    tls.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the completion as JSON (every choice: token_ids, text, finish_reason, "
        "cumulative_logprob)",
    )


def _add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    rules = parser.add_argument_group("decoding rules (checked by the server)")
    rules.add_argument(
        "--n", type=bounded(int, minimum=1, maximum=UINT32_MAX), help="choices (default 1)"
    )
    rules.add_argument(
        "--beam-width",
        type=bounded(int, minimum=0, maximum=UINT32_MAX),
        help=">= 2: beam search returning the best --n beams (greedy only)",
    )
    rules.add_argument("--length-penalty", type=float, help="beam search (default 1)")
    rules.add_argument(
        "--early-stopping", action="store_true", help="beam search: stop at beam-width finished"
    )
    rules.add_argument(
        "--repetition-penalty", type=bounded(float, above=0), help="1 = off (default)"
    )
    rules.add_argument(
        "--dola-layers",
        type=_layers,
        metavar="low|high|I,J,...",
        help="DoLa premature layer candidates",
    )
    rules.add_argument("--sled", action="store_true", help="SLED decoding")
    rules.add_argument(
        "--sled-layers", type=_layers, metavar="low|high|I,J,...", help="SLED layers"
    )
    rules.add_argument("--evolution-rate", type=bounded(float, above=0), help="SLED (default 2)")
    rules.add_argument(
        "--evolution-scale",
        type=bounded(int, minimum=1, maximum=UINT32_MAX),
        help="SLED (default 10)",
    )
    rules.add_argument("--evolution-lower-bound", type=float, help="SLED (default -100)")
    rules.add_argument(
        "--no-speculation",
        dest="disable_speculation",
        action="store_true",
        help="opt out of the server's speculative decoding (same output, one token per step)",
    )


def _layers(text: str) -> str | list[int]:
    """ "low", "high" or comma-separated layer indices."""
    if text in ("low", "high"):
        return text
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f'"low", "high" or comma-separated layer indices, got {text!r}'
        ) from None
    if any(i < 0 for i in layers):
        raise argparse.ArgumentTypeError(f"layer indices must be >= 0, got {text!r}")
    return layers


_DECODING_FIELDS = (
    "n",
    "beam_width",
    "length_penalty",
    "early_stopping",
    "repetition_penalty",
    "dola_layers",
    "sled",
    "sled_layers",
    "evolution_rate",
    "evolution_scale",
    "evolution_lower_bound",
    "disable_speculation",
)


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos,
        "min_tokens": args.min_tokens,
        **{name: getattr(args, name) for name in _DECODING_FIELDS},
    }
    try:
        with GenerationClient(
            args.target,
            api_key=args.api_key,
            timeout=args.timeout,
            tls=args.tls,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
        ) as client:
            stream = client.generate_stream(prompt, **params)
            if args.stream and not args.json:
                stream = _echo(stream)
            completion = Completion.from_responses(stream)
    except GenerationError as error:
        if args.stream:
            print(file=sys.stderr)
        print(f"error: {no_server_message(error, args.target) or error}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as error:  # TLS files unreadable, or a cert without its key
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the stream's `finally` has cancelled the RPC
        print("\ninterrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(completion.to_dict()))
        return 0
    if len(completion.choices) > 1:
        for choice in completion.choices:
            print(f"[choice {choice.index}] {choice.text}")
    else:
        print("" if args.stream else completion.text)
    print(describe(completion), file=sys.stderr)
    return 0


def no_server_message(error: GenerationError, target: str) -> str | None:
    """One line for a router that is not there (nothing listens at `target`), instead of
    gRPC's text; None for every other error."""
    if error.code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in error.details.lower():
        return f"no pdserve server at {target}: is `pdserve serve` running? (--target)"
    return None


def _echo(
    stream: Iterator[generate_pb2.GenerateResponse],
) -> Iterator[generate_pb2.GenerateResponse]:
    """Passes responses through, printing their text the moment each arrives."""
    for response in stream:
        sys.stdout.write(response.text)
        sys.stdout.flush()
        yield response


def describe(completion: Completion) -> str:
    """One line of usage and timings, e.g. for stderr."""
    usage, timings = completion.usage, completion.timings
    line = (
        f"[{completion.finish_reason or 'unfinished'}] prompt {usage.prompt_tokens} tokens "
        f"({usage.cached_prompt_tokens} cached), completion {usage.completion_tokens} tokens | "
        f"ttft {timings.ttft_ms:.1f} ms, e2e {timings.e2e_ms:.1f} ms "
        f"(queue {timings.queue_ms:.1f}, prefill {timings.prefill_ms:.1f}, "
        f"transfer {timings.transfer_ms:.1f})"
    )
    if timings.prefill_worker or timings.decode_worker:
        mode = "disaggregated" if timings.disaggregated else "local prefill"
        line += f" | {timings.prefill_worker} -> {timings.decode_worker} ({mode})"
    return line
