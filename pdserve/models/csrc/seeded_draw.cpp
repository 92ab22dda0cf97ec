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
// A token whose scaled logit lies more than the largest noise (plus a margin of 1) below the
// best score so far cannot win, and is not hashed: compared in double, where the bound is exact
// to far below the margin at any float32 magnitude, and with it any reordering -ffast-math may
// do to the comparison, so the pruned token's float32 score could not have exceeded the best.
#include <torch/library.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>

#include <cstdint>

namespace {

// seeded_noise.py's constants: lowbias32's multipliers and the uniform's bit count.
constexpr uint32_t kM1 = 0x7FEB352Du;
constexpr uint32_t kM2 = 0x846CA68Bu;
constexpr int kUniformBits = 23;

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
                             double max_noise) {
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
  const double beyond_reach = max_noise + 1.0;
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
        if (found && static_cast<double>(logit) < static_cast<double>(best) - beyond_reach) continue;
        const uint32_t hash = mix(static_cast<uint32_t>(hash_data[id]), key);
        const float score = logit + noise[hash >> (32 - kUniformBits)];
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
        "Tensor token_hashes, Tensor noise_table, float max_noise) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve_native, CPU, m) { m.impl("seeded_gumbel_max", &seeded_gumbel_max); }
