"""Text <-> token ids for a model directory, and streaming detokenization with stop strings.

`Tokenizer` wraps a Hugging Face `tokenizer.json` (the `tokenizers` library, no torch) and
matches `transformers.AutoTokenizer` on encode and decode. `IncrementalDetokenizer` turns
the token ids a request produces into text deltas for streaming.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

# What a byte-level decoder yields for an incomplete UTF-8 sequence.
REPLACEMENT_CHAR = "\ufffd"
# Tokens of prompt context decoded with each new token, like vLLM: some decoders (Metaspace,
# sentencepiece) render a token differently at the start of a text than after other tokens.
_PROMPT_CONTEXT_TOKENS = 5


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _token_content(value: str | dict | None) -> str | None:
    """tokenizer_config.json writes a special token as a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """The tokenizer of one model directory.

    Special-token ids come from config.json, then generation_config.json, then
    tokenizer_config.json; `eos_token_ids` is the union because chat models stop on several
    (Llama 3 instruct lists three in generation_config.json).
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids: list[int] = list(eos_token_ids)
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {model_dir}: pdserve needs a Hugging Face fast tokenizer "
                "file next to the weights (`pdserve make-model` writes one)"
            )
        tok = HFTokenizer.from_file(str(path))
        model_cfg = _read_json(model_dir / "config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")

        def token_id(key: str) -> list[int]:
            content = _token_content(tok_cfg.get(key))
            tid = tok.token_to_id(content) if content else None
            return [] if tid is None else [tid]

        bos = (
            _as_id_list(model_cfg.get("bos_token_id"))
            + _as_id_list(gen_cfg.get("bos_token_id"))
            + token_id("bos_token")
        )
        eos_all = (
            _as_id_list(model_cfg.get("eos_token_id"))
            + _as_id_list(gen_cfg.get("eos_token_id"))
            + token_id("eos_token")
        )
        eos = list(dict.fromkeys(eos_all))
        _apply_bos_eos_flags(tok, tok_cfg)
        return cls(tok, bos[0] if bos else None, eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast (same ids as encode) releases the GIL: a long text tokenized on a
        # worker thread then leaves the caller's event loop running. "fast": no character
        # offsets, which took 4x the time and, freed under the GIL, stalled the caller's loop
        # (a 4 MiB text: 10.3 -> 2.4 s, and 160 -> 8 ms holding the GIL).
        encoded = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return encoded[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


def _apply_bos_eos_flags(tok: HFTokenizer, tok_cfg: dict[str, Any]) -> None:
    """Mirrors transformers' `TokenizersBackend`: explicit `add_bos_token`/`add_eos_token`
    in tokenizer_config.json (or no post-processor at all) replace the tokenizer.json
    post-processor with one that adds exactly those tokens."""
    explicit = "add_bos_token" in tok_cfg or "add_eos_token" in tok_cfg
    if not explicit and tok.post_processor is not None:
        return
    bos = _token_content(tok_cfg.get("bos_token"))
    eos = _token_content(tok_cfg.get("eos_token"))
    bos_id = tok.token_to_id(bos) if bos else None
    eos_id = tok.token_to_id(eos) if eos else None
    add_bos = bool(tok_cfg.get("add_bos_token")) and bos_id is not None
    add_eos = bool(tok_cfg.get("add_eos_token")) and eos_id is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    special = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )


class IncrementalDetokenizer:
    """Streams one request's output text, a delta per `add()`.

    Invariants, for the text emitted so far (concatenated deltas):
    - it never ends inside a multi-byte character: while the decoded window ends with
      U+FFFD the tokens are held back (byte-level BPE splits characters across tokens);
    - it never ends with a proper prefix of a stop string, so a stop string is always found
      whole in the not-yet-emitted text and never has to be taken back;
    - with no stop string matched, deltas + `flush()` == `tokenizer.decode(output_ids)`
      (for decoders where a token's text does not depend on its predecessors, such as
      byte-level BPE).

    Cost per call is a decode of the few tokens since the last emitted character
    (`prefix_offset`/`read_offset`, as in vLLM), not of the whole output.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        # Stop strings are looked for only in the text of tokens after the first min_tokens
        # (vLLM's min_tokens); the text before is emitted as it comes.
        self._min_tokens = min_tokens
        self._skip = skip_special_tokens
        self._stops = [s for s in dict.fromkeys(stop) if s]
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = list(prompt_ids)
        self._num_prompt = len(self._ids)
        # Window [prefix_offset, read_offset) is text already accounted for: it gives the
        # decoder its context, and its decoded length is where the new text starts.
        self._read_offset = len(self._ids)
        self._prefix_offset = max(len(self._ids) - _PROMPT_CONTEXT_TOKENS, 0)
        if self._decode(self._prefix_offset, self._read_offset).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character; give its output no context rather than
            # a window whose text the next token would rewrite.
            self._prefix_offset = self._read_offset
        self._pending = ""  # decoded text not yet emitted (a possible stop-string start)
        self.stopped: str | None = None
        self.text = ""  # everything emitted so far

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_prompt :]

    def add(self, new_ids: Sequence[int]) -> str:
        """Appends output token ids and returns the text that is now safe to emit."""
        if self.stopped is not None:
            return ""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._pending += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Returns the held-back text at the end of the request (a trailing partial
        character decodes as U+FFFD, exactly as a full decode would show it)."""
        if self.stopped is not None:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        self._pending += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        return self._emit(final=True)

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _emit(self, final: bool) -> str:
        pending = self._pending
        if len(self._ids) - self._num_prompt <= self._min_tokens:
            self._pending = ""
            self.text += pending
            return pending
        match = self._find_stop(pending)
        if match is not None:
            index, self.stopped = match
            out, self._pending = pending[:index], ""
        else:
            keep = 0 if final else self._partial_stop_len(pending)
            out, self._pending = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that completes first in `text` (the longest on a tie), as
        (start index, stop). Choosing by end, not start, makes the result independent of
        how many characters each token happens to add."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stops:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._max_stop_len - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
