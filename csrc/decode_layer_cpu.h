// One Llama decoder layer for a decode step (one new token per row), fp32 on the CPU. See decode_layer_cpu.cpp.
#pragma once

#include <cstdint>

namespace llamarl {

// Activations [B, D] and weights row-major contiguous; the layer's KV cache rows [B, Hkv, cache_slots, Dh]
// with element strides (batch, head, slot) and unit stride along Dh.
struct DecodeLayerArgs {
  const float* x;         // [B, D] the layer's input part of the residual stream (see the .cpp)
  const float* residual;  // [B, D] the other part, or null for the first layer
  float* mlp_out;         // [B, D] out: the MLP's output
  float* h_out;           // [B, D] out: the stream after attention; mlp_out + h_out leaves the layer
  const float *w_norm1, *w_norm2;         // [D] input and post-attention RMSNorm weights
  const float* w_qkv;                     // [(H + 2 Hkv) Dh, D] q, k, v projections stacked
  const float* w_o;                       // [D, H Dh]
  const float* w_gate_up;                 // [2 I, D] gate, up projections stacked
  const float* w_down;                    // [D, I]
  const float *cos, *sin;                 // [B, Dh] rotary tables (sin signed: (-sin, sin) halves)
  float *k_cache, *v_cache;
  int64_t kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss;
  int64_t cache_slots;  // slots in the cache (bounds of `slot`)
  int64_t slot;         // the slot the new token's k, v are written to
  int64_t S;            // attention reads slots [0, S)
  const float* mask;    // additive [B, S] with row stride mask_sb, or null (all S slots visible)
  int64_t mask_sb;
  int64_t B, D, H, Hkv, Dh, I;
  float eps;
  int num_threads;
};

// Throws std::invalid_argument on bad sizes or a slot outside the cache.
void decode_layer_f32_cpu(const DecodeLayerArgs& args);

}  // namespace llamarl
