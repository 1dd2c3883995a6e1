// Fused fp32 decoder-layer ops on the CPU (RMSNorm + residual, RoPE). See fused_cpu.cpp for the math.
#pragma once

#include <cstdint>

namespace llamarl {

// rows x D, contiguous. residual and h are both null (y = norm(x)) or both set (h = x + residual,
// y = norm(h)); y and h must not alias the inputs.
void rms_norm_f32_cpu(const float* x, const float* residual, const float* w, float* y, float* h, int64_t rows,
                      int64_t D, float eps);

// x [tokens, heads, head_dim] with its tokens x_token_stride floats apart (heads contiguous within a token);
// out [tokens, heads, head_dim] contiguous; cos, signed_sin [tokens, head_dim] contiguous.
void rope_f32_cpu(const float* x, int64_t x_token_stride, const float* cos, const float* signed_sin, float* out,
                  int64_t tokens, int64_t heads, int64_t head_dim);

// RoPE on q and k of a [B, T] block of tokens plus one layer's KV-cache write (element strides; heads
// contiguous within a token in q, k, v; the cache's last dim contiguous):
//   q_out[b, t] = rope(q[b, t]) (contiguous [B, T, H, Dh]),  kc[b, h, slot_t] = rope(k[b, t, h]),
//   vc[b, h, slot_t] = v[b, t, h],  slot_t = slots[t] if slots else slot0 + t (must lie in [0, S)).
// cos, sin: contiguous [B * T, Dh]. Throws std::invalid_argument on bad sizes or slots.
struct RopeKvArgs {
  const float *q, *k, *v, *cos, *sin;
  int64_t q_sb, q_st, k_sb, k_st, v_sb, v_st;
  float *q_out, *kc, *vc;
  int64_t kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss;
  const int64_t* slots;
  int64_t slot0, S, B, T, H, Hkv, Dh;
};
void rope_kv_f32_cpu(const RopeKvArgs& args);

}  // namespace llamarl
