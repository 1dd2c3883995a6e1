// Copy schedules: the unit of work of the DDMA weight sync.
//
// A CopyOp moves `rows` rows of `row_bytes` bytes each from a source buffer to a destination buffer:
//   for r in [0, rows): dst[dst_offset + r*dst_stride : +row_bytes] = src[src_offset + r*src_stride : +row_bytes]
// All quantities are bytes. A schedule is an array of CopyOps between one (src, dst) buffer pair; the
// planner guarantees destination ranges of one schedule never overlap, so ops may run in any order and
// on any number of threads/streams.
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

// Throws std::invalid_argument naming the op index and the violated bound.
void validate_ops(const CopyOp* ops, size_t n, int64_t src_nbytes, int64_t dst_nbytes);

// Host copies on a persistent thread pool; work is split by bytes, large ops by row ranges.
void copy_ops_cpu(const uint8_t* src, uint8_t* dst, const CopyOp* ops, size_t n, int num_threads);

// CUDA part (cuda_copy.cu). Without CUDA these throw std::runtime_error.
bool cuda_compiled();
int cuda_runtime_version();
int cuda_device_count();
// Enqueues every op as a cudaMemcpy2DAsync on `num_streams` internal streams (round robin by bytes),
// then makes `stream` (0 = legacy default) wait on all of them; returns without a host sync.
void copy_ops_cuda(uint64_t src, uint64_t dst, const CopyOp* ops, size_t n, int num_streams,
                   uint64_t stream, int device);
void cuda_synchronize(int device);

std::string compiler_info();

}  // namespace llamarl
