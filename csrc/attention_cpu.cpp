// Decode attention for fp32 on the CPU: one new query per row against the KV cache, grouped-query.
//
// For row b, kv head h and the G query heads g that share it (query head h * G + g), with S cache slots:
//
//   s_j   = scale * <q_bhg, k_bhj> + mask_bj          (mask additive: 0 visible, -inf hidden; none = 0)
//   p_j   = exp(s_j - max_j s_j)
//   out   = sum_j p_j v_bhj / sum_j p_j
//
// the math of torch's scaled_dot_product_attention (a row whose slots are all hidden gives NaN; torch's
// CPU SDPA returns 0 there, and the model never produces such a row: a query always sees its own slot).
// Each K and V row is read once for the G queries. All arithmetic is fp32; the order of the
// sums differs from torch's, so results agree to fp32 rounding, not bitwise. Work is split over the
// (b, h) pairs on the shared thread pool.
//
// Instruction sets: AVX-512 (16-lane dot products, axpy and the vectorised exp of cpu_simd.h) when
// linear_cpu picked it at load time (cpu_uses_avx512), else portable C++ with std::exp.
#include "attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "cpu_simd.h"
#include "linear_cpu.h"
#include "thread_pool.h"

namespace llamarl {
namespace {

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const float* mask;
  float* out;
  int64_t Hkv, G, S, D;
  int64_t k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, mask_sb;
  float scale;
};

// The operands of one (row b, kv head h) pair.
struct Head {
  const float* q;     // [G, D]
  float* out;         // [G, D]
  const float* k;     // slot j at k + j * k_ss
  const float* v;     // slot j at v + j * v_ss
  const float* mask;  // [S], or null
};

Head head_at(const Problem& P, int64_t b, int64_t h) {
  const int64_t first = (b * P.Hkv + h) * P.G * P.D;
  return {P.q + first, P.out + first, P.k + b * P.k_sb + h * P.k_sh, P.v + b * P.v_sb + h * P.v_sh,
          P.mask ? P.mask + b * P.mask_sb : nullptr};
}

// ------------------------------------------------------------------------------------- portable
void head_scalar(const Problem& P, const Head& H, std::vector<float>& scores) {
  const int64_t G = P.G, S = P.S, D = P.D;
  const float *q = H.q, *kb = H.k, *vb = H.v, *mask = H.mask;
  float* out = H.out;
  for (int64_t j = 0; j < S; ++j) {
    const float* kr = kb + j * P.k_ss;
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * kr[d];
      scores[g * S + j] = P.scale * acc + (mask ? mask[j] : 0.0f);
    }
  }
  std::fill(out, out + G * D, 0.0f);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * S;
    const float m = *std::max_element(sg, sg + S);
    float l = 0.0f;
    for (int64_t j = 0; j < S; ++j) l += (sg[j] = std::exp(sg[j] - m));
    for (int64_t j = 0; j < S; ++j) {
      const float* vr = vb + j * P.v_ss;
      const float p = sg[j] / l;
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += p * vr[d];
    }
  }
}

#ifdef LLAMARL_X86
// ------------------------------------------------------------------------------------- AVX-512
__attribute__((target("avx512f,avx2,fma"))) inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

__attribute__((target("avx512f,avx2,fma"))) void head_avx512(const Problem& P, const Head& H,
                                                                std::vector<float>& scores) {
  const int64_t G = P.G, S = P.S, D = P.D;
  const float *q = H.q, *kb = H.k, *vb = H.v, *mask = H.mask;
  float* out = H.out;
  // Scores, 8 keys at a time: 16-lane partial dot products, folded and summed 8 at once (hsum8x8),
  // instead of one full horizontal reduction per key.
  for (int64_t j0 = 0; j0 < S; j0 += 8) {
    const int nk = static_cast<int>(std::min<int64_t>(8, S - j0));
    alignas(32) float block[8] = {};  // mask values of the block's keys (masked 256-bit loads need AVX512VL)
    if (mask) std::copy(mask + j0, mask + j0 + nk, block);
    const __m256 add = _mm256_load_ps(block);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m256 folded[8];
      for (int t = 0; t < 8; ++t) {
        __m512 acc = _mm512_setzero_ps();
        if (t < nk) {
          const float* kr = kb + (j0 + t) * P.k_ss;
          for (int64_t d = 0; d < D; d += 16) {
            const __mmask16 m = tail_mask(D - d);
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qg + d), _mm512_maskz_loadu_ps(m, kr + d), acc);
          }
        }
        folded[t] = fold16(acc);
      }
      _mm256_store_ps(block, _mm256_fmadd_ps(hsum8x8(folded), _mm256_set1_ps(P.scale), add));
      std::copy(block, block + nk, scores.data() + g * S + j0);
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // p = exp(s - max) / sum, in place
    float* sg = scores.data() + g * S;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < S; j += 16)
      mv = _mm512_mask_max_ps(mv, tail_mask(S - j), mv, _mm512_maskz_loadu_ps(tail_mask(S - j), sg + j));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 lv = _mm512_setzero_ps();
    for (int64_t j = 0; j < S; j += 16) {
      const __mmask16 t = tail_mask(S - j);
      const __m512 e = _mm512_maskz_mov_ps(t, exp_nonpositive_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(t, sg + j), m)));
      _mm512_mask_storeu_ps(sg + j, t, e);
      lv = _mm512_add_ps(lv, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(lv);
    for (int64_t j = 0; j < S; ++j) sg[j] *= inv;
  }
  for (int64_t i = 0; i < G * D; i += 16) _mm512_mask_storeu_ps(out + i, tail_mask(G * D - i), _mm512_setzero_ps());
  for (int64_t j = 0; j < S; ++j) {
    const float* vr = vb + j * P.v_ss;
    for (int64_t g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * S + j]);
      float* o = out + g * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 t = tail_mask(D - d);
        _mm512_mask_storeu_ps(o + d, t, _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(t, vr + d), _mm512_maskz_loadu_ps(t, o + d)));
      }
    }
  }
}
#endif

void head(const Problem& P, int64_t b, int64_t h, std::vector<float>& scores) {
  const Head H = head_at(P, b, h);
  scores.resize(static_cast<size_t>(P.G * P.S));
#ifdef LLAMARL_X86
  if (cpu_uses_avx512()) return head_avx512(P, H, scores);
#endif
  head_scalar(P, H, scores);
}

}  // namespace

void decode_attention_f32_cpu(const float* q, const float* k, const float* v, const float* mask, float* out,
                              int64_t B, int64_t Hkv, int64_t G, int64_t S, int64_t D, int64_t k_sb, int64_t k_sh,
                              int64_t k_ss, int64_t v_sb, int64_t v_sh, int64_t v_ss, int64_t mask_sb, float scale,
                              int num_threads) {
  if (B < 0 || Hkv < 1 || G < 1 || S < 1 || D < 1)
    throw std::invalid_argument("decode_attention_f32_cpu: need B >= 0 and Hkv, G, S, D >= 1");
  if (num_threads < 1) throw std::invalid_argument("decode_attention_f32_cpu: num_threads must be >= 1");
  const Problem P{q, k, v, mask, out, Hkv, G, S, D, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, mask_sb, scale};
  const int64_t units = B * Hkv;
  // below ~64 K multiply-adds per thread a thread costs more than it saves
  const int64_t by_work = std::max<int64_t>(1, units * G * S * D / 65536);
  const int threads = static_cast<int>(std::min<int64_t>({num_threads, by_work, std::max<int64_t>(units, 1)}));
  parallel_ranges(units, threads, [&](int64_t u0, int64_t u1) {
    thread_local std::vector<float> scores;
    for (int64_t u = u0; u < u1; ++u) head(P, u / Hkv, u % Hkv, scores);
  });
}

}  // namespace llamarl
