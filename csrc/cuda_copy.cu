// CUDA side of the copy engine: schedules as cudaMemcpy2DAsync spread over several streams, or handed
// to the SM copy kernel (cuda_copy_kernel.cu).
// Every CUDA call is checked (cuda_check.cuh); the caller's current device is restored on return.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "copy_engine.h"
#include "cuda_check.cuh"

namespace llamarl {

bool cuda_compiled() { return true; }

int cuda_runtime_version() {
  int v = 0;
  LLAMARL_CUDA_CHECK(cudaRuntimeGetVersion(&v));
  return v;
}

int cuda_device_count() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    cudaGetLastError();  // clear the sticky error state
    return 0;
  }
  LLAMARL_CUDA_CHECK(err);
  return n;
}

namespace {

struct DeviceStreams {
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> events;
};

DeviceStreams& streams_for(int device, int n) {
  static std::mutex mu;
  static std::vector<DeviceStreams> per_device;
  std::lock_guard<std::mutex> g(mu);
  if (static_cast<int>(per_device.size()) <= device) per_device.resize(device + 1);
  DeviceStreams& ds = per_device[device];
  while (static_cast<int>(ds.streams.size()) < n) {
    cudaStream_t s;
    cudaEvent_t e;
    LLAMARL_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    LLAMARL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    ds.streams.push_back(s);
    ds.events.push_back(e);
  }
  return ds;
}

}  // namespace

void copy_segments_cuda(const Segment* segs, size_t n, int num_streams, uint64_t stream, int device,
                        CudaCopyEngine engine) {
  if (engine == CudaCopyEngine::kKernel) return copy_segments_kernel(segs, n, stream, device);
  if (num_streams < 1) throw std::invalid_argument("num_streams must be >= 1");
  DeviceGuard guard(device);
  DeviceStreams& ds = streams_for(device, num_streams);
  cudaStream_t caller = reinterpret_cast<cudaStream_t>(stream);
  // Work on the internal streams starts after everything already queued on the caller's stream.
  cudaEvent_t start;
  LLAMARL_CUDA_CHECK(cudaEventCreateWithFlags(&start, cudaEventDisableTiming));
  LLAMARL_CUDA_CHECK(cudaEventRecord(start, caller));
  for (int s = 0; s < num_streams; ++s) LLAMARL_CUDA_CHECK(cudaStreamWaitEvent(ds.streams[s], start, 0));
  LLAMARL_CUDA_CHECK(cudaEventDestroy(start));

  // Greedy balance: each op goes to the stream with the fewest bytes so far.
  std::vector<int64_t> load(num_streams, 0);
  for (size_t i = 0; i < n; ++i) {
    const Segment& sg = segs[i];
    if (sg.rows == 0 || sg.row_bytes == 0) continue;
    int s = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    load[s] += sg.rows * sg.row_bytes;
    if (sg.rows == 1 || (sg.src_stride == sg.row_bytes && sg.dst_stride == sg.row_bytes)) {
      // Contiguous on both sides: a plain copy (cudaMemcpy2D caps the pitch at ~2 GiB, cudaMemcpy does not).
      LLAMARL_CUDA_CHECK(cudaMemcpyAsync(sg.dst, sg.src, static_cast<size_t>(sg.rows * sg.row_bytes),
                                         cudaMemcpyDefault, ds.streams[s]));
      continue;
    }
    LLAMARL_CUDA_CHECK(cudaMemcpy2DAsync(sg.dst, static_cast<size_t>(sg.dst_stride), sg.src,
                                         static_cast<size_t>(sg.src_stride), static_cast<size_t>(sg.row_bytes),
                                         static_cast<size_t>(sg.rows), cudaMemcpyDefault, ds.streams[s]));
  }
  for (int s = 0; s < num_streams; ++s) {
    LLAMARL_CUDA_CHECK(cudaEventRecord(ds.events[s], ds.streams[s]));
    LLAMARL_CUDA_CHECK(cudaStreamWaitEvent(caller, ds.events[s], 0));
  }
}

void copy_ops_cuda(uint64_t src, uint64_t dst, const CopyOp* ops, size_t n, int num_streams,
                   uint64_t stream, int device, CudaCopyEngine engine) {
  auto* s8 = reinterpret_cast<const uint8_t*>(src);
  auto* d8 = reinterpret_cast<uint8_t*>(dst);
  std::vector<Segment> segs(n);
  for (size_t i = 0; i < n; ++i)
    segs[i] = {s8 + ops[i].src_offset, d8 + ops[i].dst_offset, ops[i].rows, ops[i].row_bytes,
               ops[i].src_stride, ops[i].dst_stride};
  copy_segments_cuda(segs.data(), n, num_streams, stream, device, engine);
}

void cuda_synchronize(int device) {
  DeviceGuard guard(device);
  LLAMARL_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace llamarl
