"""`pdserve bench engine`: decode tokens/s of LLMEngine vs transformers' `generate`.

Same weights, same dtype (--dtype, float32 by default), same threads, same prompt length and
number of new tokens, greedy with EOS ignored, both warmed up, measured in the same run. Decode
throughput is batch * (N - 1) / (time from the first new token to the N-th), timed the same way
in both (transformers through a stopping criterion called at the end of every step); best of
--repeats runs. Fresh prompts for every run keep the engine's prefix cache from shortening a
measured prefill.

`--decoding beam4|n4|sample|top-p` (default greedy) measures another decoding rule in both
engines, whole requests this time (prefill included: a beam search emits nothing before its
end): tok/s is the tokens the requests return (n4: 4 choices each) over the seconds from
adding the batch to its end. Each rule is one line of DECODINGS: the SamplingParams fields and the `generate`
keywords that ask for it. `--decoding dola|sled` contrasts 4 evenly spaced premature layers
(docs/decoding.md) and compares decode steps with pdserve's own greedy in the same run: the
ratio is the rule's tok/s over greedy's (target >= 1 / 1.3). `--decoding json` does the same
for structured output: greedy decode steps constrained by a JSON schema (a long array of
objects, so that every request runs all --steps tokens) against unconstrained greedy (target
>= 1 / 1.1, issue 52).

The two engines' runs alternate (one of each per repeat), so that a load swing on a shared
machine hits both alike: the table gives each one's best tok/s, their ratio, and the median
of the repeats' ratios (ours over theirs, run by run).

`--op-profile` profiles pdserve's decode steps at the largest batch (op_profile.py): time per
op and the share of a step outside the weight matmuls (issue 19 point 1). `--step-phases` times
the same steps by the engine's phases without a profiler (step_phases.py): scheduling, the
model as the host sees it, waiting for the GPU, sampling, outputs.

`--profile-out FILE` also records every measured step of the engine (prefill tokens, decode
sequences, context tokens and seconds, through `StepRecorder`), fits them with
`pdserve.sim.fit.fit_linear` and writes the `--sim-profile` file of that device (issue 14
point 2b).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from pdserve.core.grammar_spec import GrammarSpec
from pdserve.models.presets import WEIGHT_PRESETS

# `--decoding json`'s schema: records with a number, a string and an enum array; minItems
# keeps every output going for the whole measured span.
JSON_RECORDS = GrammarSpec(
    "json_schema",
    '{"type": "array", "minItems": 10000, "items": {"type": "object", "properties": {'
    '"id": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array", '
    '"items": {"enum": ["red", "green", "blue"]}}}, "required": ["id", "name", "tags"]}}',
)


@dataclass(frozen=True)
class Decoding:
    """One decoding rule in both engines: pdserve's SamplingParams fields, transformers'
    `generate` keywords, and how many sequences each request returns."""

    params: dict = field(default_factory=dict)
    hf: dict = field(default_factory=dict)
    returned: int = 1
    # DoLa/SLED: the SamplingParams field given 4 evenly spaced premature layers of the model.
    # Measured as decode steps against pdserve's own greedy (transformers 5 keeps DoLa on the
    # Hub, out of reach offline, and has no SLED).
    layer_field: str = ""
    # Measured as decode steps against pdserve's own greedy in the same run (not transformers).
    versus_greedy: bool = False


DECODINGS = {
    "greedy": Decoding(hf={"do_sample": False}),
    "beam4": Decoding({"beam_width": 4}, {"do_sample": False, "num_beams": 4}),
    "n4": Decoding(
        {"n": 4, "temperature": 1.0, "seed": 0},
        {"do_sample": True, "temperature": 1.0, "top_k": 0, "num_return_sequences": 4},
        returned=4,
    ),
    # Sampled decode steps: temperature alone (transformers' default top-k of 50 turned off),
    # and with top-p.
    "sample": Decoding(
        {"temperature": 0.8, "seed": 0}, {"do_sample": True, "temperature": 0.8, "top_k": 0}
    ),
    "top-p": Decoding(
        {"temperature": 0.8, "top_p": 0.95, "seed": 0},
        {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 0},
    ),
    "dola": Decoding(layer_field="dola_layers", versus_greedy=True),
    "sled": Decoding({"sled": True}, layer_field="sled_layers", versus_greedy=True),
    "json": Decoding({"grammar": JSON_RECORDS}, versus_greedy=True),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=WEIGHT_PRESETS,
        default="small",
        help="built-in model to measure (default: small)",
    )
    parser.add_argument("--model", default=None, help="a model directory instead of a preset")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated (default: 1,8,32)")
    parser.add_argument(
        "--steps", type=int, default=32, help="new tokens per request (default: 32)"
    )
    parser.add_argument(
        "--prompt-len",
        default="32",
        help="prompt tokens, or comma-separated lengths measured one after the other by the "
        "same engines (on a GPU the compiled graphs are made once; default: 32)",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="best of this many runs (default: 2)"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights and activations of both engines (default: float32)",
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu, cuda or cuda:N for both engines (default: cpu)"
    )
    parser.add_argument(
        "--profile-out",
        default=None,
        metavar="FILE",
        help="fit the engine's per-step costs and write them as a --sim-profile JSON file",
    )
    parser.add_argument(
        "--decoding",
        choices=sorted(DECODINGS),
        default="greedy",
        help="decoding rule measured in both engines (default: greedy, decode steps only)",
    )
    parser.add_argument(
        "--op-profile",
        action="store_true",
        help="also profile pdserve's decode steps at the largest batch: time per op, and the "
        "share of the step outside weight matmuls",
    )
    parser.add_argument(
        "--step-phases",
        action="store_true",
        help="also time pdserve's decode steps at the largest batch by phase (scheduling, "
        "model, waiting for the GPU, sampling, outputs), without a profiler",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pdserve's decode steps as a compiled graph (EngineConfig.compile; default: on "
        "CUDA only)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch each plain decode step before the previous one's tokens are back "
        "(EngineConfig.async_scheduling; default: on CUDA only)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for both engines (default: torch's default)",
    )


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from pdserve.bench.engine.step_recorder import StepRecorder, write_profile
    from pdserve.core.sampling_params import SamplingParams
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.gpu_step.compiled_decode import use_compile
    from pdserve.engine_config import EngineConfig
    from pdserve.models.builtin import builtin_model_dir
    from pdserve.models.cpu_features import cpu_features

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2")
    if args.profile_out and not Path(args.profile_out).parent.is_dir():
        raise SystemExit(f"--profile-out {args.profile_out}: no such directory")
    model_dir = args.model or str(builtin_model_dir(args.preset))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompt_lens = [int(n) for n in str(args.prompt_len).split(",")]
    prompt_len = max(prompt_lens)  # the engine is sized for the longest; rebound per table
    max_batch = max(batch_sizes)
    decoding = DECODINGS[args.decoding]
    # Sequences per request: beams or choices (each needs its own blocks past the prompt).
    width = max(decoding.returned, decoding.params.get("beam_width", 1))
    block_size = 16
    blocks_per_seq = -(-(prompt_len + args.steps) // block_size) + 1
    engine = LLMEngine(
        EngineConfig(
            model=model_dir,
            block_size=block_size,
            num_kv_blocks=2 * max_batch * width * blocks_per_seq,
            max_num_seqs=max_batch * width,
            max_num_batched_tokens=max(1024, max_batch * prompt_len),
            dtype=args.dtype,
            device=args.device,
            compile=args.compile,
            async_scheduling=args.async_scheduling,
        ),
        # As the serving workers run it (pdserve/worker/worker_runtime.py): token ids out, the
        # router decodes the text; transformers' generate returns token ids too.
        emit_text=False,
    )
    # Only to fit a profile: the recorder times steps one at a time (no async scheduling).
    recorder = StepRecorder(engine.executor) if args.profile_out else None
    if recorder is not None:
        engine.executor = recorder
    hf = (
        transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype)
        )
        .to(args.device)
        .eval()
    )
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    request_ids = itertools.count()

    def prompts(batch: int) -> list[list[int]]:
        return torch.randint(3, vocab, (batch, prompt_len), generator=gen).tolist()

    def prefill(batch: int, new_tokens: int, rule: dict | None = None) -> None:
        """Adds `batch` requests and steps until every one has its first token."""
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **(rule or {}))
        ids = [f"bench-{next(request_ids)}" for _ in range(batch)]
        for rid, prompt in zip(ids, prompts(batch), strict=True):
            engine.add_request(rid, prompt, params)
        started: set[str] = set()
        while len(started) < batch:
            started.update(out.request_id for out in engine.step())

    def decode() -> None:
        while engine.has_unfinished():
            engine.step()

    def ours(batch: int, new_tokens: int, rule: dict | None = None) -> float:
        """Seconds from every request having its first token to all having new_tokens."""
        prefill(batch, new_tokens, rule)
        start = time.perf_counter()
        decode()
        return time.perf_counter() - start

    def hf_generate(ids: torch.Tensor, new_tokens: int, **rule) -> None:
        """transformers' generate: exactly new_tokens per sequence, `rule` choosing them."""
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                **rule,
            )

    def theirs(batch: int, new_tokens: int) -> float:
        """The same span in transformers: a stopping criterion sees each step's end."""
        ids = torch.tensor(prompts(batch), device=args.device)
        stamps: list[float] = []

        def stamp(input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        hf_generate(
            ids,
            new_tokens,
            do_sample=False,
            stopping_criteria=transformers.StoppingCriteriaList([stamp]),
        )
        assert len(stamps) == new_tokens
        return stamps[-1] - stamps[0]

    def ours_whole(batch: int, new_tokens: int) -> float:
        """Seconds from adding the batch to its last request's end."""
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **decoding.params)
        start = time.perf_counter()
        for prompt in prompts(batch):
            engine.add_request(f"bench-{next(request_ids)}", prompt, params)
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    def theirs_whole(batch: int, new_tokens: int) -> float:
        ids = torch.tensor(prompts(batch), device=args.device)
        start = time.perf_counter()
        hf_generate(ids, new_tokens, **decoding.hf)
        return time.perf_counter() - start

    whole = args.decoding != "greedy" and not decoding.versus_greedy
    if decoding.versus_greedy:
        rule = dict(decoding.params)
        if decoding.layer_field:
            layers = list(range(0, engine.num_layers, max(1, engine.num_layers // 4)))[:4]
            rule[decoding.layer_field] = layers
        ours, theirs = partial(ours, rule=rule), ours
    elif whole:
        ours, theirs = ours_whole, theirs_whole

    def tokens(batch: int) -> int:
        if whole:  # whole requests: every returned token counts
            return batch * decoding.returned * args.steps
        return batch * (args.steps - 1)

    def rates(batch: int) -> tuple[float, float, float]:
        """Best tok/s of each, and the median of the runs' ratios. The two alternate run by
        run, so that a load swing on a shared machine hits both alike."""
        pairs = [(ours(batch, args.steps), theirs(batch, args.steps)) for _ in range(args.repeats)]
        ratios = sorted(t / o for o, t in pairs)
        best_ours, best_theirs = (min(times) for times in zip(*pairs, strict=True))
        return tokens(batch) / best_ours, tokens(batch) / best_theirs, statistics.median(ratios)

    baseline = "pdserve greedy tok/s" if decoding.versus_greedy else "transformers tok/s"
    # Every figure names the machine: the fastest kernels, and the ratios, depend on it.
    cpu = cpu_features().describe()
    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else ""
    print(f"cpu {cpu}" + (f" | gpu {gpu}" if gpu else ""))
    for prompt_len in prompt_lens:
        print(
            f"model {model_dir} | prompt {prompt_len} tokens, {args.steps} new tokens, "
            f"{args.decoding}, {args.dtype}, {torch.get_num_threads()} threads, "
            f"compiled decode {'on' if use_compile(args.compile, args.device) else 'off'}, "
            f"async scheduling {'on' if engine.async_scheduling else 'off'}"
        )
        if decoding.layer_field:
            print(f"{decoding.layer_field} {layers}")
        for measure in (ours, theirs):  # warm-up: first calls pay for allocation and dispatch
            measure(2, 4)
        if recorder is not None:
            recorder.samples.clear()
        print(f"{'batch':>5} {'pdserve tok/s':>14} {baseline:>20} {'ratio':>7} {'median':>7}")
        for batch in batch_sizes:
            rate_ours, rate_theirs, median = rates(batch)
            print(
                f"{batch:>5} {rate_ours:>14.1f} {rate_theirs:>20.1f} "
                f"{rate_ours / rate_theirs:>6.2f}x {median:>6.2f}x",
                flush=True,
            )
    if args.op_profile:
        from pdserve.bench.engine.op_profile import format_profile, profile_ops

        prefill(max_batch, args.steps)
        profile = profile_ops(decode, args.device)
        timed = "GPU kernel time" if profile.device == "cuda" else "self CPU time"
        print(f"\npdserve decode steps at batch {max_batch}, by {timed} (torch.profiler):")
        print(format_profile(profile, args.steps - 1))
    if args.step_phases:
        from pdserve.bench.engine.step_phases import format_phases, time_decode_steps

        prefill(max_batch, args.steps)
        print(f"\npdserve decode steps at batch {max_batch}, by phase:")
        print(format_phases(time_decode_steps(engine, args.device)))
    if args.profile_out:
        # Mixed steps besides the table's uniform ones: prompts of varied lengths arriving
        # one per step share steps with the earlier ones' decodes, so the fit can tell the
        # per-token, per-sequence and per-context costs apart. Each runs --repeats times, as
        # the table does: the fit keeps the fastest of the same steps.
        params = SamplingParams(max_tokens=args.steps, ignore_eos=True)
        prompt_len = max(prompt_lens)
        for batch in batch_sizes:
            lengths = torch.randint(1, prompt_len + 1, (batch,), generator=gen).tolist()
            for _ in range(args.repeats):
                for prompt, length in zip(prompts(batch), lengths, strict=True):
                    engine.add_request(f"calibrate-{next(request_ids)}", prompt[:length], params)
                    engine.step()
                while engine.has_unfinished():
                    engine.step()
        notes = {"device": args.device, "model": model_dir, "dtype": args.dtype, "cpu": cpu}
        try:
            print(write_profile(recorder.samples, args.profile_out, **notes))
        except (OSError, ValueError) as e:
            raise SystemExit(f"--profile-out {args.profile_out}: {e}") from None
    return 0
