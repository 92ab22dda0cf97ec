"""Writes the tokenizer of the built-in tiny model: a byte-level BPE trained offline.

The engine never downloads anything, so `pdserve make-model` needs a real tokenizer it can
build from nothing. This one is trained with the `tokenizers` library on a small corpus
embedded below and written in the Hugging Face layout (`tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json`), so both `pdserve.tokenizer.Tokenizer`
and `transformers.AutoTokenizer` load the directory.

Byte-level means every byte has a token: any text encodes (no `<unk>`), and multi-byte
UTF-8 characters may be split across tokens, which the incremental detokenizer must handle.
The output is byte-for-byte deterministic for a given `vocab_size`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
# Special tokens take the first ids, in this order; the model writer copies these ids into
# config.json and generation_config.json.
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
PAD_TOKEN_ID = 2
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
# 3 special tokens + the 256 byte tokens; merges come after.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
MODEL_MAX_LENGTH = 1 << 20

# Varied English plus accents, CJK, Cyrillic, Greek, Arabic and emoji, so that learned
# merges include multi-byte characters and some tokens hold only part of a character.
CORPUS = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Once upon a time, in a small village by the sea, there lived an old fisherman and his wife.
Every morning he rowed out past the harbour wall, and every evening he came home with fish.
Large language models generate text one token at a time; each new token depends on all before.
Prefill processes the whole prompt at once, while decode produces tokens step by step.
The key-value cache stores attention keys and values so that earlier tokens need no recompute.
Disaggregated serving runs prefill and decode on separate workers and ships the cache between.
A router decides which worker serves each request, balancing time to first token and throughput.
Please summarize the following article in three sentences, and list the main people involved.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many legs does a spider have? Answer: A spider has eight legs.
def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a
for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }  // count from zero to nine
SELECT name, COUNT(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC;
{"id": 42, "name": "Ada Lovelace", "tags": ["math", "poetry"], "active": true, "score": 9.75}
https://example.com/docs/getting-started?lang=en#installation -- see section 3.2 for details.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 -17 +42 1e-9 50% $19.99 #1 @home
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age
of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season
of Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair.
To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings
and arrows of outrageous fortune, or to take arms against a sea of troubles.
She sells seashells by the seashore. Peter Piper picked a peck of pickled peppers.
The weather today is sunny with a light breeze; tomorrow expect rain in the afternoon.
I'd like a coffee, please — no sugar, a little milk. Thanks! You're welcome. Don't worry.
Café, naïve, façade, résumé, jalapeño, crème brûlée, São Paulo, Zürich, Kraków, Ångström.
Übermäßig große Straßen führen über die Brücke nach München; Grüße aus Köln!
El niño comió una manzana; ¿dónde está la biblioteca? ¡Qué día tan bonito!
Le cœur a ses raisons que la raison ne connaît point. Où est la gare, s'il vous plaît?
Привет, мир! Как дела? Москва — столица России. Спасибо большое.
Γειά σου κόσμε! Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.
مرحبا بالعالم. كيف حالك اليوم؟
你好，世界！今天天气很好。我们一起去公园散步吧。中文分词很有意思。
日本語のテキストも少し入れます。東京は日本の首都です。ありがとうございます。
한국어 문장도 있습니다. 서울은 대한민국의 수도입니다. 감사합니다.
नमस्ते दुनिया! आप कैसे हैं?
Emoji: 😀 😃 😄 🚀 🔥 👍 🎉 ❤️ 🌍 🐍 🤖 ✨ — rockets 🚀🚀 and fire 🔥🔥 and robots 🤖🤖.
Math: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ = π ≈ 3.14; α β γ δ ε → ∞; 1 ≤ n ≤ 10⁶; ½ + ¼ = ¾.
Symbols: © ® ™ € £ ¥ § ¶ • … « » “quoted” ‘single’ and tabs\tbetween\twords.
The train leaves at 9:45 from platform 12; the journey takes two hours and fifteen minutes.
Scientists measured the temperature of the lake every hour for a whole year.
Good software is written for people to read, and only incidentally for machines to execute.
Tests should check behaviour a user would notice, not the private details of the code.
When the cache is full, the least recently used blocks are evicted first.
Write clearly. Prefer short words. Say what you mean, then stop.
"""


def _train(vocab_size: int) -> dict:
    """Trains the BPE and returns its serialized form (a tokenizer.json dict)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Like Llama 3: BOS is added by the post-processor, so `add_special_tokens=True` in
    # `tokenizers` and in `transformers` agree without any tokenizer_config logic.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
                special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
            ),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return json.loads(tok.to_str())


def _pad_merges(model: dict, vocab_size: int) -> None:
    """Adds synthetic merges until the vocabulary has exactly `vocab_size` entries.

    A few KB of corpus cannot yield thousands of merges, but the model's embedding size is
    the vocabulary size, so the padding must be real tokens (not reserved specials) or a
    random-weight model would mostly sample text-less ids. Each new token joins two learned
    tokens; the right one never starts a word, so the pre-tokenizer can produce the pair.
    """
    vocab: dict[str, int] = model["vocab"]
    merges: list = model["merges"]
    by_id = sorted(vocab, key=vocab.__getitem__)
    learned, byte_tokens = by_id[MIN_VOCAB_SIZE:], by_id[len(SPECIAL_TOKENS) : MIN_VOCAB_SIZE]
    lefts = learned + byte_tokens
    rights = [t for t in lefts if "Ġ" not in t and "Ċ" not in t]
    # Enumerate pairs by diagonals (i + j) so early padding joins the most frequent tokens.
    for diag in range(len(lefts) + len(rights)):
        for i in range(max(0, diag - len(rights) + 1), min(diag + 1, len(lefts))):
            if len(vocab) >= vocab_size:
                return
            left, right = lefts[i], rights[diag - i]
            if left + right in vocab:
                continue
            vocab[left + right] = len(vocab)
            merges.append([left, right])
    raise ValueError(f"cannot pad the vocabulary to {vocab_size} tokens")


def build_tokenizer_json(vocab_size: int) -> str:
    """Returns the `tokenizer.json` text for a vocabulary of exactly `vocab_size` tokens."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    spec = _train(vocab_size)
    _pad_merges(spec["model"], vocab_size)
    text = json.dumps(spec, ensure_ascii=False, indent=2) + "\n"
    loaded = Tokenizer.from_str(text)
    assert loaded.get_vocab_size(with_added_tokens=True) == vocab_size
    return text


# The chat format `pdserve make-model` writes (one "role: content" line per message, the model's
# turns ended by EOS), rendered by the router's OpenAI chat endpoint as transformers would.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def _tokenizer_config() -> dict:
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        # Decoding must be the plain byte-level inverse, identical to `tokenizers`.
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer(directory: str | Path, vocab_size: int) -> None:
    """Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(build_tokenizer_json(vocab_size), encoding="utf-8")
    files = {
        "tokenizer_config.json": _tokenizer_config(),
        "special_tokens_map.json": {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
        },
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
