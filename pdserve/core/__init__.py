"""Plain data every process shares: no torch, Ray, gRPC or Redis import here.

- `sampling_params.py` — `SamplingParams`: how one request samples and stops.
- `grammar_spec.py` — `GrammarSpec`: what a structured output must match, checked without a
  compiler; `GrammarError`: a grammar the client got wrong.
- `messages.py` — what the router and the workers exchange through Ray calls.
- `kv_events.py` — `KVEvent`: blocks entering or leaving a worker's prefix cache.
- `block_hash.py` — the chained hash of full KV blocks, the only one used anywhere (a whole
  prompt's blocks in one C call, `_block_chain.c`, where `pip install` built it).
- `prompt_tokens.py` — `PromptTokens`: a prompt that remembers its block hashes (hashed once).
- `model_limits.py` — the context length a deployment serves (engine and router agree on it).
"""
