"""Workloads: presets from the benchmark generators, JSONL files, and the probe sample."""

from __future__ import annotations

import pytest

from pdserve.planner.workload import (
    PlanRequest,
    WorkloadError,
    load_workload,
    probe_sample,
    read_jsonl,
)


def test_presets_differ_the_way_their_names_say():
    chat, rag = load_workload("chat", 300), load_workload("rag", 300)
    mixed = load_workload("mixed", 300)
    assert max(r.prompt_len for r in chat) < min(r.prompt_len for r in rag)
    assert {r.tag for r in mixed} == {"chat", "rag"}
    assert load_workload("chat", 300) == chat  # the same seed names the same workload


def test_jsonl_lines_are_lists_or_objects(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('[10, 5, 0.0]\n\n{"prompt_len": 20, "output_len": 6, "arrival": 0.5}\n')
    assert read_jsonl(path) == [PlanRequest(10, 5, 0.0), PlanRequest(20, 6, 0.5)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[10]\n", ":1: expected [prompt_len, output_len[, arrival]] or an object"),
        ("[10, 5]\n[1, 2, -1]\n", ":2: arrival must be a number of seconds >= 0, got -1"),
        ('{"prompt": 3, "output_len": 1}\n', ":1: unknown key 'prompt'"),
        ("[10, 5, 1.0]\n[10, 5]\n", ": arrival given for 1 of 2 requests"),
        ("not json\n", ":1: not JSON"),
        ("\n", ": no requests"),
    ],
)
def test_malformed_files_name_the_line(tmp_path, text, message):
    path = tmp_path / "w.jsonl"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=".*") as error:
        read_jsonl(path)
    assert f"{path}{message}" in str(error.value)


def test_a_timed_trace_keeps_its_gaps_scaled_to_a_mean_of_one():
    trace = [PlanRequest(8, 2, t) for t in (3.0, 1.0, 2.0, 5.0)]
    sample = probe_sample(trace, 3)
    assert [r.unit_arrival for r in sample] == [0.0, 1.0, 2.0]  # the first three, in order
    assert all(len(r.prompt) == 8 for r in sample)


def test_an_untimed_sample_arrives_as_a_poisson_process():
    sample = probe_sample([PlanRequest(4, 1)] * 2000, 2000, seed=5)
    arrivals = [r.unit_arrival for r in sample]
    assert arrivals == sorted(arrivals)
    assert arrivals[-1] / len(arrivals) == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_a_sample_of_the_mixed_preset_keeps_its_mix(seed):
    # The preset places its rag prompts with the first permutation of `default_rng(seed)`; a
    # sample drawn from that same stream picked exactly those places (it was all rag).
    sample = probe_sample(load_workload("mixed", 3000, seed), 1000, seed)
    rag = sum(r.tag == "rag" for r in sample) / len(sample)
    assert 0.25 <= rag <= 0.35
