// x86 detection and the vector helpers shared by the CPU kernels (horizontal sums, exp). On x86-64 this
// defines LLAMARL_X86 and the helpers, which carry their own target attributes (the library is compiled
// for the baseline instruction set; each kernel picks its path at run time, see cpu_uses_avx512 in
// linear_cpu.h). Elsewhere it defines nothing and the kernels build their portable paths only.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#define LLAMARL_X86 1
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

// exp(x) for x <= 0 (values minus their max) on 16 lanes: Cody-Waite range reduction to |r| <= ln2/2, a
// degree-6 Taylor polynomial (relative error ~3e-7), then scaling by 2^n; x below -104 (and -inf) gives
// exactly 0.
__attribute__((target("avx512f,avx2,fma"))) inline __m512 exp_nonpositive_avx512(__m512 x) {
  const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 split: hi exact in 10 bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_scalef_ps(p, n));
}

}  // namespace llamarl

#endif  // x86-64
