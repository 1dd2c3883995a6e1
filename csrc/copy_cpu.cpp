// Host side of the copy engine: bounds validation and a persistent thread pool doing strided memcpy.
// Ops are first resolved to Segments (raw pointers), so plain and indexed schedules share one executor.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "copy_engine.h"
#include "thread_pool.h"

namespace llamarl {

namespace {

// offset + (rows - 1) * stride + row_bytes, the end of an op's footprint; false if it overflows int64
// (a wrapped end would pass the bounds check and let the copy write anywhere).
bool footprint_end(int64_t offset, int64_t rows, int64_t stride, int64_t row_bytes, int64_t* end) {
  int64_t span;
  return !__builtin_mul_overflow(rows - 1, stride, &span) && !__builtin_add_overflow(offset, span, &span) &&
         !__builtin_add_overflow(span, row_bytes, end);
}

}  // namespace

void validate_ops(const CopyOp* ops, size_t n, int64_t src_nbytes, int64_t dst_nbytes) {
  for (size_t i = 0; i < n; ++i) {
    const CopyOp& op = ops[i];
    auto fail = [&](const std::string& what) {
      throw std::invalid_argument("copy op " + std::to_string(i) + ": " + what +
                                  " (src_offset=" + std::to_string(op.src_offset) +
                                  ", dst_offset=" + std::to_string(op.dst_offset) +
                                  ", rows=" + std::to_string(op.rows) +
                                  ", row_bytes=" + std::to_string(op.row_bytes) +
                                  ", src_stride=" + std::to_string(op.src_stride) +
                                  ", dst_stride=" + std::to_string(op.dst_stride) + ")");
    };
    if (op.rows < 0 || op.row_bytes < 0) fail("negative rows or row_bytes");
    if (op.src_offset < 0 || op.dst_offset < 0) fail("negative offset");
    if (op.rows == 0 || op.row_bytes == 0) continue;
    if (op.rows > 1 && (op.src_stride < op.row_bytes || op.dst_stride < op.row_bytes))
      fail("stride smaller than row_bytes: rows would overlap");
    int64_t src_end, dst_end;
    if (!footprint_end(op.src_offset, op.rows, op.src_stride, op.row_bytes, &src_end))
      fail("the source footprint overflows int64");
    if (!footprint_end(op.dst_offset, op.rows, op.dst_stride, op.row_bytes, &dst_end))
      fail("the destination footprint overflows int64");
    if (src_end > src_nbytes)
      fail("reads past the end of the source buffer (" + std::to_string(src_end) + " > " +
           std::to_string(src_nbytes) + " bytes)");
    if (dst_end > dst_nbytes)
      fail("writes past the end of the destination buffer (" + std::to_string(dst_end) + " > " +
           std::to_string(dst_nbytes) + " bytes)");
  }
}

void validate_indexed_ops(const IndexedCopyOp* ops, size_t n, const int64_t* src_nbytes, size_t n_src,
                          const int64_t* dst_nbytes, size_t n_dst) {
  for (size_t i = 0; i < n; ++i) {
    const IndexedCopyOp& op = ops[i];
    if (op.src_buf < 0 || op.src_buf >= static_cast<int64_t>(n_src))
      throw std::invalid_argument("copy op " + std::to_string(i) + ": src_buf=" + std::to_string(op.src_buf) +
                                  " is not an index into the " + std::to_string(n_src) + " source buffers");
    if (op.dst_buf < 0 || op.dst_buf >= static_cast<int64_t>(n_dst))
      throw std::invalid_argument("copy op " + std::to_string(i) + ": dst_buf=" + std::to_string(op.dst_buf) +
                                  " is not an index into the " + std::to_string(n_dst) +
                                  " destination buffers");
    const CopyOp plain{op.src_offset, op.dst_offset, op.rows, op.row_bytes, op.src_stride, op.dst_stride};
    try {
      validate_ops(&plain, 1, src_nbytes[op.src_buf], dst_nbytes[op.dst_buf]);
    } catch (const std::invalid_argument& e) {
      // Re-label "copy op 0" with the real index and the buffers involved.
      std::string msg = e.what();
      msg = "copy op " + std::to_string(i) + " (src_buf " + std::to_string(op.src_buf) + ", dst_buf " +
            std::to_string(op.dst_buf) + ")" + msg.substr(msg.find(':'));
      throw std::invalid_argument(msg);
    }
  }
}

// The pool grows to the largest thread count asked for; a replaced pool stays alive while in use.
std::shared_ptr<ThreadPool> pool_for(int threads) {
  static std::mutex mu;
  static std::shared_ptr<ThreadPool> pool;
  std::lock_guard<std::mutex> g(mu);
  if (!pool || pool->size() < threads - 1) pool = std::make_shared<ThreadPool>(threads - 1);
  return pool;
}

namespace {

struct Piece {  // a row range of one segment
  size_t seg;
  int64_t row_begin, row_end;
};

}  // namespace

void copy_segments_cpu(const Segment* segs, size_t n, int num_threads) {
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) total += segs[i].rows * segs[i].row_bytes;
  if (total == 0) return;
  constexpr int64_t kMinBytesPerThread = 1 << 20;
  const int threads = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(num_threads, (total + kMinBytesPerThread - 1) / kMinBytesPerThread)));

  // Cut the byte stream into `threads` contiguous shares, splitting segments on row boundaries; a
  // contiguous segment (both strides == row_bytes) is first viewed as rows of at most 64 KiB so that
  // one big tensor is still spread over every thread.
  constexpr int64_t kChunk = 64 << 10;
  std::vector<Segment> work_segs;
  work_segs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Segment s = segs[i];
    if (s.rows == 0 || s.row_bytes == 0) continue;
    const bool dense = (s.rows == 1) || (s.src_stride == s.row_bytes && s.dst_stride == s.row_bytes);
    const int64_t bytes = s.rows * s.row_bytes;
    if (dense && bytes > kChunk && threads > 1) {
      const int64_t full = bytes / kChunk;
      work_segs.push_back({s.src, s.dst, full, kChunk, kChunk, kChunk});
      if (bytes % kChunk)
        work_segs.push_back({s.src + full * kChunk, s.dst + full * kChunk, 1, bytes % kChunk, 0, 0});
      continue;
    }
    work_segs.push_back(s);
  }
  std::vector<std::vector<Piece>> shares(threads);
  const int64_t per = (total + threads - 1) / threads;
  int share = 0;
  int64_t filled = 0;
  for (size_t i = 0; i < work_segs.size(); ++i) {
    const Segment& sg = work_segs[i];
    int64_t r = 0;
    while (r < sg.rows) {
      int64_t room_rows = std::max<int64_t>(1, (per - filled) / sg.row_bytes);
      int64_t take = std::min(sg.rows - r, room_rows);
      shares[share].push_back({i, r, r + take});
      filled += take * sg.row_bytes;
      r += take;
      if (filled >= per && share + 1 < threads) {
        ++share;
        filled = 0;
      }
    }
  }
  auto work = [&](int t) {
    for (const Piece& p : shares[t]) {
      const Segment& sg = work_segs[p.seg];
      if (sg.src_stride == sg.row_bytes && sg.dst_stride == sg.row_bytes) {
        std::memcpy(sg.dst + p.row_begin * sg.row_bytes, sg.src + p.row_begin * sg.row_bytes,
                    static_cast<size_t>((p.row_end - p.row_begin) * sg.row_bytes));
        continue;
      }
      for (int64_t r = p.row_begin; r < p.row_end; ++r)
        std::memcpy(sg.dst + r * sg.dst_stride, sg.src + r * sg.src_stride, static_cast<size_t>(sg.row_bytes));
    }
  };
  if (threads == 1) {
    work(0);
    return;
  }
  pool_for(threads)->run(threads, work);
}

void copy_ops_cpu(const uint8_t* src, uint8_t* dst, const CopyOp* ops, size_t n, int num_threads) {
  std::vector<Segment> segs(n);
  for (size_t i = 0; i < n; ++i)
    segs[i] = {src + ops[i].src_offset, dst + ops[i].dst_offset, ops[i].rows, ops[i].row_bytes,
               ops[i].src_stride, ops[i].dst_stride};
  copy_segments_cpu(segs.data(), n, num_threads);
}

std::string compiler_info() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return "gcc " + std::to_string(__GNUC__) + "." + std::to_string(__GNUC_MINOR__) + "." +
         std::to_string(__GNUC_PATCHLEVEL__);
#else
  return "unknown";
#endif
}

}  // namespace llamarl
