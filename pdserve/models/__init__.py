"""Model code (torch): math only, no serving logic.

- `llama.py` — the Llama-family decoder (Llama, Llama 3, Mistral, Qwen2, Qwen3, and the MoE
  Qwen2-MoE, Qwen3-MoE, Mixtral).
- `moe.py` — the mixture-of-experts MLP: softmax top-k routing, experts run grouped by expert
  (sorted pairs, one grouped GEMM), Qwen2-MoE's gated shared expert.
- `expert_dispatch.py` — `--expert-parallel`: an MoE layer's tokens sent to their experts' ranks
  and back with all_to_all, combined on their home rank, all-gathered.
- `tp_layout.py` — which slice of each weight a tensor-parallel rank holds (Megatron's layout).
- `tensor_parallel.py` — `TensorParallel` (a rank of a torch.distributed group) and the layers
  that communicate: row-parallel linear (all-reduce), vocab-parallel embedding and LM head.
- `hf_config.py` — a Hugging Face config.json to our model config; math-changing fields are
  honoured exactly or refused by name (`ModelLoadError`).
- `rope.py` — rotary embedding tables, as transformers computes them for each rope type.
- `attention.py` — paged attention and its per-step `AttentionContext`.
- `linear.py` — `Linear`: nn.Linear whose CPU forward runs the GEMM chosen for this machine;
  `choose_kernels(model, max_rows)` at engine start, `probe_dtype(dtype, device)`.
- `linear_kernels.py` — the CPU GEMM candidates (F.linear, few-row, oneDNN over a reordered
  weight), timed per shape and rows bucket, cached per CPU model and ISA.
- `cpu_features.py` — the CPU's model and the ISA torch and oneDNN use (AVX2, AVX-512, AMX).
- `attention_op.py` — paged attention as one opaque torch op, for compiled decode graphs.
- `native_attention.py` — the CPU decode-attention kernel (`csrc/paged_decode_attention.cpp`)
  that reads the KV blocks in place, and the build (on first use) of the C++ library it shares
  with the fused ops.
- `triton_attention.py` — the GPU decode-attention kernel (Triton) that reads the KV blocks in
  place.
- `native_ops.py` — fused CPU ops of a layer's small steps (`csrc/fused_ops.cpp`): RMSNorm
  with the residual add, SiLU * up, RoPE with the K/V store.
- `loader.py` — Hugging Face directory (config.json + safetensors) -> model.
- `meta_init.py` — what a model built on the meta device skips (random inits, RoPE tables),
  which would import torch._dynamo at every worker's start.
- `presets.py` — sizes of the random-weight models (tiny, small).
- `builtin.py` — `make_model(dir, preset, seed)`, `default_model_dir()`.
- `draft_of.py` — `write_draft_of(target, out, layers)`: a self-speculative draft (the target's
  first layers, embedding, final norm and LM head).
- `tokenizer_builder.py` — `write_tokenizer(dir, vocab_size)`: the offline BPE tokenizer.
- `tool_chat_templates.py` — chat templates of the tool-calling families (Llama 3, Hermes,
  Mistral), `use_chat_template(dir, family)`.
"""
