// Decode attention (one query token per row) for fp32 on the CPU. See attention_cpu.cpp for the math.
#pragma once

#include <cstdint>

namespace llamarl {

// q, out: [B, Hkv, G, D] contiguous (query head h * G + g uses kv head h). k, v: [B, Hkv, S, D] with
// element strides (batch, head, slot) and unit stride along D. mask: additive [B, S] with batch stride
// mask_sb, or null. Splits the B * Hkv (row, kv head) pairs over num_threads threads of the shared pool.
void decode_attention_f32_cpu(const float* q, const float* k, const float* v, const float* mask, float* out,
                              int64_t B, int64_t Hkv, int64_t G, int64_t S, int64_t D, int64_t k_sb, int64_t k_sh,
                              int64_t k_ss, int64_t v_sb, int64_t v_sh, int64_t v_ss, int64_t mask_sb, float scale,
                              int num_threads);

}  // namespace llamarl
