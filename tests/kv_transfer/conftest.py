from __future__ import annotations

import pytest
import torch

from kv_transfer import KVLayout, make_receiver, make_sender
from pdserve.config import KVTransferConfig
from tests.kv_transfer.kv_helpers import TensorSink, make_cache

SECRET = "test-secret"


@pytest.fixture
def layer_bytes() -> int:
    """Bytes of one layer of 3 blocks: chunk_bytes of this size gives one chunk per layer."""
    return make_cache(0)[0:1, :, [0, 1, 2]].nbytes


@pytest.fixture
def config(layer_bytes: int) -> KVTransferConfig:
    return KVTransferConfig(
        transport="grpc", secret=SECRET, bind_host="127.0.0.1", chunk_bytes=layer_bytes
    )


@pytest.fixture
def sink() -> TensorSink:
    return TensorSink(make_cache(None))


@pytest.fixture
def receiver(config: KVTransferConfig, sink: TensorSink):
    receiver = make_receiver(config, sink, KVLayout.of(sink.cache))
    receiver.start()
    yield receiver
    receiver.stop()


@pytest.fixture
def sender(config: KVTransferConfig):
    sender = make_sender(config)
    yield sender
    sender.close()


@pytest.fixture
def src_cache() -> torch.Tensor:
    return make_cache(1)
