// Reading and writing float16/bfloat16/float32 tensors' elements as float32, shared by the
// pdserve_native library's sources (paged_decode_attention.cpp, fused_ops.cpp).
// A bfloat16 is the top half of a float32: written as shifts, the loops that use these
// vectorize (through c10::BFloat16's operators they do not).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pdserve_native {

template <typename T>
inline float load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t word = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &word, sizeof(float));
    return f;
  } else {
    return static_cast<float>(p[i]);
  }
}

template <typename T>
inline void store(T* p, int64_t i, float f) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // Round to nearest even, as c10::BFloat16 does; NaN stays a (quiet) NaN. Integer tests
    // only: -ffast-math drops float NaN checks.
    uint32_t word;
    std::memcpy(&word, &f, sizeof(float));
    const uint32_t rounded = (word + 0x7FFFu + ((word >> 16) & 1u)) >> 16;
    reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(
        (word & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  } else {
    p[i] = static_cast<T>(f);
  }
}

// f rounded to T and back: what a torch op of dtype T leaves of an intermediate.
template <typename T>
inline float round_to(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    T t[1];
    store(t, 0, f);
    return load(t, 0);
  }
}

}  // namespace pdserve_native
