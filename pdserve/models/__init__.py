"""Model code (torch): math only, no serving logic.

- `llama.py` — the Llama-family decoder (Llama, Llama 3, Mistral, Qwen2).
- `attention.py` — paged attention and its per-step `AttentionContext`.
- `loader.py` — Hugging Face directory (config.json + safetensors) -> model; `ModelLoadError`.
- `presets.py` — sizes of the random-weight models (tiny, small).
- `builtin.py` — `make_model(dir, preset, seed)`, `default_model_dir()`.
- `tokenizer_builder.py` — `write_tokenizer(dir, vocab_size)`: the offline BPE tokenizer.
"""
