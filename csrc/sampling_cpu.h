// The per-step token sampler for fp32 logits on the CPU (greedy or inverse-CDF). See sampling_cpu.cpp.
#pragma once

#include <cstdint>

namespace llamarl {

// logits [N, V] contiguous; temperature 0 = greedy (u unused, may be null), else u [N] uniforms in [0, 1).
// Writes tokens [N] and logprobs [N] = log_softmax(logits / T)[token]. Rows split over num_threads.
void sample_f32_cpu(const float* logits, int64_t N, int64_t V, float temperature, const double* u, int64_t* tokens,
                    float* logprobs, int num_threads);

}  // namespace llamarl
