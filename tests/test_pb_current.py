"""The committed protobuf modules are exactly what protoc makes from protos/ today."""

from __future__ import annotations

from pathlib import Path

from pdserve.pb.regen import PB_DIR, generate


def test_generated_code_is_current(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert {p.name for p in written} >= {"generate_pb2.py", "kv_transfer_pb2_grpc.py"}
    for fresh in written:
        committed = PB_DIR / fresh.name
        assert committed.exists(), f"{fresh.name} is missing: run python -m pdserve.pb.regen"
        assert committed.read_text() == fresh.read_text(), (
            f"{fresh.name} is stale: run python -m pdserve.pb.regen"
        )
