// Compiled instead of the .cu files when the CUDA part is not built: every CUDA entry point raises.
#include <stdexcept>

#include "copy_engine.h"
#include "cuda_ipc.h"

namespace llamarl {

namespace {
[[noreturn]] void no_cuda(const char* fn) {
  throw std::runtime_error(std::string(fn) +
                           ": llamarl._C was built without CUDA (nvcc was not found or "
                           "LLAMARL_BUILD_CUDA=0). Reinstall on a machine with nvcc: "
                           "pip install --no-build-isolation -e .");
}
}  // namespace

bool cuda_compiled() { return false; }
int cuda_runtime_version() { no_cuda("cuda_runtime_version"); }
int cuda_device_count() { return 0; }
void copy_segments_cuda(const Segment*, size_t, int, uint64_t, int, CudaCopyEngine) { no_cuda("copy_segments_cuda"); }
void copy_segments_kernel(const Segment*, size_t, uint64_t, int) { no_cuda("copy_segments_kernel"); }
void copy_ops_cuda(uint64_t, uint64_t, const CopyOp*, size_t, int, uint64_t, int, CudaCopyEngine) {
  no_cuda("copy_ops_cuda");
}
void cuda_synchronize(int) { no_cuda("cuda_synchronize"); }
uint64_t cuda_malloc(int64_t, int) { no_cuda("cuda_malloc"); }
void cuda_free(uint64_t, int) { no_cuda("cuda_free"); }
void cuda_memset(uint64_t, int, int64_t, int) { no_cuda("cuda_memset"); }
std::string cuda_ipc_get_handle(uint64_t, int) { no_cuda("cuda_ipc_get_handle"); }
uint64_t cuda_ipc_open(const std::string&, int) { no_cuda("cuda_ipc_open"); }
void cuda_ipc_close(uint64_t, int) { no_cuda("cuda_ipc_close"); }

}  // namespace llamarl
