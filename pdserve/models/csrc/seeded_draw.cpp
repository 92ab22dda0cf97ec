// The seeded Gumbel-max draw in one pass per row (pdserve/engine/decoding/seeded_draw.py), in
// the pdserve_native library beside the decode-attention kernel.
//
// For each kept token of a row: the 32-bit hash of (row key, token id) as
// seeded_noise.gumbel_noise computes it, its top 23 bits looked up in the table of Gumbel noises
// torch computed for each of the 2^23 uniforms (so the noise is the torch path's float32 bit
// for bit, whatever this compiler's log would round), score = scaled logit + noise (one float32
// add, as torch's), and the running argmax, the lowest column on ties as torch.argmax. The
// [M, vocab] noise is never written: the torch path makes ~10 passes over it.
//
// Most tokens need no lookup: the noise grows with the uniform, so each of 4096 buckets of the
// uniform's values has a largest noise (a 16 KiB table that stays in L1); a token whose scaled
// logit plus its bucket's largest noise is below the best score so far cannot win. That sum is
// taken in double, where it is exact to far below a float32 step: when it is below the best, the
// float32 score (rounded the same way or lower) is at most the best, and ties keep the earlier
// column; -ffast-math's freedom to reorder a double sum cannot move it by a float32 step.
#include <torch/library.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <cstdint>

namespace {

// seeded_noise.py's constants: lowbias32's multipliers and the uniform's bit count.
constexpr uint32_t kM1 = 0x7FEB352Du;
constexpr uint32_t kM2 = 0x846CA68Bu;
constexpr int kUniformBits = 23;
constexpr int kBucketBits = 12;

inline uint32_t mix(uint32_t token_hash, uint32_t key) {
  uint32_t x = token_hash ^ key;
  x ^= x >> 16;
  x *= kM1;  // uint32 arithmetic wraps modulo 2^32, as the torch path masks its int64 products
  x ^= x >> 15;
  x *= kM2;
  x ^= x >> 16;
  return x;
}

at::Tensor seeded_gumbel_max(const at::Tensor& scaled, const at::Tensor& probs,
                             const c10::optional<at::Tensor>& ids, const at::Tensor& keys,
                             const at::Tensor& token_hashes, const at::Tensor& noise_table,
                             const at::Tensor& bucket_max) {
  TORCH_CHECK(scaled.dim() == 2 && scaled.scalar_type() == at::kFloat && scaled.is_contiguous(),
              "scaled: a contiguous [M, vocab] float32 tensor");
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous(),
              "probs: a contiguous [M, K] float32 tensor");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.numel() == scaled.size(0), "keys: [M] int64");
  TORCH_CHECK(token_hashes.scalar_type() == at::kLong && token_hashes.is_contiguous() &&
                  token_hashes.numel() == scaled.size(1),
              "token_hashes: [vocab] int64");
  TORCH_CHECK(noise_table.scalar_type() == at::kFloat && noise_table.is_contiguous() &&
                  noise_table.numel() == (int64_t{1} << kUniformBits),
              "noise_table: [2^23] float32");
  TORCH_CHECK(bucket_max.scalar_type() == at::kFloat && bucket_max.is_contiguous() &&
                  bucket_max.numel() == (int64_t{1} << kBucketBits),
              "bucket_max: [2^12] float32");
  const int64_t rows = scaled.size(0), vocab = scaled.size(1), kept = probs.size(1);
  const bool whole = !ids.has_value();
  TORCH_CHECK(probs.size(0) == rows && (!whole || kept == vocab), "probs: [M, vocab] without ids");
  const int64_t* id_data = nullptr;
  if (!whole) {
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->is_contiguous() &&
                    ids->sizes() == probs.sizes(),
                "ids: a contiguous [M, K] int64 tensor");
    id_data = ids->data_ptr<int64_t>();
  }
  const float* scaled_data = scaled.data_ptr<float>();
  const float* prob_data = probs.data_ptr<float>();
  const auto key_data = keys.contiguous();
  const int64_t* key_ptr = key_data.data_ptr<int64_t>();
  const int64_t* hash_data = token_hashes.data_ptr<int64_t>();
  const float* noise = noise_table.data_ptr<float>();
  const float* bucket_noise = bucket_max.data_ptr<float>();
  at::Tensor tokens = at::empty({rows}, keys.options());
  int64_t* token_data = tokens.data_ptr<int64_t>();

  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row_scaled = scaled_data + r * vocab;
      const float* row_probs = prob_data + r * kept;
      const int64_t* row_ids = whole ? nullptr : id_data + r * kept;
      const uint32_t key = static_cast<uint32_t>(key_ptr[r]);  // the key's low 32 bits
      bool found = false;  // not -inf: -ffast-math assumes finite values
      float best = 0.f;
      int64_t best_id = whole ? 0 : row_ids[0];
      for (int64_t k = 0; k < kept; ++k) {
        if (row_probs[k] <= 0.f) continue;  // dropped by the filters
        const int64_t id = whole ? k : row_ids[k];
        const float logit = row_scaled[id];
        const uint32_t uniform = mix(static_cast<uint32_t>(hash_data[id]), key) >> (32 - kUniformBits);
        const double reach = bucket_noise[uniform >> (kUniformBits - kBucketBits)];
        if (found && static_cast<double>(logit) + reach < static_cast<double>(best)) continue;
        const float score = logit + noise[uniform];
        if (!found || score > best) {
          found = true;
          best = score;
          best_id = id;
        }
      }
      token_data[r] = best_id;
    }
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_native, m) {
  m.def("seeded_gumbel_max(Tensor scaled, Tensor probs, Tensor? ids, Tensor keys, "
        "Tensor token_hashes, Tensor noise_table, Tensor bucket_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_native, CPU, m) { m.impl("seeded_gumbel_max", &seeded_gumbel_max); }
