// Small-batch fp32 linear layer on the CPU (decode): y[M, N] = x[M, K] · w[N, K]ᵀ. See linear_cpu.cpp.
#pragma once

#include <cstdint>
#include <string>

namespace llamarl {

// x, w, y: contiguous row-major fp32; y must not alias x or w. Splits N over num_threads threads of the
// shared pool (fewer when the weights are small). Throws std::invalid_argument on bad sizes.
void linear_f32_cpu(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int num_threads);

// The instruction set picked at load time: "avx512f", "avx2+fma" or "scalar".
std::string linear_cpu_isa();

// Whether the CPU kernels (linear, attention, sampling) take their AVX-512 paths: the choice above.
bool cpu_uses_avx512();

}  // namespace llamarl
