// One Llama decoder layer for a decode step, fp32 on the CPU, in one native call.
//
// A decode step of a small model spends as much time in the Python and dispatch around a layer's dozen
// ops as in their arithmetic (~100 us per layer of the 22M benchmark model against ~20 us of native
// work). This runs the same ops, in the same order, on the same native kernels the module path calls
// one by one (llamarl.models.llama with the native CPU ops), so the results are the module path's except
// for SiLU's exp (std::exp here, torch's vectorised exp there: at most an ulp apart). With the stream
// entering the layer split in two parts, x + residual (llamarl.models.llama: "Residual stream"):
//
//   h1  = x + residual (x alone for the first layer)     a  = RMSNorm_1(h1)
//   [q | k | v] = a W_qkvᵀ                                 q, k = RoPE(q, k); cache[slot] = (k, v)
//   o   = softmax(q Kᵀ / sqrt(Dh) + mask) V Wₒᵀ            (keys and values: cache slots [0, S))
//   h2  = o + h1                                           a2 = RMSNorm_2(h2)
//   [g | u] = a2 W_guᵀ                                     mlp = (silu(g) · u) W_downᵀ
//
// and returns (mlp, h2), whose sum is the stream leaving the layer. silu(g) = g / (1 + exp(-g)), the
// product with u rounded separately (as torch's F.silu(g) * u).
#include "decode_layer_cpu.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_cpu.h"
#include "fused_cpu.h"
#include "linear_cpu.h"

namespace llamarl {

void decode_layer_f32_cpu(const DecodeLayerArgs& a) {
  if (a.B < 1 || a.D < 1 || a.H < 1 || a.Hkv < 1 || a.H % a.Hkv || a.Dh < 2 || a.Dh % 2 || a.I < 1)
    throw std::invalid_argument("decode_layer_f32_cpu: B, D, heads, I must be >= 1, H a multiple of Hkv, head_dim "
                                "even");
  if (a.S < 1 || a.S > a.cache_slots || a.slot < 0 || a.slot >= a.S)
    throw std::invalid_argument("decode_layer_f32_cpu: the slot written (" + std::to_string(a.slot) +
                                ") must lie in the slots attention reads [0, " + std::to_string(a.S) +
                                "), within the cache's " + std::to_string(a.cache_slots));
  const int64_t B = a.B, D = a.D, Dh = a.Dh, qd = a.H * Dh, nqkv = (a.H + 2 * a.Hkv) * Dh;
  std::vector<float> h1(a.residual ? B * D : 0), act(B * D), qkv(B * nqkv), q(B * qd), attn(B * qd), o(B * D),
      gu(B * 2 * a.I), hidden(B * a.I);
  const float* stream = a.x;
  if (a.residual) {
    rms_norm_f32_cpu(a.x, a.residual, a.w_norm1, act.data(), h1.data(), B, D, a.eps);
    stream = h1.data();
  } else {
    rms_norm_f32_cpu(a.x, nullptr, a.w_norm1, act.data(), nullptr, B, D, a.eps);
  }
  linear_f32_cpu(act.data(), a.w_qkv, qkv.data(), B, D, nqkv, a.num_threads);
  RopeKvArgs r{qkv.data(), qkv.data() + qd, qkv.data() + qd + a.Hkv * Dh, a.cos, a.sin,
               nqkv, 0, nqkv, 0, nqkv, 0,  // one token per row: the token stride is never used
               q.data(), a.k_cache, a.v_cache, a.kc_sb, a.kc_sh, a.kc_ss, a.vc_sb, a.vc_sh, a.vc_ss,
               nullptr, a.slot, a.cache_slots, B, 1, a.H, a.Hkv, Dh};
  rope_kv_f32_cpu(r);
  decode_attention_f32_cpu(q.data(), a.k_cache, a.v_cache, a.mask, attn.data(), B, a.Hkv, a.H / a.Hkv, a.S, Dh,
                           a.kc_sb, a.kc_sh, a.kc_ss, a.vc_sb, a.vc_sh, a.vc_ss, a.mask_sb,
                           static_cast<float>(std::pow(static_cast<double>(Dh), -0.5)), a.num_threads);
  linear_f32_cpu(attn.data(), a.w_o, o.data(), B, qd, D, a.num_threads);
  rms_norm_f32_cpu(o.data(), stream, a.w_norm2, act.data(), a.h_out, B, D, a.eps);
  linear_f32_cpu(act.data(), a.w_gate_up, gu.data(), B, D, 2 * a.I, a.num_threads);
  for (int64_t b = 0; b < B; ++b) {
    const float* g = gu.data() + b * 2 * a.I;
    const float* u = g + a.I;
    float* out = hidden.data() + b * a.I;
    for (int64_t j = 0; j < a.I; ++j) {
      const float s = g[j] / (1.0f + std::exp(-g[j]));
      out[j] = s * u[j];
    }
  }
  linear_f32_cpu(hidden.data(), a.w_down, a.mlp_out, B, a.I, D, a.num_threads);
}

}  // namespace llamarl
