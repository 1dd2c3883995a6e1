// CUDA IPC for flat weight buckets: allocate, export one handle per bucket, open and close mappings.
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda_check.cuh"
#include "cuda_ipc.h"

namespace llamarl {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes, "cudaIpcMemHandle_t is 64 bytes");

uint64_t cuda_malloc(int64_t nbytes, int device) {
  if (nbytes <= 0) throw std::invalid_argument("cuda_malloc: nbytes must be > 0, got " + std::to_string(nbytes));
  DeviceGuard guard(device);
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, static_cast<size_t>(nbytes));
  if (err != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    throw std::runtime_error("cannot allocate a " + std::to_string(nbytes) + "-byte weight bucket on cuda:" +
                             std::to_string(device) + " (" + cudaGetErrorName(err) + "; " +
                             std::to_string(free_b) + " of " + std::to_string(total_b) +
                             " bytes free): free memory on that device or use fewer version slots");
  }
  return reinterpret_cast<uint64_t>(p);
}

void cuda_free(uint64_t ptr, int device) {
  DeviceGuard guard(device);
  const cudaError_t err = cudaFree(reinterpret_cast<void*>(ptr));
  if (cuda_shutting_down(err)) return;  // the driver frees everything at process exit anyway
  LLAMARL_CUDA_CHECK(err);
}

void cuda_memset(uint64_t ptr, int value, int64_t nbytes, int device) {
  DeviceGuard guard(device);
  LLAMARL_CUDA_CHECK(cudaMemset(reinterpret_cast<void*>(ptr), value, static_cast<size_t>(nbytes)));
  LLAMARL_CUDA_CHECK(cudaDeviceSynchronize());
}

std::string cuda_ipc_get_handle(uint64_t ptr, int device) {
  DeviceGuard guard(device);
  cudaIpcMemHandle_t h;
  LLAMARL_CUDA_CHECK(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(ptr)));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

uint64_t cuda_ipc_open(const std::string& handle, int device) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t))
    throw std::invalid_argument("cuda_ipc_open: a CUDA IPC handle is 64 bytes, got " +
                                std::to_string(handle.size()));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  DeviceGuard guard(device);
  void* p = nullptr;
  LLAMARL_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<uint64_t>(p);
}

void cuda_ipc_close(uint64_t ptr, int device) {
  DeviceGuard guard(device);
  const cudaError_t err = cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr));
  if (cuda_shutting_down(err)) return;
  LLAMARL_CUDA_CHECK(err);
}

}  // namespace llamarl
