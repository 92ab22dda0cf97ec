"""`pdserve selftest`: the whole table at tiny size on CPU, and --device cuda without CUDA as a
one-line error."""

from __future__ import annotations

import re

import pytest
import torch

from pdserve.cli import main


def test_cpu_selftest_prints_one_table(capsys):
    code = main(
        ["selftest", "--device", "cpu", "--preset", "tiny", "--bench-steps", "4"]
        + ["--transfer-mb", "1", "--repeats", "1"]
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("pdserve selftest on cpu")

    def row(check: str) -> list[str]:
        line = next(line for line in lines[1:] if line.strip().startswith(check))
        return line.strip()[len(check) :].split()

    assert row("decode attention (tiny)") == ["in", "place", "C++", "kernel"]
    assert row("parity vs transformers (tiny)")[0] == "ok"
    assert row("compiled vs eager (tiny)")[0] == "ok"
    assert row("async scheduling vs not (tiny)")[0] == "ok"
    for transport in ("grpc", "collective"):
        rate, unit = row(f"kv transfer {transport}")[:2]
        assert float(rate) > 0 and unit == "MB/s"
    for batch in (1, 32):
        rate, unit, *detail = row(f"decode batch {batch} (tiny)")
        assert float(rate) > 0 and unit == "tok/s"
        assert re.fullmatch(r"compiled, async scheduling; one step at a time [\d.]+ tok/s "
                            r"\([\d.]+x\); eager [\d.]+ tok/s \([\d.]+x\)", " ".join(detail))  # fmt: skip
    # The largest batch's compiled step by phase; on CPU no wait for a GPU.
    step = " ".join(row("decode step batch 32 (tiny)"))
    assert re.fullmatch(r"[\d.]+ ms compiled, medians: model on the host [\d.]+, "
                        r"sampling [\d.]+, outputs [\d.]+ ms", step), step  # fmt: skip
    # the header, attention and parity, transfer, decode, the step's phases
    assert len(lines) == 1 + 4 + 2 + 2 + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_without_cuda_is_a_one_line_error(capsys):
    code = main(["selftest", "--device", "cuda"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.strip().count("\n") == 0 and "--device cuda" in err and "no CUDA" in err
