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

}  // namespace llamarl
