// Fused decoder-layer ops for fp32 on the CPU (inference): RMSNorm with the residual add, and RoPE.
//
// A decode step on the CPU runs each of these on a few rows of a few hundred values; torch's eager
// chains (F.rms_norm decomposes into pow / mean / add / rsqrt / mul; RoPE into flip / mul / mul / add)
// cost ~3 us of dispatch per op, i.e. ~30 us per norm, far more than the arithmetic. Math, per row:
//
//   rms_norm:  h = x + residual (if given, fp32 add);  r = 1 / sqrt(fl32(sum h^2 / D) + eps);
//              y = w * (h * r)                         (two fp32 products, in this order, as eager)
//   rope:      out[j] = x[j] * cos[j] + x[swap(j)] * signed_sin[j],  swap(j) = j +- Dh/2, for every head of
//              every token (x's tokens may be strided: the q or k columns of a fused q|k|v product),
//              signed_sin = (-sin, sin): each product and the sum rounded to fp32, as eager.
//   rope_kv:   the same RoPE on q (to a new tensor) and on k, written with v straight into one layer's
//              KV cache at the token's slot, which saves the cache update's two copies per layer.
//
// The sum of squares is accumulated in double (so mean(h^2) is the correctly rounded fp32 of the exact
// mean up to one rounding), which may differ from torch's fp32 reduction in the last bit of the mean;
// everything else is the same fp32 operations as eager. No FMA contraction: this file is compiled for
// the baseline instruction set, which has no FMA, so products and sums round separately.
#include "fused_cpu.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace llamarl {

void rms_norm_f32_cpu(const float* x, const float* residual, const float* w, float* y, float* h, int64_t rows,
                      int64_t D, float eps) {
  if (rows < 0 || D < 1) throw std::invalid_argument("rms_norm_f32_cpu: rows must be >= 0 and D >= 1");
  if ((residual == nullptr) != (h == nullptr))
    throw std::invalid_argument("rms_norm_f32_cpu: residual and h (the sum's output) go together");
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    const float* src = xr;
    if (residual != nullptr) {
      const float* rr = residual + r * D;
      float* hr = h + r * D;
      for (int64_t j = 0; j < D; ++j) hr[j] = xr[j] + rr[j];
      src = hr;
    }
    double ss = 0.0;
    for (int64_t j = 0; j < D; ++j) ss += static_cast<double>(src[j]) * static_cast<double>(src[j]);
    const float mean = static_cast<float>(ss / static_cast<double>(D));
    const float inv = 1.0f / std::sqrt(mean + eps);
    for (int64_t j = 0; j < D; ++j) yr[j] = w[j] * (src[j] * inv);
  }
}

namespace {

// One head: o[j] = x[j] * c[j] + x[swap(j)] * s[j] (each product and the sum rounded to fp32).
inline void rope_head(const float* x, const float* c, const float* s, float* o, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j] * c[j], b = x[j + half] * s[j];
    o[j] = a + b;
  }
  for (int64_t j = half; j < 2 * half; ++j) {
    const float a = x[j] * c[j], b = x[j - half] * s[j];
    o[j] = a + b;
  }
}

}  // namespace

void rope_f32_cpu(const float* x, int64_t x_token_stride, const float* cos, const float* signed_sin, float* out,
                  int64_t tokens, int64_t heads, int64_t head_dim) {
  if (tokens < 0 || heads < 0 || head_dim < 2 || head_dim % 2)
    throw std::invalid_argument("rope_f32_cpu: head_dim must be even and >= 2");
  if (x_token_stride < heads * head_dim)
    throw std::invalid_argument("rope_f32_cpu: x_token_stride must be >= heads * head_dim (tokens may not overlap)");
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t hd = 0; hd < heads; ++hd)
      rope_head(x + t * x_token_stride + hd * head_dim, cos + t * head_dim, signed_sin + t * head_dim,
                out + (t * heads + hd) * head_dim, head_dim / 2);
}

void rope_kv_f32_cpu(const RopeKvArgs& a) {
  if (a.B < 0 || a.T < 0 || a.H < 0 || a.Hkv < 0 || a.Dh < 2 || a.Dh % 2)
    throw std::invalid_argument("rope_kv_f32_cpu: head_dim must be even and >= 2, sizes >= 0");
  for (int64_t t = 0; t < a.T; ++t) {  // every slot first: a bad one must leave the cache untouched
    const int64_t slot = a.slots != nullptr ? a.slots[t] : a.slot0 + t;
    if (slot < 0 || slot >= a.S)
      throw std::invalid_argument("rope_kv_f32_cpu: slot " + std::to_string(slot) + " outside the cache's " +
                                  std::to_string(a.S) + " slots");
  }
  for (int64_t b = 0; b < a.B; ++b) {
    for (int64_t t = 0; t < a.T; ++t) {
      const int64_t slot = a.slots != nullptr ? a.slots[t] : a.slot0 + t;
      const int64_t token = b * a.T + t;
      const float* c = a.cos + token * a.Dh;
      const float* s = a.sin + token * a.Dh;
      for (int64_t h = 0; h < a.H; ++h)
        rope_head(a.q + b * a.q_sb + t * a.q_st + h * a.Dh, c, s, a.q_out + (token * a.H + h) * a.Dh, a.Dh / 2);
      for (int64_t h = 0; h < a.Hkv; ++h) {
        rope_head(a.k + b * a.k_sb + t * a.k_st + h * a.Dh, c, s, a.kc + b * a.kc_sb + h * a.kc_sh + slot * a.kc_ss,
                  a.Dh / 2);
        std::memcpy(a.vc + b * a.vc_sb + h * a.vc_sh + slot * a.vc_ss, a.v + b * a.v_sb + t * a.v_st + h * a.Dh,
                    static_cast<size_t>(a.Dh) * sizeof(float));
      }
    }
  }
}

}  // namespace llamarl
