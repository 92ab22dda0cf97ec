// Decode attention that reads the paged KV cache in place (pdserve/models/native_attention.py).
//
// One query token per sequence, its H heads in KV groups of G = H / KV (grouped-query attention).
// Each sequence walks its blocks through its block table: scores of its query heads against
// every key of its context, a softmax, then the weighted sum of the values.
// Nothing is gathered: the plain-torch path copies every sequence's whole context out of the
// pool each layer and SDPA copies it again; here each key and value row is read once, where it
// lies. Accumulation is in float32 whatever the cache's dtype.
//
// Layouts (row-major, contiguous): q [B, H, D]; layer_cache [2, num_blocks, block_size, KV, D]
// (K then V); block_tables [B, max_blocks] int64; context_lens [B] int64, >= 1 each: sequence
// b attends over its first context_lens[b] slots. Returns [B, H, D] in q's dtype.
#include <torch/library.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include "float_io.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using pdserve_native::load;

// Asks for the cache lines of a row of n elements (a hint: no fault, no wait).
template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) {
    __builtin_prefetch(bytes + i);
  }
}

template <typename T>
void attend(const T* q, const T* cache, const int64_t* block_tables, const int64_t* context_lens,
            T* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
            int64_t block_size, int64_t max_blocks, int64_t value_offset, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t row_stride = kv_heads * dim;  // between two tokens of a block
  // A task is one sequence's KV heads, or a share of them when there are fewer sequences than
  // twice the threads: a token's KV heads lie side by side, so a task that takes all of them
  // reads its keys and values as long runs, which the hardware prefetches; one task per
  // (sequence, KV head) read 256-byte pieces 1 KiB apart and waited on memory (3x slower).
  const int64_t threads = at::get_num_threads();
  const int64_t splits = std::min(kv_heads, std::max<int64_t>(1, (2 * threads + batch - 1) / batch));
  const int64_t per_split = (kv_heads + splits - 1) / splits;
  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(per_split * group * dim), acc(per_split * group * dim);
    std::vector<float> probs;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits;
      const int64_t h0 = (task % splits) * per_split;
      const int64_t nh = std::min(kv_heads, h0 + per_split) - h0;
      if (nh <= 0) continue;
      const int64_t rows = nh * group;  // query heads of this task, h0 * group onwards
      const int64_t len = context_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      probs.resize(rows * len);
      const T* qb = q + (b * heads + h0 * group) * dim;
      for (int64_t i = 0; i < rows * dim; ++i) queries[i] = load(qb, i) * scale;
      // Scores, block by block: each token's keys of these heads are one run of nh * dim.
      // Blocks lie anywhere in the pool, where the hardware prefetcher does not follow: each
      // token's value row and the next block's key row are prefetched while its keys are read.
      for (int64_t start = 0, j = 0; start < len; start += block_size, ++j) {
        const T* keys = cache + (table[j] * block_size * kv_heads + h0) * dim;
        const T* next_keys = start + block_size < len
            ? cache + (table[j + 1] * block_size * kv_heads + h0) * dim : nullptr;
        const int64_t n = std::min(block_size, len - start);
        for (int64_t off = 0; off < n; ++off) {
          const T* k = keys + off * row_stride;
          prefetch_row(k + value_offset, nh * dim);
          if (next_keys != nullptr) prefetch_row(next_keys + off * row_stride, nh * dim);
          for (int64_t r = 0; r < rows; ++r) {
            const float* qr = queries.data() + r * dim;
            const T* kr = k + (r / group) * dim;
            float dot = 0.f;
            for (int64_t d = 0; d < dim; ++d) dot += qr[d] * load(kr, d);
            probs[r * len + start + off] = dot;
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* p = probs.data() + r * len;
        const float top = *std::max_element(p, p + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          p[t] = std::exp(p[t] - top);
          sum += p[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) p[t] *= inv;
      }
      // Weighted values, block by block.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0, j = 0; start < len; start += block_size, ++j) {
        const T* values = cache + value_offset + (table[j] * block_size * kv_heads + h0) * dim;
        const int64_t n = std::min(block_size, len - start);
        for (int64_t off = 0; off < n; ++off) {
          const T* v = values + off * row_stride;
          for (int64_t r = 0; r < rows; ++r) {
            const float w = probs[r * len + start + off];
            const T* vr = v + (r / group) * dim;
            float* a = acc.data() + r * dim;
            for (int64_t d = 0; d < dim; ++d) a[d] += w * load(vr, d);
          }
        }
      }
      T* ob = out + (b * heads + h0 * group) * dim;
      for (int64_t i = 0; i < rows * dim; ++i) ob[i] = static_cast<T>(acc[i]);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor layer_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens) {
  TORCH_CHECK(q.dim() == 3, "q must be [batch, heads, head_dim]");
  TORCH_CHECK(layer_cache.dim() == 5 && layer_cache.size(0) == 2,
              "layer_cache must be [2, num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(layer_cache.is_contiguous(), "layer_cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == layer_cache.scalar_type(), "q and layer_cache dtypes differ");
  TORCH_CHECK(q.device().is_cpu() && layer_cache.device().is_cpu(), "a CPU kernel");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = layer_cache.size(1), block_size = layer_cache.size(2);
  const int64_t kv_heads = layer_cache.size(3);
  TORCH_CHECK(layer_cache.size(4) == dim, "head_dim of q and layer_cache differ");
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch, "block_tables must be [batch, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == batch, "context_lens must be [batch]");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t max_blocks = block_tables.size(1);
  // The kernel trusts these: check them once here rather than per key.
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size,
                "context length ", lens[b], " outside its block table");
    for (int64_t j = 0; j * block_size < lens[b]; ++j) {
      const int64_t block = tables[b * max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the cache");
    }
  }
  auto out = torch::empty({batch, heads, dim}, q.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    attend<scalar_t>(q.data_ptr<scalar_t>(), layer_cache.data_ptr<scalar_t>(), tables, lens,
                     out.data_ptr<scalar_t>(), batch, heads, kv_heads, dim, block_size,
                     max_blocks, layer_cache.stride(0), scale);
  });
  return out;
}

}  // namespace

// A dispatcher op, so torch.profiler counts its time like any other op's.
TORCH_LIBRARY(pdserve_native, m) {
  m.def("paged_decode_attention(Tensor q, Tensor layer_cache, Tensor block_tables, "
        "Tensor context_lens) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_native, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
