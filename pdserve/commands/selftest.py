"""`pdserve selftest --device cuda|cpu`: the checks a lent GPU is for, in minutes, as one table.

- parity: pdserve's greedy tokens equal transformers' on the built-in model (and `--model`);
- compiled: the `--compile` decode fast path (gpu_step/compiled_decode.py) equals the eager engine,
  and with async scheduling (engine/gpu_step/overlapped_steps.py) equals it stepping one at a time;
- kv transfer: a loopback transfer over each transport available here (grpc, collective,
  nixl when importable) in MB/s, by `pdserve bench transfer`'s measurement (host-memory caches);
- decode: tok/s of the compiled engine with async scheduling and stepping one at a time (one
  engine, the two alternated), and of the eager engine, at batch 1 and 32 (--bench-batches),
  and where a compiled step of the largest batch goes (bench/step_phases.py): on a GPU, the
  host's part against the wait for the GPU.
Exits 1 when a parity check fails; `--device cuda` without CUDA is a one-line error.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from typing import Any

from pdserve.commands import CommandError
from pdserve.models.presets import WEIGHT_PRESETS

PROMPT_LENGTHS = (5, 17, 33)
PARITY_TOKENS = 8
BENCH_PROMPT_LEN = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", required=True, choices=("cpu", "cuda"), help="where to run")
    parser.add_argument(
        "--preset",
        choices=WEIGHT_PRESETS,
        default="small",
        help="built-in model for parity and the bench (default: small)",
    )
    parser.add_argument("--model", default=None, help="also check parity on this HF model dir")
    parser.add_argument(
        "--bench-batches",
        default="1,32",
        help="comma-separated batch sizes of the decode bench (default: 1,32)",
    )
    parser.add_argument(
        "--bench-steps", type=int, default=32, help="decode steps per bench run (default: 32)"
    )
    parser.add_argument(
        "--transfer-mb", type=int, default=64, help="KV MiB per transfer (default: 64)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="transfers per transport (default: 3)"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    from pdserve.models.builtin import builtin_model_dir

    print(f"pdserve selftest on {_device_name(args.device)}", flush=True)
    ok = True
    builtin = str(builtin_model_dir(args.preset))
    models = [(args.preset, builtin)] + ([("--model", args.model)] if args.model else [])
    for label, model_dir in models:
        expected = _transformers_greedy(model_dir, args.device)
        eager, in_place = _engine_greedy(model_dir, args.device, compiled=False)
        compiled, _ = _engine_greedy(model_dir, args.device, compiled=True)
        overlapped, _ = _engine_greedy(model_dir, args.device, compiled=True, overlap=True)
        # Which decode attention the checks ran: the kernel of the device, or the gather.
        kernel = "C++ kernel" if args.device == "cpu" else "Triton kernel"
        _row(
            f"decode attention ({label})",
            *(("in place", kernel) if in_place else ("gathered", "gather + SDPA")),
        )
        checks = (
            ("parity vs transformers", eager, expected),
            ("compiled vs eager", compiled, eager),
            ("async scheduling vs not", overlapped, compiled),
        )
        for check, got, reference in checks:
            same = sum(a == b for a, b in zip(got, reference, strict=True))
            ok &= same == len(reference)
            verdict = "ok" if same == len(reference) else "FAIL"
            detail = f"{same}/{len(reference)} prompts equal, {PARITY_TOKENS} greedy tokens"
            _row(f"{check} ({label})", verdict, detail)
    for transport, mb_s, tcp_mb_s in _transfer_rates(args):
        _row(f"kv transfer {transport}", f"{mb_s:.0f} MB/s", f"raw TCP {tcp_mb_s:.0f}")
    batches = [int(b) for b in args.bench_batches.split(",")]
    for batch in batches:
        eager_rate = _decode_rates(builtin, args, batch, compiled=False)[0][False]
        rates, phases = _decode_rates(
            builtin, args, batch, compiled=True, phases=batch == max(batches)
        )
        compiled_rate, overlapped_rate = rates[False], rates[True]
        _row(
            f"decode batch {batch} ({args.preset})",
            f"{overlapped_rate:.0f} tok/s",
            f"compiled, async scheduling; one step at a time {compiled_rate:.0f} tok/s "
            f"({overlapped_rate / compiled_rate:.2f}x); eager {eager_rate:.0f} tok/s "
            f"({overlapped_rate / eager_rate:.2f}x)",
        )
        if phases is not None:
            _row(f"decode step batch {batch} ({args.preset})", *_phases_row(phases))
    return 0 if ok else 1


def _phases_row(phases: Any) -> tuple[str, str]:
    """A compiled step's median wall time, and its phases' medians (step_phases.py)."""

    def ms(phase: str) -> float:
        return phases.median(phase) * 1e3

    parts = [("model (host)", "model on the host"), ("waiting for the GPU", "GPU wait"),
             ("sampling", "sampling"), ("outputs", "outputs")]  # fmt: skip
    shown = [f"{label} {ms(phase):.3f}" for phase, label in parts if ms(phase) > 0]
    return f"{ms('wall'):.3f} ms", "compiled, medians: " + ", ".join(shown) + " ms"


def _row(check: str, result: str, detail: str) -> None:
    """One line of the table, printed as soon as it is known: a check that crashes or runs
    out of time later still leaves the earlier results on a lent machine's log."""
    print(f"  {check:<32}  {result:>12}  {detail}", flush=True)


def _device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({torch.get_num_threads()} threads)"


def _prompts(vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _engine(
    model_dir: str, device: str, compiled: bool, max_num_seqs: int = 64, overlap: bool = False
) -> Any:
    """An engine stepping one at a time, or with `overlap` with async scheduling."""
    import gc

    from pdserve.engine.engine import LLMEngine
    from pdserve.engine_config import EngineConfig

    gc.collect()  # the previous check's engine and its KV pool
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
    config = EngineConfig(
        model=model_dir,
        device=device,
        compile=compiled,
        async_scheduling=overlap,
        max_num_seqs=max_num_seqs,
        kv_cache_bytes=256 * 2**20,  # CPU
        gpu_memory_utilization=0.5,  # CUDA: sized by a profiled step (gpu_step/memory_profile.py)
    )
    return LLMEngine(config)


def _engine_greedy(
    model_dir: str, device: str, compiled: bool, overlap: bool = False
) -> tuple[list[list[int]], bool]:
    """The engine's greedy tokens, and whether its decode rows read the KV blocks in place."""
    from pdserve.core.sampling_params import SamplingParams

    engine = _engine(model_dir, device, compiled, overlap=overlap)
    params = SamplingParams(max_tokens=PARITY_TOKENS, ignore_eos=True)
    tokens = engine.generate(_prompts(engine.model.config.vocab_size), params)
    return tokens, engine.executor.runner.reads_kv_in_place


def _transformers_greedy(model_dir: str, device: str) -> list[list[int]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.to(device).eval()
    outputs = []
    for prompt in _prompts(model.config.vocab_size):
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=PARITY_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _transfer_rates(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    """(transport, MB/s, raw TCP MB/s) of a loopback transfer over each transport available."""
    import torch

    from pdserve.bench.transfer import transfer_bench

    transports = ["grpc", "collective"]
    if importlib.util.find_spec("nixl") is not None:
        transports.append("nixl")
    bench_args = argparse.Namespace(
        mb=args.transfer_mb,
        repeats=args.repeats,
        chunk_mb=4.0,
        kv_transport=transports,
        nixl_ucx_tls=["tcp"],
    )
    shape = (transfer_bench.LAYERS, 2, transfer_bench._num_blocks(args.transfer_mb))
    shape += (transfer_bench.BLOCK_SIZE, transfer_bench.HEADS, transfer_bench.HEAD_DIM)
    src = torch.randn(shape).to(torch.float16)
    rates = []
    for label, transport, tls in transfer_bench._variants(bench_args):
        config = transfer_bench._config(bench_args, transport, tls)
        seconds, _cpu = transfer_bench._measure(bench_args, config, src)
        mb_s = {
            name: transfer_bench._median_gbps(src.nbytes, s) * 1e3 for name, s in seconds.items()
        }
        rates.append((label, mb_s["kv"], mb_s["tcp"]))
    return rates


def _decode_rates(
    model_dir: str, args: argparse.Namespace, batch: int, compiled: bool, phases: bool = False
) -> tuple[dict[bool, float], Any]:
    """Decode tok/s of `batch` requests, from every one having its first token to all having
    bench_steps more: {False: stepping one at a time, True: with async scheduling (compiled
    engines only)}. One engine: a first round compiles and warms up, then the modes alternate
    over two rounds each and each keeps its faster round (a lent machine's host is noisy from
    run to run). With `phases` a last round's decode steps are timed by phase (a StepPhases,
    else None)."""
    import torch

    from pdserve.bench.engine.step_phases import time_decode_steps
    from pdserve.core.sampling_params import SamplingParams

    engine = _engine(model_dir, args.device, compiled, max_num_seqs=batch)
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=args.bench_steps + 1, ignore_eos=True)
    modes = (False, True) if compiled else (False,)
    rates = dict.fromkeys(modes, 0.0)
    rounds = [False, *modes, *modes] + (["phases"] if phases else [])
    timed = None
    for attempt, mode in enumerate(rounds):
        for i in range(batch):
            prompt = torch.randint(3, vocab, (BENCH_PROMPT_LEN,), generator=gen).tolist()
            engine.add_request(f"selftest-{attempt}-{i}", prompt, params)
        started: set[str] = set()
        while len(started) < batch:
            started.update(out.request_id for out in engine.step())
        if mode == "phases":  # timers on: the rates above were measured without them
            timed = time_decode_steps(engine, args.device)
            break
        engine.async_scheduling = mode
        begin = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        if attempt:  # the first round compiled and warmed up
            rates[mode] = max(rates[mode], batch * args.bench_steps / (time.perf_counter() - begin))
    return rates, timed
