// The per-step sampler for fp32 logits on the CPU: one token and its log-prob per row, in two passes.
//
// For row n with logits z [V] and temperature T (z' = z / T, IEEE division; T = 0 means greedy, z' = z):
//
//   m  = max_j z'_j,   e_j = exp(z'_j - m),   S = sum_j e_j,   logprob(y) = z'_y - m - log(S)
//   greedy:    y = the first index of the maximum
//   sampling:  y = the first j with sum_{i <= j} e_i > u_n * S     (u_n ~ U[0, 1) given by the caller)
//
// i.e. log_softmax(z')[y] and inverse-CDF sampling, as llamarl.generation.sampling does with torch ops
// (which need ~6 passes over the row and a [N, V] temporary per op). Sums are taken per 16 values and
// added in double, in the same order when S is formed and when the CDF is scanned, so the scan always
// ends inside the row; within the final 16 values the scan is in double, and a rounding overshoot picks
// the last nonzero e_j of that block. A row holding a NaN gives the first NaN's index and a NaN
// log-prob (what torch's argmax and log_softmax give), so a diverged model shows up in the log-probs.
//
// Instruction sets: AVX-512 (vectorised max/argmax and the exp of cpu_simd.h) when
// linear_cpu picked it at load time, else portable C++ with std::exp. Rows are split over threads.
#include "sampling_cpu.h"

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

constexpr int64_t kBlock = 16;

struct RowResult {
  int64_t token;
  float logprob;
};

// The inverse-CDF draw over e [V] with total S: the first j with e_0 + ... + e_j > u * S. Whole blocks
// first, each summed by `block_sum` exactly as it was summed into S (so the scan always ends inside the
// row); then, inside the block, in double; when rounding lets that run past the block's end, the last j
// with e_j > 0 (the block holds one: its sum exceeded target - c >= 0).
template <class BlockSum>
int64_t draw(const float* e, int64_t V, double S, double u, BlockSum block_sum) {
  const double target = u * S;
  double c = 0.0;
  int64_t b = 0;
  for (; b + kBlock < V; b += kBlock) {
    const float block = block_sum(e + b);
    if (c + block > target) break;
    c += block;
  }
  int64_t y = -1;
  for (int64_t j = b; j < std::min(V, b + kBlock); ++j) {
    if (e[j] > 0.0f) y = j;
    if ((c += e[j]) > target) break;
  }
  return y;
}

// ------------------------------------------------------------------------------------- portable
RowResult row_scalar(const float* z, int64_t V, float T, double u, std::vector<float>& e) {
  const bool greedy = T == 0.0f;
  auto zp = [&](int64_t j) { return greedy ? z[j] : z[j] / T; };
  int64_t arg = 0;
  float m = zp(0);
  for (int64_t j = 0; j < V; ++j) {
    const float x = zp(j);
    if (std::isnan(x)) return {j, std::numeric_limits<float>::quiet_NaN()};
    if (x > m) m = x, arg = j;
  }
  // every logit -inf (a fully masked row) or one +inf: exp(z - m) is undefined, there is no distribution
  if (!std::isfinite(m)) return {arg, std::numeric_limits<float>::quiet_NaN()};
  e.resize(static_cast<size_t>(V));
  double S = 0.0;
  for (int64_t b = 0; b < V; b += kBlock) {
    float block = 0.0f;
    for (int64_t j = b; j < std::min(V, b + kBlock); ++j) block += (e[j] = std::exp(zp(j) - m));
    S += block;
  }
  const int64_t y = greedy ? arg : draw(e.data(), V, S, u, [](const float* blk) {
    float block = 0.0f;  // in the order of the loop above
    for (int64_t j = 0; j < kBlock; ++j) block += blk[j];
    return block;
  });
  return {y, static_cast<float>(static_cast<double>(zp(y)) - m - std::log(S))};
}

#ifdef LLAMARL_X86
// ------------------------------------------------------------------------------------- AVX-512
__attribute__((target("avx512f,avx2,fma"))) inline __mmask16 block_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// A block of e as pass 2 summed it into S (one 16-lane reduction).
__attribute__((target("avx512f,avx2,fma"))) float block_sum_avx512(const float* blk) {
  return _mm512_reduce_add_ps(_mm512_loadu_ps(blk));
}

__attribute__((target("avx512f,avx2,fma"))) inline __m512 load_scaled(const float* z, int64_t j, int64_t V,
                                                                       bool greedy, __m512 T) {
  const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                        block_mask(V - j), z + j);
  return greedy ? x : _mm512_div_ps(x, T);
}

__attribute__((target("avx512f,avx2,fma"))) RowResult row_avx512(const float* z, int64_t V, float Tf, double u,
                                                                   std::vector<float>& e) {
  const bool greedy = Tf == 0.0f;
  const __m512 T = _mm512_set1_ps(greedy ? 1.0f : Tf);
  // pass 1: per-lane max and the index of its first occurrence; NaN anywhere ends the row
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i varg = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t j = 0; j < V; j += 16, idx = _mm512_add_epi32(idx, step)) {
    const __m512 x = load_scaled(z, j, V, greedy, T);
    if (_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)) {
      for (int64_t i = j;; ++i)
        if (std::isnan(z[i])) return {i, std::numeric_limits<float>::quiet_NaN()};
    }
    const __mmask16 gt = _mm512_cmp_ps_mask(x, vmax, _CMP_GT_OQ);
    vmax = _mm512_mask_mov_ps(vmax, gt, x);
    varg = _mm512_mask_mov_epi32(varg, gt, idx);
  }
  const float m = _mm512_reduce_max_ps(vmax);
  const __mmask16 at_max = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m), _CMP_EQ_OQ);
  const int64_t arg = _mm512_mask_reduce_min_epi32(at_max, varg);  // first occurrence overall
  if (!std::isfinite(m)) return {arg, std::numeric_limits<float>::quiet_NaN()};  // as in row_scalar
  // pass 2: e = exp(z' - m), block sums added in double
  const __m512 mv = _mm512_set1_ps(m);
  if (!greedy) e.resize(static_cast<size_t>(V));
  double S = 0.0;
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 t = block_mask(V - j);
    const __m512 x = _mm512_maskz_mov_ps(t, exp_nonpositive_avx512(_mm512_sub_ps(load_scaled(z, j, V, greedy, T), mv)));
    if (!greedy) _mm512_mask_storeu_ps(e.data() + j, t, x);
    S += _mm512_reduce_add_ps(x);
  }
  const int64_t y = greedy ? arg : draw(e.data(), V, S, u, &block_sum_avx512);
  const float zy = greedy ? z[y] : z[y] / Tf;
  return {y, static_cast<float>(static_cast<double>(zy) - m - std::log(S))};
}
#endif

RowResult row(const float* z, int64_t V, float T, double u, std::vector<float>& e) {
#ifdef LLAMARL_X86
  if (cpu_uses_avx512()) return row_avx512(z, V, T, u, e);
#endif
  return row_scalar(z, V, T, u, e);
}

}  // namespace

void sample_f32_cpu(const float* logits, int64_t N, int64_t V, float temperature, const double* u, int64_t* tokens,
                    float* logprobs, int num_threads) {
  if (N < 0 || V < 1) throw std::invalid_argument("sample_f32_cpu: need N >= 0 and V >= 1");
  if (!(temperature >= 0.0f) || std::isinf(temperature))
    throw std::invalid_argument("sample_f32_cpu: temperature must be finite and >= 0 (0 = greedy)");
  if (temperature > 0.0f && u == nullptr) throw std::invalid_argument("sample_f32_cpu: sampling needs uniforms u");
  if (num_threads < 1) throw std::invalid_argument("sample_f32_cpu: num_threads must be >= 1");
  // below ~256 K values per thread a thread costs more than it saves
  const int threads = static_cast<int>(std::min<int64_t>({num_threads, std::max<int64_t>(1, N * V / 262144), N}));
  parallel_ranges(N, threads, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> e;
    for (int64_t n = n0; n < n1; ++n) {
      const RowResult r = row(logits + n * V, V, temperature, temperature > 0.0f ? u[n] : 0.0, e);
      tokens[n] = r.token;
      logprobs[n] = r.logprob;
    }
  });
}

}  // namespace llamarl
