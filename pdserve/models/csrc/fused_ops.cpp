// Fused CPU ops of a decoder layer's small steps (pdserve/models/native_ops.py), in the
// pdserve_native library beside the decode-attention kernel.
//
// Each replaces a handful of eager torch ops with one pass over the rows, rounding exactly
// where the torch formula rounds (after each op, to the tensor's dtype), so that in bfloat16
// the results are the formula's bit for bit up to the float32 math's own rounding order:
// - rms_norm: weight * to_dtype(rms_norm(x.float())), as transformers' LlamaRMSNorm.
// - add_rms_norm: s = x + delta, then rms_norm(s): returns (s, norm), the residual add and
//   the next norm in one pass (vLLM's fused_add_rms_norm).
// - silu_and_mul: silu(gate) * up of a fused [T, 2 * I] gate_up output (vLLM's silu_and_mul).
// - rope_store_kv: rotate-half RoPE of the q and k heads of a fused [T, (H + 2 KV) * D] qkv
//   output, at each token's position of the float32 tables, the rotated keys and the values
//   written into their paged-cache slots; returns the rotated queries [T, H, D].
// Math is float32 whatever the dtype; bfloat16 converts through bit shifts (the loops vectorize,
// through c10::BFloat16's operators they do not).
#include <torch/library.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include "float_io.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using pdserve_native::load;
using pdserve_native::round_to;
using pdserve_native::store;

// Rows per at::parallel_for task: below about 16K elements a row range runs on the calling
// thread (at::parallel_for runs a range no longer than the grain inline), where waking the
// other threads costs more than the work.
inline int64_t grain_rows(int64_t cols) {
  return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(1, cols));
}

template <typename T>
void norm_rows(const T* x, const T* delta, const T* weight, T* sum, T* out, int64_t rows,
               int64_t cols, float eps) {
  at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * cols;
      T* outr = out + r * cols;
      const T* src = xr;  // the row normalized: x, or x + delta once stored
      if (delta != nullptr) {
        const T* dr = delta + r * cols;
        T* sr = sum + r * cols;
        for (int64_t c = 0; c < cols; ++c) store(sr, c, load(xr, c) + load(dr, c));
        src = sr;
      }
      float squares = 0.f;
      for (int64_t c = 0; c < cols; ++c) {
        const float v = load(src, c);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(cols) + eps);
      for (int64_t c = 0; c < cols; ++c) {
        store(outr, c, load(weight, c) * round_to<T>(load(src, c) * inv));
      }
    }
  });
}

void check_norm_args(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "a CPU op");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x must have a last dimension to normalize");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1),
              "weight must be [", x.size(-1), "], the last dimension of x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight dtypes differ");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_norm_args(x, weight);
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, weight.data_ptr<scalar_t>(), nullptr,
                        out.data_ptr<scalar_t>(), rows, cols, static_cast<float>(eps));
  });
  return out;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta,
                                                      torch::Tensor weight, double eps) {
  check_norm_args(x, weight);
  TORCH_CHECK(delta.sizes() == x.sizes(), "x and delta shapes differ");
  TORCH_CHECK(delta.scalar_type() == x.scalar_type(), "x and delta dtypes differ");
  TORCH_CHECK(delta.device().is_cpu(), "a CPU op");
  x = x.contiguous();
  delta = delta.contiguous();
  weight = weight.contiguous();
  auto sum = torch::empty_like(x);
  auto out = torch::empty_like(x);
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                        weight.data_ptr<scalar_t>(), sum.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), rows, cols, static_cast<float>(eps));
  });
  return {sum, out};
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "a CPU op");
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "gate_up's last dimension must be even (gate, then up)");
  gate_up = gate_up.contiguous();
  auto sizes = gate_up.sizes().vec();
  const int64_t inner = sizes.back() / 2;
  sizes.back() = inner;
  auto out = torch::empty(sizes, gate_up.options());
  const int64_t rows = inner == 0 ? 0 : out.numel() / inner;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(inner), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * inner;
        const scalar_t* up = gate + inner;
        scalar_t* orow = o + r * inner;
        for (int64_t c = 0; c < inner; ++c) {
          const float g = load(gate, c);
          // silu rounded to the dtype, then the product: F.silu(gate) * up.
          store(orow, c, round_to<scalar_t>(g / (1.f + std::exp(-g))) * load(up, c));
        }
      }
    });
  });
  return out;
}

template <typename T>
void rope_rows(const T* qkv, int64_t row_stride, const int64_t* positions, const float* cos,
               const float* sin, T* q_out, T* cache, const int64_t* slots, int64_t tokens,
               int64_t heads, int64_t kv_heads, int64_t dim, int64_t value_offset) {
  const int64_t half = dim / 2;
  const int64_t width = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, tokens, grain_rows(width), [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * row_stride;
      // The tables cast to the dtype first, as `rope_cos[positions].to(dtype)` does.
      const float* ct = cos + positions[t] * dim;
      const float* st = sin + positions[t] * dim;
      for (int64_t d = 0; d < dim; ++d) {
        c[d] = round_to<T>(ct[d]);
        s[d] = round_to<T>(st[d]);
      }
      T* keys = cache + slots[t] * kv_heads * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const T* x = row + h * dim;
        T* dst = h < heads ? q_out + (t * heads + h) * dim : keys + (h - heads) * dim;
        // x * cos + cat(x2, x1) * sin_signed, each product rounded as its own op is.
        for (int64_t d = 0; d < half; ++d) {
          store(dst, d, round_to<T>(load(x, d) * c[d]) + round_to<T>(load(x, d + half) * s[d]));
        }
        for (int64_t d = half; d < dim; ++d) {
          store(dst, d, round_to<T>(load(x, d) * c[d]) + round_to<T>(load(x, d - half) * s[d]));
        }
      }
      std::memcpy(keys + value_offset, row + (heads + kv_heads) * dim, kv_heads * dim * sizeof(T));
    }
  });
}

torch::Tensor rope_store_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor layer_cache,
                            torch::Tensor slot_mapping, int64_t heads) {
  TORCH_CHECK(qkv.device().is_cpu() && layer_cache.device().is_cpu() && cos.device().is_cpu() &&
                  sin.device().is_cpu(), "a CPU op");
  TORCH_CHECK(layer_cache.dim() == 5 && layer_cache.size(0) == 2,
              "layer_cache must be [2, num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(layer_cache.is_contiguous(), "layer_cache must be contiguous");
  TORCH_CHECK(qkv.scalar_type() == layer_cache.scalar_type(), "qkv and layer_cache dtypes differ");
  const int64_t kv_heads = layer_cache.size(3), dim = layer_cache.size(4);
  const int64_t slots_in_cache = layer_cache.size(1) * layer_cache.size(2);
  TORCH_CHECK(heads > 0 && dim % 2 == 0, "heads must be positive and head_dim even");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv must be [tokens, (heads + 2 * kv_heads) * head_dim]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "the RoPE tables must be float32");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "the RoPE tables must be [positions, head_dim]");
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "positions and slot_mapping must be int64");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == tokens && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == tokens,
              "positions and slot_mapping must be [tokens]");
  if (qkv.stride(1) != 1) qkv = qkv.contiguous();
  positions = positions.contiguous();
  slot_mapping = slot_mapping.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  // The kernel trusts these: checked once here rather than per head.
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the RoPE tables");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_in_cache, "slot ", slots[t], " outside the cache");
  }
  auto q = torch::empty({tokens, heads, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store_kv", [&] {
    rope_rows<scalar_t>(qkv.data_ptr<scalar_t>(), qkv.stride(0), pos, cos.data_ptr<float>(),
                        sin.data_ptr<float>(), q.data_ptr<scalar_t>(),
                        layer_cache.data_ptr<scalar_t>(), slots, tokens, heads, kv_heads, dim,
                        layer_cache.stride(0));
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope_store_kv(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(a!) layer_cache, Tensor slot_mapping, int heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_native, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_store_kv", &rope_store_kv);
}
