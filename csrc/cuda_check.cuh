// Error checking and device scoping shared by the CUDA sources of llamarl._C.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

// Every CUDA call is checked; a failure throws std::runtime_error naming the call and the CUDA error.
#define LLAMARL_CUDA_CHECK(expr)                                                              \
  do {                                                                                        \
    cudaError_t err__ = (expr);                                                               \
    if (err__ != cudaSuccess) {                                                               \
      cudaGetLastError();                                                                     \
      throw std::runtime_error(std::string("CUDA error in ") + #expr + ": " +                 \
                               cudaGetErrorName(err__) + " (" + cudaGetErrorString(err__) + \
                               ")");                                                          \
    }                                                                                         \
  } while (0)

namespace llamarl {

// Makes `device` current for the scope and restores the caller's device afterwards, so the engine
// never changes which GPU the caller's framework (torch) considers current on this thread.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    LLAMARL_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) LLAMARL_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

// True for the errors CUDA returns while the process is shutting down (destructors ignore them).
inline bool cuda_shutting_down(cudaError_t err) {
  return err == cudaErrorCudartUnloading || err == cudaErrorContextIsDestroyed;
}

}  // namespace llamarl
