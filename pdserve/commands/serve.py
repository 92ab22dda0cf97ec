"""`pdserve serve`: start (or join) Ray, create the prefill and decode pools, serve the gRPC API.

With no flags it runs everything on this machine: a local Ray, a private redis-server and the
built-in tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from pdserve.config import EngineConfig, KVTransferConfig, RouterConfig, ServeConfig

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment")
    g.add_argument("--model", help="Hugging Face model directory (default: built-in tiny model)")
    g.add_argument("--prefill-workers", type=int, default=1)
    g.add_argument("--decode-workers", type=int, default=1)
    g.add_argument(
        "--ray-address",
        help="join this Ray cluster ('auto' = the running one); default: start a local Ray",
    )
    g.add_argument(
        "--redis-url",
        help="prefix index Redis (redis://, rediss://, with "
        "password); default: start a private redis-server",
    )
    g.add_argument("--gpus-per-worker", type=float, default=0.0)
    g.add_argument("--cpus-per-worker", type=float, default=0.0)
    g.add_argument("--prefill-pool-resource", default="prefill_pool")
    g.add_argument("--decode-pool-resource", default="decode_pool")
    g = p.add_argument_group("router")
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=50051)
    g.add_argument("--policy", choices=["cost", "round_robin", "least_loaded"], default="cost")
    g.add_argument("--disaggregate", choices=["auto", "always", "never"], default="auto")
    g.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    g.add_argument("--tpot-slo-ms", type=float, default=100.0)
    g.add_argument("--max-pending-requests", type=int, default=256)
    g.add_argument("--max-retries", type=int, default=2)
    g.add_argument(
        "--metrics-port",
        type=int,
        help="the router's Prometheus endpoint, 0 = any "
        "free port (default: off; workers: env PDSERVE_WORKER_METRICS_PORT)",
    )
    g.add_argument("--log-format", choices=["text", "json"], default="text")
    g.add_argument("--log-level", default="INFO")
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (overrides MiB)")
    g.add_argument("--kv-cache-mb", type=int, default=256, help="KV pool size in MiB")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--num-threads", type=int, help="torch threads per worker")
    g = p.add_argument_group("KV transfer")
    g.add_argument("--kv-transport", choices=["grpc", "collective"], default="grpc")
    g.add_argument("--kv-advertise-host", help="host other workers dial (default: node IP)")
    g.add_argument("--reservation-timeout-s", type=float, default=30.0)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_bytes=args.kv_cache_mb * MiB,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.num_threads,
    )
    kv = KVTransferConfig(
        transport=args.kv_transport,
        advertise_host=args.kv_advertise_host,
        reservation_timeout_s=args.reservation_timeout_s,
    )
    router = RouterConfig(
        host=args.host,
        port=args.port,
        policy=args.policy,
        disaggregate=args.disaggregate,
        ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms,
        max_pending_requests=args.max_pending_requests,
        max_retries=args.max_retries,
    )
    return ServeConfig(
        engine=engine,
        kv=kv,
        router=router,
        prefill_workers=args.prefill_workers,
        decode_workers=args.decode_workers,
        ray_address=args.ray_address,
        prefill_pool_resource=args.prefill_pool_resource,
        decode_pool_resource=args.decode_pool_resource,
        gpus_per_worker=args.gpus_per_worker,
        cpus_per_worker=args.cpus_per_worker,
        redis_url=args.redis_url,
        metrics_port=args.metrics_port,
        log_format=args.log_format,
        log_level=args.log_level,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from pdserve.logging_setup import setup_logging

    setup_logging(config.log_level, config.log_format)
    return asyncio.run(_serve(config))


async def _serve(config: ServeConfig) -> int:
    from pdserve.app import ServingApp

    app = ServingApp(config, advertise_redis_url=True)
    stop = asyncio.Event()
    try:
        await app.start()
        # After start: ray.init installs its own SIGTERM handler, which would kill us uncleanly.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(
            f"pdserve serving on port {app.port} "
            f"({config.prefill_workers} prefill, {config.decode_workers} decode workers); "
            f"Ctrl-C to stop",
            flush=True,
        )
        await stop.wait()
    finally:
        await app.stop()
    return 0
