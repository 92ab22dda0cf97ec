"""Builds the receiver and sender of the configured transport (`KVTransferConfig.transport`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_transfer.base import KVLayout, KVReceiver, KVSender, KVSink
from pdserve.config import KVTransferConfig

if TYPE_CHECKING:
    import torch

TRANSPORTS = ("grpc", "collective", "nixl")


def make_receiver(
    config: KVTransferConfig,
    sink: KVSink,
    layout: KVLayout | None = None,
    kv_cache: torch.Tensor | None = None,
) -> KVReceiver:
    """Decode side. `layout` (KVLayout.of(engine.kv_cache)) lets the receiver reject chunks of
    the wrong model or dtype outright, and tells the collective transport the cache's device.
    `kv_cache` (the engine's cache) is what the nixl transport registers and reads into."""
    if config.transport == "grpc":
        from kv_transfer.grpc_receiver import GrpcKVReceiver

        return GrpcKVReceiver(config, sink, layout)
    if config.transport == "collective":
        from kv_transfer.collective_receiver import CollectiveKVReceiver

        return CollectiveKVReceiver(config, sink, layout)
    if config.transport == "nixl":
        from kv_transfer.nixl_receiver import NixlKVReceiver

        return NixlKVReceiver(config, sink, layout, kv_cache=kv_cache)
    raise ValueError(f"unknown KV transport {config.transport!r}; choose one of {TRANSPORTS}")


def make_sender(config: KVTransferConfig, kv_cache: torch.Tensor | None = None) -> KVSender:
    """Prefill side. `kv_cache` (the engine's cache) is what the nixl transport registers and
    lets the decode worker read from."""
    if config.transport == "grpc":
        from kv_transfer.grpc_sender import GrpcKVSender

        return GrpcKVSender(config)
    if config.transport == "collective":
        from kv_transfer.collective_sender import CollectiveKVSender

        return CollectiveKVSender(config)
    if config.transport == "nixl":
        from kv_transfer.nixl_sender import NixlKVSender

        return NixlKVSender(config, kv_cache)
    raise ValueError(f"unknown KV transport {config.transport!r}; choose one of {TRANSPORTS}")
