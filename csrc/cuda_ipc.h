// Device buckets shared across processes with CUDA IPC (cuda_ipc.cu; stubs in cuda_stub.cpp).
//
// The owner (a generator rank) allocates each flat bucket with cudaMalloc, so the pointer is the base
// of its own allocation and one cudaIpcMemHandle (64 opaque bytes) names the whole bucket. Peers (the
// trainer ranks) open the handle once; copies then write straight into the mapped bucket, over NVLink
// peer-to-peer when the two processes sit on different GPUs (cudaIpcMemLazyEnablePeerAccess).
// Ownership: the allocating process frees; every opener closes its mapping before the owner frees.
// Every CUDA call is checked and a failure throws std::runtime_error naming the call and the error.
#pragma once

#include <cstdint>
#include <string>

namespace llamarl {

constexpr size_t kCudaIpcHandleBytes = 64;

uint64_t cuda_malloc(int64_t nbytes, int device);
void cuda_free(uint64_t ptr, int device);
void cuda_memset(uint64_t ptr, int value, int64_t nbytes, int device);
std::string cuda_ipc_get_handle(uint64_t ptr, int device);           // 64 bytes
uint64_t cuda_ipc_open(const std::string& handle, int device);       // mapped base pointer
void cuda_ipc_close(uint64_t ptr, int device);

}  // namespace llamarl
