// Copy schedules: the unit of work of the DDMA weight sync.
//
// A CopyOp moves `rows` rows of `row_bytes` bytes each from a source buffer to a destination buffer:
//   for r in [0, rows): dst[dst_offset + r*dst_stride : +row_bytes] = src[src_offset + r*src_stride : +row_bytes]
// All quantities are bytes. A schedule is an array of CopyOps between one (src, dst) buffer pair; the
// planner guarantees destination ranges of one schedule never overlap, so ops may run in any order and
// on any number of threads/streams.
//
// An IndexedCopyOp is the same op between buffers picked from two tables: `src_buf` indexes a table of
// source buffers (e.g. the trainer's parameter shards), `dst_buf` a table of destination buffers (e.g.
// the generator's flat buckets of every destination rank). One indexed schedule therefore moves a whole
// weight set in one call, with every op bounds-checked against the size of the buffer it names.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace llamarl {

struct CopyOp {
  int64_t src_offset;
  int64_t dst_offset;
  int64_t rows;
  int64_t row_bytes;
  int64_t src_stride;
  int64_t dst_stride;
};
static_assert(sizeof(CopyOp) == 6 * sizeof(int64_t), "CopyOp must be six packed int64 fields");

struct IndexedCopyOp {
  int64_t src_buf;
  int64_t dst_buf;
  int64_t src_offset;
  int64_t dst_offset;
  int64_t rows;
  int64_t row_bytes;
  int64_t src_stride;
  int64_t dst_stride;
};
static_assert(sizeof(IndexedCopyOp) == 8 * sizeof(int64_t), "IndexedCopyOp must be eight packed int64 fields");

// A resolved op: raw pointers, ready to execute.
struct Segment {
  const uint8_t* src;
  uint8_t* dst;
  int64_t rows;
  int64_t row_bytes;
  int64_t src_stride;
  int64_t dst_stride;
};

// Throws std::invalid_argument naming the op index and the violated bound.
void validate_ops(const CopyOp* ops, size_t n, int64_t src_nbytes, int64_t dst_nbytes);
void validate_indexed_ops(const IndexedCopyOp* ops, size_t n, const int64_t* src_nbytes, size_t n_src,
                          const int64_t* dst_nbytes, size_t n_dst);

// Host copies on a persistent thread pool; work is split by bytes, large ops by row ranges.
void copy_segments_cpu(const Segment* segs, size_t n, int num_threads);
void copy_ops_cpu(const uint8_t* src, uint8_t* dst, const CopyOp* ops, size_t n, int num_threads);

// CUDA part (cuda_copy.cu). Without CUDA these throw std::runtime_error.
bool cuda_compiled();
int cuda_runtime_version();
int cuda_device_count();
// Two ways to execute a schedule on a GPU, both enqueued without a host sync:
//   kMemcpy: every segment on one of `num_streams` internal streams (greedy balance by bytes) -
//            cudaMemcpyAsync when it is contiguous on both sides, else cudaMemcpy2DAsync - then `stream`
//            (0 = legacy default) waits on all of them (copies between IPC-mapped buffers may then run
//            on the copy engines);
//   kKernel: the SM copy kernel of cuda_copy_kernel.cu, the whole schedule in one launch (per 384
//            segments) on `stream` itself; `num_streams` is unused.
enum class CudaCopyEngine : int { kMemcpy = 0, kKernel = 1 };
void copy_segments_cuda(const Segment* segs, size_t n, int num_streams, uint64_t stream, int device,
                        CudaCopyEngine engine = CudaCopyEngine::kMemcpy);
void copy_segments_kernel(const Segment* segs, size_t n, uint64_t stream, int device);
void copy_ops_cuda(uint64_t src, uint64_t dst, const CopyOp* ops, size_t n, int num_streams,
                   uint64_t stream, int device, CudaCopyEngine engine = CudaCopyEngine::kMemcpy);
void cuda_synchronize(int device);

std::string compiler_info();

}  // namespace llamarl
