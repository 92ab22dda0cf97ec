import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.models.tokenizer_builder import BOS_TOKEN_ID, EOS_TOKEN_ID, write_tokenizer
from pdserve.tokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Tokenizer

VOCAB = 512
REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLES = [
    "Hello, world!",
    "Café naïve — crème brûlée in Zürich.",
    "你好，世界！今天天气很好。",
    "Rockets 🚀🚀 and a 🐍 wrote this.",
    "  leading spaces\n\ttabs and\nnew lines  ",
    "<s>literal specials</s>",
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, VOCAB)
    config = {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "vocab_size": VOCAB}
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


def test_encode_adds_bos_and_round_trips(tok):
    assert tok.bos_token_id == BOS_TOKEN_ID
    assert tok.eos_token_ids == [EOS_TOKEN_ID]
    assert tok.vocab_size == VOCAB
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids[0] == BOS_TOKEN_ID
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        # The literal "<s>" in a prompt is the special token, as in transformers.
        expected = text.replace("<s>", "").replace("</s>", "")
        assert tok.decode(ids) == expected
    assert tok.id_to_token(BOS_TOKEN_ID) == "<s>"


@pytest.mark.parametrize("vocab_size", [512, 8192])
def test_vocab_size_is_exact(tmp_path, vocab_size):
    write_tokenizer(tmp_path, vocab_size)
    assert Tokenizer.from_dir(tmp_path).vocab_size == vocab_size


def test_tokenizer_is_byte_for_byte_deterministic_across_processes(tmp_path):
    # Separate processes with different hash seeds: Rust and Python hash maps are seeded
    # per process, so this is where nondeterminism would show.
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        code = f"from pdserve.models.tokenizer_builder import write_tokenizer as w; w({str(out)!r}, 600)"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT)
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outputs[0] == outputs[1]
    assert set(outputs[0]) == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


def test_matches_transformers_autotokenizer(model_dir, tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    assert len(hf) == tok.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    for text in SAMPLES:
        for special in (True, False):
            ids = tok.encode(text, add_special_tokens=special)
            assert hf(text, add_special_tokens=special)["input_ids"] == ids
            for skip in (True, False):
                assert hf.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip)


def test_special_token_ids_come_from_model_configs(model_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    # No config.json: ids come from tokenizer_config.json's token strings.
    t = Tokenizer.from_dir(tmp_path)
    assert (t.bos_token_id, t.eos_token_ids) == (BOS_TOKEN_ID, [EOS_TOKEN_ID])
    # generation_config.json may list several eos ids (chat models); all of them stop.
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": EOS_TOKEN_ID}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1]}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == [EOS_TOKEN_ID, 7]


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_stream_never_splits_a_multibyte_character(tok):
    text = "你好 🚀 Zürich"
    ids = tok.encode(text, add_special_tokens=False)
    # The small vocabulary splits these characters across tokens, which is the case at hand.
    assert len(ids) > len(text)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:"))
    deltas = stream(detok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    assert detok.text == text and detok.output_ids == ids


def test_stop_string_truncates_output_and_ends_the_stream(tok):
    ids = tok.encode("The answer is 42.\nQuestion: next", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [BOS_TOKEN_ID], stop=["\nQuestion:"])
    text = "".join(stream(detok, ids))
    assert text == "The answer is 42."
    assert detok.stopped == "\nQuestion:"
    assert detok.add(tok.encode(" more", add_special_tokens=False)) == ""
    assert detok.flush() == ""


def test_possible_stop_prefix_is_held_back_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert detok.add(tok.encode("go ST", add_special_tokens=False)) == "go "
    assert detok.add(tok.encode("x", add_special_tokens=False)) == "STx"
    assert detok.add(tok.encode(" ST", add_special_tokens=False)) == " "
    assert detok.flush() == "ST"
    assert detok.stopped is None


TEXT_ALPHABET = st.sampled_from(list("ab c\né你🚀"))


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=40),
    chunk=st.integers(1, 4),
    skip=st.booleans(),
)
def test_deltas_concatenate_to_the_full_decode(tok, ids, chunk, skip):
    detok = IncrementalDetokenizer(tok, tok.encode("你好"), skip_special_tokens=skip)
    deltas = stream(detok, ids, chunk)
    # A U+FFFD may only be emitted once a later character shows it is not a split char.
    assert all(not d.endswith(REPLACEMENT_CHAR) for d in deltas)
    assert "".join(deltas) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(TEXT_ALPHABET, max_size=30),
    stops=st.lists(st.text(TEXT_ALPHABET, min_size=1, max_size=4), max_size=3),
    chunk=st.integers(1, 3),
)
def test_output_ends_before_the_first_completed_stop_string(tok, text, stops, chunk):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [BOS_TOKEN_ID], stop=stops)
    out = "".join(stream(detok, ids, chunk)) + detok.flush()
    # The stop that completes first (smallest end; the longest on a tie) wins.
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        assert out == text and detok.stopped is None
    else:
        end, neg_len, stop = min(found)
        assert detok.stopped == stop
        assert out == text[: end + neg_len]
