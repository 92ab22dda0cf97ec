"""`pdserve bench transfer`: KV-transfer GB/s against raw TCP on loopback, in one run.

For each transport asked for (nixl once per `--nixl-ucx-tls` value), a receiver process holds a
decode-side KV cache and serves both a KV endpoint and a plain TCP socket. The sender (this
process) moves the same bytes both ways, interleaved:
- raw TCP: `sendall` of a same-shaped contiguous tensor, `recv_into` a preallocated buffer,
  one-byte ack — the ceiling for a byte stream on this machine;
- the transport: a full transfer (read_kv gather, checksums, the bytes landing in the cache —
  sink.write_kv, or nixl's READ straight from the source cache into it — commit), timed until
  the commit returns;
- for nixl, also the bare-NIXL ceiling (`nixl_ceiling.py`): one region of the same size READ
  and WRITTEN by NIXL alone between the same two processes.
Prints the median GB/s over the repeats for each and its ratio to raw TCP, and the CPU seconds
both processes spent per GB moved (median): on a shared machine GB/s follows the load, CPU time
per GB much less, so it compares methods where wall time cannot. UCX variables in the
environment reach both processes (e.g. `UCX_TCP_TX_SEG_SIZE=8k UCX_TCP_RX_SEG_SIZE=64k`, UCX's
own defaults, instead of the 1 MiB segments `nixl_agent.UCX_TUNING` sets otherwise).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

MiB = 1 << 20
SECRET = "transfer-bench"
LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM, DTYPE = 32, 16, 8, 128, "float16"  # a Llama-8B-like cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-transport",
        nargs="+",
        choices=["grpc", "collective", "nixl"],
        default=["grpc"],
        help="transports to measure, each against raw TCP in the same run",
    )
    parser.add_argument(
        "--nixl-ucx-tls",
        nargs="+",
        default=["tcp"],
        help="UCX_TLS values nixl is measured with (e.g. tcp 'shm,tcp')",
    )
    parser.add_argument("--mb", type=int, default=256, help="KV bytes per transfer, in MiB")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers per method")
    parser.add_argument("--chunk-mb", type=float, default=4.0, help="target chunk size, in MiB")


def _num_blocks(mb: int) -> int:
    block_bytes = LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 2  # float16
    return max(1, mb * MiB // block_bytes)


def _config(args: argparse.Namespace, transport: str, ucx_tls: str | None) -> Any:
    from pdserve.config import KVTransferConfig

    return KVTransferConfig(
        transport=transport,
        nixl_ucx_tls=ucx_tls,
        secret=SECRET,
        bind_host="127.0.0.1",
        chunk_bytes=int(args.chunk_mb * MiB),
        reservation_timeout_s=120.0,
    )


class _CacheSink:
    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def write_kv(
        self, transfer_id: str, block_ids: list[int], layer_start: int, data: Any, head_start: int
    ) -> None:  # the bench sends every head: head_start is 0
        self.cache[layer_start : layer_start + data.shape[0], :, block_ids] = data

    def on_commit(self, transfer_id: str, commit: Any) -> None:
        pass

    def on_expired(self, transfer_id: str) -> None:
        pass


def _receiver_main(conn: Any, mb: float, config: Any) -> None:
    """Child process: KV endpoint + raw TCP sink; answers `open` requests over `conn`."""
    import torch

    from kv_transfer import KVLayout, make_receiver

    blocks = _num_blocks(mb)
    cache = torch.zeros(LAYERS, 2, blocks, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.float16)
    receiver = make_receiver(config, _CacheSink(cache), KVLayout.of(cache), cache)
    endpoint = receiver.start()
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send((endpoint, listener.getsockname()[1]))
    tcp, _ = listener.accept()
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    landing = torch.empty_like(cache).view(-1).view(torch.uint8)
    buffer = memoryview(landing.numpy())
    ceiling = None
    while True:
        command = conn.recv()
        if command == "ceiling":
            from pdserve.bench.transfer.nixl_ceiling import Peer

            ceiling = Peer(conn, config.nixl_ucx_tls, landing)
        elif command == "progress" and ceiling is not None:
            ceiling.progress()
        elif command == "open":
            conn.send(receiver.open(list(range(blocks))))
        elif command == "tcp":
            received = 0
            while received < buffer.nbytes:
                received += tcp.recv_into(buffer[received:])
            tcp.sendall(b"k")
        else:
            break
    tcp.close()
    if ceiling is not None:
        ceiling.close()
    receiver.stop()


def _reply(conn: Any, proc: Any) -> Any:
    """The receiver process's next answer; raises if it died instead of answering."""
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"the receiver process exited ({proc.exitcode}) without answering")
    return conn.recv()


_LABELS = {"tcp": "raw TCP", "kv": "transport", "READ": "bare READ", "WRITE": "bare WRITE"}


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) of this process and of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    own = os.times()
    return own.user + own.system + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _variants(args: argparse.Namespace) -> list[tuple[str, str, str | None]]:
    """(label, transport, UCX_TLS) of every measurement asked for."""
    variants = []
    for transport in dict.fromkeys(args.kv_transport):
        if transport == "nixl":
            variants += [(f"nixl ({tls})", "nixl", tls) for tls in args.nixl_ucx_tls]
        else:
            variants.append((transport, transport, None))
    return variants


def _measure(
    args: argparse.Namespace, config: Any, src: Any
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall seconds, CPU seconds of both processes) per raw-TCP send ("tcp"), per transfer
    ("kv") and, for nixl, per bare READ and WRITE ("READ", "WRITE"), interleaved, against a
    fresh receiver."""
    import torch

    from kv_transfer import CommitInfo, TransferRequest, make_sender

    block_ids = list(range(src.shape[2]))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    # Only the size crosses: the parsed arguments hold the CLI parser's own (unpicklable) objects.
    proc = ctx.Process(target=_receiver_main, args=(child, args.mb, config), daemon=True)
    proc.start()
    endpoint, tcp_port = _reply(parent, proc)
    tcp = socket.create_connection(("127.0.0.1", tcp_port))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sender = make_sender(config, src)  # nixl: the decode side reads from it

    index = torch.tensor(block_ids)

    def read_kv(ids: list[int], l0: int, l1: int) -> torch.Tensor:
        # The engine's gather; index_select is ~4x faster than `src[l0:l1, :, ids]` on CPU.
        return src[l0:l1].index_select(2, index)

    def one_transfer() -> float:
        parent.send("open")
        tid = _reply(parent, proc)
        start = time.perf_counter()
        sender.send(
            TransferRequest(endpoint, tid, block_ids, LAYERS, read_kv, CommitInfo(first_token_id=1))
        )
        return time.perf_counter() - start

    raw = memoryview(src.view(-1).view(torch.uint8).numpy())

    def one_tcp() -> float:
        parent.send("tcp")
        start = time.perf_counter()
        tcp.sendall(raw)
        tcp.recv(1)
        return time.perf_counter() - start

    methods = {"tcp": one_tcp, "kv": one_transfer}
    ceiling = None
    try:
        if config.transport == "nixl":
            from pdserve.bench.transfer.nixl_ceiling import OPERATIONS, Ceiling

            ceiling = Ceiling(parent, config.nixl_ucx_tls, src.view(-1).view(torch.uint8))
            ceiling.connect(_reply(parent, proc))
            methods |= {op: lambda op=op: ceiling.seconds(op) for op in OPERATIONS}
        for method in methods.values():  # warm-up: connections, process group, page faults
            method()
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        cpu: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.repeats):  # interleaved, so drift in the machine hits all alike
            for name, method in methods.items():
                cpu_before = _cpu_seconds(proc.pid)
                seconds[name].append(method())
                cpu[name].append(_cpu_seconds(proc.pid) - cpu_before)
    finally:
        if ceiling is not None:
            ceiling.close()
        parent.send("stop")
        sender.close()
        tcp.close()
        proc.join(timeout=10)
    return seconds, cpu


def run(args: argparse.Namespace) -> int:
    import torch

    blocks = _num_blocks(args.mb)
    src = torch.randn(LAYERS, 2, blocks, BLOCK_SIZE, HEADS, HEAD_DIM).to(torch.float16)
    nbytes = src.nbytes
    print(
        f"KV transfer: {nbytes / MiB:.0f} MiB per transfer ({LAYERS} layers x {blocks} blocks of "
        f"{BLOCK_SIZE} tokens, {DTYPE}), chunk {args.chunk_mb:g} MiB, median of {args.repeats}"
    )
    if "nixl" in args.kv_transport:
        from kv_transfer.nixl_agent import UCX_TUNING

        chosen = {k: v for k, v in os.environ.items() if k in UCX_TUNING} or UCX_TUNING
        print("  nixl UCX settings: " + " ".join(f"{k}={v}" for k, v in chosen.items()))
    for label, transport, ucx_tls in _variants(args):
        seconds, cpu = _measure(args, _config(args, transport, ucx_tls), src)
        gbps = {name: _median_gbps(nbytes, s) for name, s in seconds.items()}
        cpu_per_gb = {name: statistics.median(c) / (nbytes / 1e9) for name, c in cpu.items()}
        line = (
            f"  {label:<16} : {gbps['kv']:6.2f} GB/s   raw TCP {gbps['tcp']:6.2f} GB/s   "
            f"ratio {gbps['kv'] / gbps['tcp']:.2f}"
        )
        if "READ" in gbps:
            line += (
                f"   bare NIXL READ {gbps['READ']:.2f} ({gbps['READ'] / gbps['tcp']:.2f}), "
                f"WRITE {gbps['WRITE']:.2f} ({gbps['WRITE'] / gbps['tcp']:.2f}) GB/s"
            )
        print(line, flush=True)
        print(
            f"  {'':<16}   CPU s/GB, both processes: "
            + ", ".join(f"{_LABELS[name]} {value:.2f}" for name, value in cpu_per_gb.items()),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
