// Horizontal sums shared by the CPU kernels (x86 only; callers guard with LLAMARL_X86).
#pragma once

#include <immintrin.h>

namespace llamarl {

// The horizontal sums of 8 vectors at once: lane i of the result = the sum of v[i]'s 8 lanes (two rounds
// of pairwise hadd, then the two 128-bit halves added): 9 instructions for 8 dot products.
__attribute__((target("avx2,fma"))) inline __m256 hsum8x8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// A 16-lane accumulator folded to 8 lanes (lane i + lane i + 8), the input of hsum8x8.
__attribute__((target("avx512f,avx2,fma"))) inline __m256 fold16(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(v), hi);
}

}  // namespace llamarl
