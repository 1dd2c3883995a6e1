// The SM copy engine: a whole copy schedule executed by one kernel launch on the caller's stream.
//
// Why a kernel next to cudaMemcpy(2D)Async: a copy into memory another process exported (a CUDA IPC
// mapping of a generator's bucket) is routed by the driver as a peer copy, which the copy engines serve
// at a lower rate than the SMs reach (H200 2026-11-30: 291 cudaMemcpyAsync into IPC buckets 10.6 ms for
// 16.06 GB, 291 torch copy_ kernels 8.4 ms, one same-process copy 7.5 ms); and one launch replaces one
// API call per op.
//
// Work decomposition. Each segment (rows x row_bytes, strided on both sides) is first flattened to one
// row when it is contiguous on both sides. A segment is cut into units: a unit is `rows_per_unit` rows
// times one chunk of at most kChunkBytes bytes of each row (long rows: one row, one chunk; short rows:
// as many whole rows as fit in kChunkBytes). Units are numbered globally (`unit_begin` is the prefix sum)
// and blocks stride over them; a block finds its segment by binary search over unit_begin, then copies
// the unit with the widest access (16, 8, 4, 2 or 1 bytes) that divides both addresses, both strides and
// the row length. Destination ranges never overlap (the planner's guarantee), so units are independent.
//
// The segment table travels as the kernel's parameter (CUDA >= 12.1 allows 32 KB of parameters on
// sm_70+), up to kBatch segments per launch; longer schedules take several launches on the same stream.
// Parameters are copied at launch, so no device allocation, no host->device copy that could make the
// host wait on the stream, and no table an earlier launch could still be reading.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "copy_engine.h"
#include "cuda_check.cuh"

namespace llamarl {

namespace {

constexpr int64_t kChunkBytes = 256 * 1024;
constexpr int kThreads = 512;
constexpr int kBatch = 384;  // segments per launch: 384 * 80 B + 16 B stays under the 32764-byte limit

struct KernelSegment {
  Segment s;               // contiguous 2-D segments flattened to one row
  int64_t rows_per_unit;   // >= 1
  int64_t chunks_per_row;  // >= 1
  int64_t unit_begin;      // global index of this segment's first unit
  int64_t vec;             // access width in bytes: 16, 8, 4, 2 or 1
};

struct SegmentBatch {
  int64_t n;
  int64_t units;  // total units of the batch
  KernelSegment segs[kBatch];
};
static_assert(sizeof(SegmentBatch) <= 32764, "kernel parameters are limited to 32764 bytes");

template <typename T>
__device__ void copy_unit(const Segment& s, int64_t r0, int64_t nrows, int64_t b0, int64_t nbytes) {
  // nrows rows of nbytes bytes (both multiples of sizeof(T) by construction), starting at row r0, byte b0.
  const int64_t per_row = nbytes / static_cast<int64_t>(sizeof(T));
  const int64_t total = per_row * nrows;
  const uint8_t* src = s.src + r0 * s.src_stride + b0;
  uint8_t* dst = s.dst + r0 * s.dst_stride + b0;
  if (nrows == 1) {
    const T* sp = reinterpret_cast<const T*>(src);
    T* dp = reinterpret_cast<T*>(dst);
    // Four loads in flight per thread before the stores: enough outstanding reads to cover HBM latency.
    int64_t i = threadIdx.x;
    for (; i + 3 * kThreads < total; i += 4 * kThreads) {
      T a = sp[i], b = sp[i + kThreads], c = sp[i + 2 * kThreads], d = sp[i + 3 * kThreads];
      dp[i] = a;
      dp[i + kThreads] = b;
      dp[i + 2 * kThreads] = c;
      dp[i + 3 * kThreads] = d;
    }
    for (; i < total; i += kThreads) dp[i] = sp[i];
    return;
  }
  for (int64_t i = threadIdx.x; i < total; i += kThreads) {
    const int64_t r = i / per_row;
    const int64_t c = i - r * per_row;
    *reinterpret_cast<T*>(dst + r * s.dst_stride + c * static_cast<int64_t>(sizeof(T))) =
        *reinterpret_cast<const T*>(src + r * s.src_stride + c * static_cast<int64_t>(sizeof(T)));
  }
}

// __grid_constant__: the batch stays in parameter memory and is indexed there (without it every thread
// would copy the 30 KB struct to local memory).
__global__ void __launch_bounds__(kThreads) batched_copy_kernel(const __grid_constant__ SegmentBatch batch) {
  __shared__ KernelSegment seg;
  for (int64_t u = blockIdx.x; u < batch.units; u += gridDim.x) {
    __syncthreads();  // every thread is done with the previous unit's `seg`
    if (threadIdx.x == 0) {
      int64_t lo = 0, hi = batch.n - 1;  // the last segment whose unit_begin <= u
      while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (batch.segs[mid].unit_begin <= u) lo = mid; else hi = mid - 1;
      }
      seg = batch.segs[lo];
    }
    __syncthreads();
    const int64_t local = u - seg.unit_begin;
    const int64_t group = local / seg.chunks_per_row;
    const int64_t chunk = local - group * seg.chunks_per_row;
    const int64_t r0 = group * seg.rows_per_unit;
    const int64_t nrows = min(seg.rows_per_unit, seg.s.rows - r0);
    const int64_t b0 = chunk * kChunkBytes;
    const int64_t nbytes = min(kChunkBytes, seg.s.row_bytes - b0);
    switch (seg.vec) {
      case 16: copy_unit<uint4>(seg.s, r0, nrows, b0, nbytes); break;
      case 8: copy_unit<uint2>(seg.s, r0, nrows, b0, nbytes); break;
      case 4: copy_unit<uint32_t>(seg.s, r0, nrows, b0, nbytes); break;
      case 2: copy_unit<uint16_t>(seg.s, r0, nrows, b0, nbytes); break;
      default: copy_unit<uint8_t>(seg.s, r0, nrows, b0, nbytes); break;
    }
  }
}

// Widest power-of-two access width (<= 16 bytes) dividing every address, stride and length involved.
int64_t access_width(const Segment& s) {
  const uint64_t bits = reinterpret_cast<uint64_t>(s.src) | reinterpret_cast<uint64_t>(s.dst) |
                        static_cast<uint64_t>(s.row_bytes) |
                        (s.rows > 1 ? static_cast<uint64_t>(s.src_stride | s.dst_stride) : 0);
  int64_t w = 16;
  while (w > 1 && (bits & static_cast<uint64_t>(w - 1))) w /= 2;
  return w;
}

int num_sms(int device) {
  int n = 0;
  LLAMARL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

}  // namespace

void copy_segments_kernel(const Segment* segs, size_t n, uint64_t stream, int device) {
  DeviceGuard guard(device);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int64_t max_grid = static_cast<int64_t>(num_sms(device)) * 4;
  SegmentBatch batch;
  batch.n = 0;
  batch.units = 0;
  auto launch = [&]() {
    if (batch.n == 0) return;
    const int64_t grid = std::min<int64_t>(batch.units, max_grid);
    batched_copy_kernel<<<static_cast<unsigned>(grid), kThreads, 0, s>>>(batch);
    LLAMARL_CUDA_CHECK(cudaGetLastError());
    batch.n = 0;
    batch.units = 0;
  };
  for (size_t i = 0; i < n; ++i) {
    Segment sg = segs[i];
    if (sg.rows == 0 || sg.row_bytes == 0) continue;
    if (sg.rows > 1 && sg.src_stride == sg.row_bytes && sg.dst_stride == sg.row_bytes) {  // one long row
      sg.row_bytes *= sg.rows;
      sg.rows = 1;
    }
    KernelSegment k{sg, 1, 1, batch.units, access_width(sg)};
    if (sg.row_bytes >= kChunkBytes) {
      k.chunks_per_row = (sg.row_bytes + kChunkBytes - 1) / kChunkBytes;
    } else {
      k.rows_per_unit = std::max<int64_t>(1, kChunkBytes / sg.row_bytes);
    }
    batch.units += ((sg.rows + k.rows_per_unit - 1) / k.rows_per_unit) * k.chunks_per_row;
    batch.segs[batch.n++] = k;
    if (batch.n == kBatch) launch();
  }
  launch();
}

}  // namespace llamarl
