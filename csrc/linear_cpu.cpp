// Small-batch fp32 linear layer on the CPU: y[M, N] = x[M, K] · w[N, K]ᵀ for decode (M = 1..16 rows).
//
// Decoding reads every weight once per generated token, so it runs at the speed the weights stream from
// memory. Library GEMMs are tuned for large M; at M = 1..16 they read the weights far below the memory
// bandwidth. This kernel walks the weight matrix once, row after row - one sequential stream, which the
// hardware prefetcher follows at full speed (on the 2-core benchmark host one stream reads at 25 GB/s,
// four interleaved rows at 12) - and meets each weight row with the M inputs in register tiles of MC <= 4
// dot products: one weight vector and MC input vectors loaded per step of the vector width, MC fused
// multiply-adds. The inputs stay in L1/L2, so the weights are read from memory exactly once. From 5
// inputs on, where loads and FMAs rather than the stream bound the time, AVX-512 takes rows of >= 512
// values four at a time (4 x MC tiles: 4 + MC loads per 4 * MC FMAs; see four_rows).
// Accumulation is fp32 in vector lanes, reduced at the end of each dot product (a different summation
// order than a BLAS, i.e. fp32 rounding-level differences), in the same order on every path, so a
// row's result depends neither on the thread split nor on the batch around it.
//
// Instruction sets are picked at load time (AVX-512F, else AVX2+FMA, else portable C++; the environment
// variable LLAMARL_CPU_ISA=avx2|scalar caps the choice), so one build runs on any x86-64 (or other) host. Work is split over output rows (N) on the shared thread pool.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "cpu_simd.h"
#include "linear_cpu.h"
#include "thread_pool.h"

namespace llamarl {
namespace {

// ----------------------------------------------------------------------------------- portable
template <int MC>
void tile_scalar(const float* w, const float* const* x, int64_t K, float* out) {
  float acc[MC] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int m = 0; m < MC; ++m) acc[m] += w[k] * x[m][k];
  for (int m = 0; m < MC; ++m) out[m] = acc[m];
}

#ifdef LLAMARL_X86
// ----------------------------------------------------------------------------------- reductions
// out[i] = the sum of the lanes of v[i], i < n, for n <= 16 vectors (padded to groups of 8 with zeros).
__attribute__((target("avx2,fma"))) inline void hsum_many(__m256* v, int n, float* out) {
  for (int g = 0; g < n; g += 8) {
    __m256 group[8];
    for (int i = 0; i < 8; ++i) group[i] = g + i < n ? v[g + i] : _mm256_setzero_ps();
    alignas(32) float sums[8];
    _mm256_store_ps(sums, hsum8x8(group));
    for (int i = 0; i < 8 && g + i < n; ++i) out[g + i] = sums[i];
  }
}

// ----------------------------------------------------------------------------------- AVX2 + FMA
template <int MC>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* w, const float* const* x, int64_t K, float* out) {
  __m256 acc[MC];
  for (int m = 0; m < MC; ++m) acc[m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = _mm256_loadu_ps(w + k);
    for (int m = 0; m < MC; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[m] + k), acc[m]);
  }
  hsum_many(acc, MC, out);
  for (; k < K; ++k)  // the tail, element by element
    for (int m = 0; m < MC; ++m) out[m] += w[k] * x[m][k];
}

// ----------------------------------------------------------------------------------- AVX-512
template <int MC>
__attribute__((target("avx512f,avx2,fma"))) void tile_avx512(const float* w, const float* const* x, int64_t K,
                                                              float* out) {
  __m512 acc[MC];
  for (int m = 0; m < MC; ++m) acc[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 wv = _mm512_loadu_ps(w + k);
    for (int m = 0; m < MC; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[m] + k), acc[m]);
  }
  if (k < K) {  // the tail, with masked loads (masked-off lanes read as 0 and touch no memory)
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512 wv = _mm512_maskz_loadu_ps(mask, w + k);
    for (int m = 0; m < MC; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x[m] + k), acc[m]);
  }
  __m256 halves[MC];  // fold each 16-lane accumulator to 8 lanes, then sum 8 at a time
  for (int m = 0; m < MC; ++m) halves[m] = fold16(acc[m]);
  hsum_many(halves, MC, out);
}

// Four consecutive weight rows (row stride K) against MC inputs: 4 + MC vector loads feed 4 * MC fused
// multiply-adds per step, against 1 + MC loads for 1 * MC in tile_avx512. out[r * MC + m] = <w_r, x[m]>.
template <int MC>
__attribute__((target("avx512f,avx2,fma"))) void tile4_avx512(const float* w, const float* const* x, int64_t K,
                                                               float* out) {
  __m512 acc[4][MC];
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = _mm512_loadu_ps(w + r * K + k);
    for (int m = 0; m < MC; ++m) {
      const __m512 xv = _mm512_loadu_ps(x[m] + k);
      for (int r = 0; r < 4; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w + r * K + k);
    for (int m = 0; m < MC; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x[m] + k);
      for (int r = 0; r < 4; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
  __m256 halves[4 * MC];
  for (int r = 0; r < 4; ++r)
    for (int m = 0; m < MC; ++m) halves[r * MC + m] = fold16(acc[r][m]);
  hsum_many(halves, 4 * MC, out);
}
#endif

enum class Isa { kScalar, kAvx2, kAvx512 };

// The best the CPU supports, capped by LLAMARL_CPU_ISA=avx2|scalar (tests run every path on one host).
Isa detect_isa() {
  Isa best = Isa::kScalar;
#ifdef LLAMARL_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) best = Isa::kAvx512;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
#endif
  const char* cap = std::getenv("LLAMARL_CPU_ISA");
  if (cap && std::string(cap) == "scalar") return Isa::kScalar;
  if (cap && std::string(cap) == "avx2" && best == Isa::kAvx512) return Isa::kAvx2;
  return best;
}

const Isa kIsa = detect_isa();

// One weight row against MC inputs with the best instruction set: out[m] = <w, x[m]>.
template <int MC>
void tile(const float* w, const float* const* x, int64_t K, float* out) {
#ifdef LLAMARL_X86
  if (kIsa == Isa::kAvx512) return tile_avx512<MC>(w, x, K, out);
  if (kIsa == Isa::kAvx2) return tile_avx2<MC>(w, x, K, out);
#endif
  tile_scalar<MC>(w, x, K, out);
}

// Inputs [m, m + MC) against weight row n, for as long as MC of them are left.
template <int MC>
void row_tiles(const float* x, const float* wr, float* y, int64_t M, int64_t K, int64_t N, int64_t n, int64_t& m) {
  for (; m + MC <= M; m += MC) {
    const float* xr[MC];
    for (int i = 0; i < MC; ++i) xr[i] = x + (m + i) * K;
    float out[MC];
    tile<MC>(wr, xr, K, out);
    for (int i = 0; i < MC; ++i) y[(m + i) * N + n] = out[i];
  }
}

#ifdef LLAMARL_X86
// Inputs [m, m + MC) against weight rows [n, n + 4) (AVX-512), for as long as MC of them are left.
template <int MC>
void row4_tiles(const float* x, const float* wr, float* y, int64_t M, int64_t K, int64_t N, int64_t n, int64_t& m) {
  for (; m + MC <= M; m += MC) {
    const float* xr[MC];
    for (int i = 0; i < MC; ++i) xr[i] = x + (m + i) * K;
    float out[4 * MC];
    tile4_avx512<MC>(wr, xr, K, out);
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < MC; ++i) y[(m + i) * N + n + r] = out[r * MC + i];
  }
}
#endif

// Whether rows go four at a time (tile4_avx512). At M >= 5 a product is bound by loads and FMAs rather
// than by the weight stream, where 4-row tiles need 2.5x fewer loads per FMA; with rows shorter than
// 512 values the four short streams defeat the prefetcher instead. Measured on the 2-core host, one
// thread, M = 8: 768 -> 32000 14.6 -> 10.1 ms, 2048 -> 768 1.01 -> 0.53 ms, 1024 -> 384 266 -> 145 us,
// but 384 -> 32000 3.8 -> 5.6 ms. At M = 4 they pay off only for long rows (weights on 2 MiB pages,
// timed alternately in one process: 4 x 2048 -> 6144 4.4-5.1 -> 3.0-3.1 ms, but 4 x 768 -> 32000
// 4.6-6.1 -> 7.2 ms); at M <= 3 one row at a time was as fast or faster on every shape.
bool four_rows(int64_t M, int64_t K) {
  return kIsa == Isa::kAvx512 && ((M >= 5 && K >= 512) || (M == 4 && K >= 2048));
}

// Whether the one-row path takes inputs 4 at a time: not on AVX-512 at M <= 4, where the 4-input tile
// (one 64-byte weight load and four input loads per four 16-lane FMAs) measured slower than two passes
// of 2 (same host, 2 MiB pages, alternately timed in one process: 4 x 384 -> 32000 2.1-4.4 -> 1.8-2.6
// ms over four runs; at 8 x 384 -> 32000 neither won every run, so M >= 5 keeps the 4-input tile).
bool wide_tiles(int64_t M) { return kIsa != Isa::kAvx512 || M > 4; }

// Rows [n0, n1) of the output for all M inputs: tiles of 4 inputs (4 accumulators + 5 operands; see
// wide_tiles), then the rest in 2s and 1s; a row met by more inputs is re-read from L1.
// (Tiles of 8 on AVX-512, one pass per row, measured slower: 4.7 ms instead of 3.3 ms for
// 8 x 384 -> 32000.) Under four_rows, blocks of four rows take 4 x 4 tiles first.
void rows_range(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
#ifdef LLAMARL_X86
  if (four_rows(M, K)) {
    for (; n0 + 4 <= n1; n0 += 4) {
      const float* wr = w + n0 * K;
      int64_t m = 0;
      row4_tiles<4>(x, wr, y, M, K, N, n0, m);
      row4_tiles<2>(x, wr, y, M, K, N, n0, m);
      row4_tiles<1>(x, wr, y, M, K, N, n0, m);
    }
  }
#endif
  const bool wide = wide_tiles(M);
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    int64_t m = 0;
    if (wide) row_tiles<4>(x, wr, y, M, K, N, n, m);
    row_tiles<2>(x, wr, y, M, K, N, n, m);
    row_tiles<1>(x, wr, y, M, K, N, n, m);
  }
}

}  // namespace

bool cpu_uses_avx512() { return kIsa == Isa::kAvx512; }

std::string linear_cpu_isa() {
  switch (kIsa) {
    case Isa::kAvx512: return "avx512f";
    case Isa::kAvx2: return "avx2+fma";
    default: return "scalar";
  }
}

void linear_f32_cpu(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int num_threads) {
  if (M < 1 || K < 1 || N < 1) throw std::invalid_argument("linear_f32_cpu: M, K and N must be >= 1");
  if (num_threads < 1) throw std::invalid_argument("linear_f32_cpu: num_threads must be >= 1");
  // below ~256 KiB of weights per thread a thread costs more than it saves
  const int64_t by_size = std::max<int64_t>(1, N * K * 4 / (256 << 10));
  const int threads = static_cast<int>(std::min<int64_t>({num_threads, by_size, N}));
  parallel_ranges(N, threads, [&](int64_t n0, int64_t n1) { rows_range(x, w, y, M, K, N, n0, n1); });
}

}  // namespace llamarl
