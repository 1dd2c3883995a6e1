// The one binding file of llamarl._C: argument checks at the boundary, then the engine.
// Buffers cross as (address, nbytes) pairs so the extension never links libtorch; Python passes
// tensor.data_ptr() / tensor.nbytes (see llamarl/_native.py). Memory this module allocates or maps
// (shared-memory segments, CUDA buckets, CUDA IPC mappings) is owned by a Python object that exposes
// it (buffer protocol / __cuda_array_interface__) and frees it only when the last view is gone.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "copy_engine.h"
#include "decode_layer_cpu.h"
#include "cuda_ipc.h"
#include "attention_cpu.h"
#include "fused_cpu.h"
#include "linear_cpu.h"
#include "sampling_cpu.h"
#include "shm.h"
#include "sync_ctl.h"

namespace py = pybind11;
using llamarl::CopyOp;

namespace {

using OpsArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

const CopyOp* ops_view(const OpsArray& ops, size_t* n) {
  if (ops.ndim() != 2 || ops.shape(1) != 6)
    throw std::invalid_argument(
        "ops must be an int64 array of shape [n, 6] with columns (src_offset, dst_offset, rows, "
        "row_bytes, src_stride, dst_stride); got ndim=" + std::to_string(ops.ndim()) +
        (ops.ndim() == 2 ? ", shape[1]=" + std::to_string(ops.shape(1)) : std::string()));
  *n = static_cast<size_t>(ops.shape(0));
  return reinterpret_cast<const CopyOp*>(ops.data());
}

// CUDA copies spread over this many streams, created once per device and kept: a bound, not a resource leak
constexpr int kMaxCopyStreams = 64;

void check_streams(int num_streams) {
  if (num_streams < 1 || num_streams > kMaxCopyStreams)
    throw std::invalid_argument("num_streams must be in [1, " + std::to_string(kMaxCopyStreams) + "], got " +
                                std::to_string(num_streams));
}

llamarl::CudaCopyEngine cuda_engine(const std::string& name) {
  if (name == "memcpy") return llamarl::CudaCopyEngine::kMemcpy;
  if (name == "kernel") return llamarl::CudaCopyEngine::kKernel;
  throw std::invalid_argument("CUDA copy engine must be 'memcpy' or 'kernel', got '" + name + "'");
}

// The ops as an owned copy: validated and executed with the GIL released, they must be exactly the ops
// checked, whatever another Python thread does to the caller's array meanwhile.
std::vector<CopyOp> ops_copy(const OpsArray& ops) {
  size_t n;
  const CopyOp* p = ops_view(ops, &n);
  return std::vector<CopyOp>(p, p + n);
}

void check_ptr(uint64_t ptr, int64_t nbytes, const char* name) {
  if (nbytes < 0) throw std::invalid_argument(std::string("nbytes of ") + name + " must be >= 0");
  if (ptr == 0 && nbytes > 0) throw std::invalid_argument(std::string(name) + " is a null pointer");
}

// Raw-address kernels: every required pointer must be non-null (their sizes are checked by the kernels).
void check_addresses(std::initializer_list<std::pair<uint64_t, const char*>> ptrs) {
  for (const auto& [p, name] : ptrs)
    if (p == 0) throw std::invalid_argument(std::string(name) + " is a null pointer");
}

// a * b * c bytes of a buffer, refusing negative counts and sizes that overflow int64
int64_t extent(int64_t a, int64_t b, int64_t c, const char* what) {
  int64_t ab, abc;
  if (a < 0 || b < 0 || c < 0 || __builtin_mul_overflow(a, b, &ab) || __builtin_mul_overflow(ab, c, &abc))
    throw std::invalid_argument(std::string(what) + ": sizes must be >= 0 and their product must fit in int64");
  return abc;
}

const llamarl::IndexedCopyOp* indexed_ops_view(const OpsArray& ops, size_t* n) {
  if (ops.ndim() != 2 || ops.shape(1) != 8)
    throw std::invalid_argument(
        "indexed ops must be an int64 array of shape [n, 8] with columns (src_buf, dst_buf, src_offset, "
        "dst_offset, rows, row_bytes, src_stride, dst_stride); got ndim=" + std::to_string(ops.ndim()) +
        (ops.ndim() == 2 ? ", shape[1]=" + std::to_string(ops.shape(1)) : std::string()));
  *n = static_cast<size_t>(ops.shape(0));
  return reinterpret_cast<const llamarl::IndexedCopyOp*>(ops.data());
}

// Checks a buffer table (pointers + sizes) and bounds-checks the ops against it, then resolves them.
std::vector<llamarl::Segment> resolve_indexed(const U64Array& src_ptrs, const I64Array& src_nbytes,
                                              const U64Array& dst_ptrs, const I64Array& dst_nbytes,
                                              const OpsArray& ops) {
  if (src_ptrs.ndim() != 1 || src_nbytes.ndim() != 1 || src_ptrs.shape(0) != src_nbytes.shape(0))
    throw std::invalid_argument("src_ptrs and src_nbytes must be 1-D arrays of the same length");
  if (dst_ptrs.ndim() != 1 || dst_nbytes.ndim() != 1 || dst_ptrs.shape(0) != dst_nbytes.shape(0))
    throw std::invalid_argument("dst_ptrs and dst_nbytes must be 1-D arrays of the same length");
  const size_t n_src = static_cast<size_t>(src_ptrs.shape(0)), n_dst = static_cast<size_t>(dst_ptrs.shape(0));
  for (size_t i = 0; i < n_src; ++i)
    check_ptr(src_ptrs.data()[i], src_nbytes.data()[i], ("src buffer " + std::to_string(i)).c_str());
  for (size_t i = 0; i < n_dst; ++i)
    check_ptr(dst_ptrs.data()[i], dst_nbytes.data()[i], ("dst buffer " + std::to_string(i)).c_str());
  size_t n;
  const llamarl::IndexedCopyOp* p = indexed_ops_view(ops, &n);
  llamarl::validate_indexed_ops(p, n, src_nbytes.data(), n_src, dst_nbytes.data(), n_dst);
  std::vector<llamarl::Segment> segs(n);
  for (size_t i = 0; i < n; ++i) {
    const auto& op = p[i];
    segs[i] = {reinterpret_cast<const uint8_t*>(src_ptrs.data()[op.src_buf]) + op.src_offset,
               reinterpret_cast<uint8_t*>(dst_ptrs.data()[op.dst_buf]) + op.dst_offset,
               op.rows, op.row_bytes, op.src_stride, op.dst_stride};
  }
  return segs;
}

// A range of device memory this object owns: ``release(ptr, device)`` runs once, on destruction
// (errors there are reported on stderr: a destructor must not throw).
class DeviceRegion {
 public:
  using Release = void (*)(uint64_t, int);
  DeviceRegion(uint64_t ptr, int64_t nbytes, int device, Release release, const char* what)
      : ptr_(ptr), nbytes_(nbytes), device_(device), release_(release), what_(what) {}
  DeviceRegion(const DeviceRegion&) = delete;
  DeviceRegion& operator=(const DeviceRegion&) = delete;
  ~DeviceRegion() {
    try {
      release_(ptr_, device_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "llamarl: %s failed: %s\n", what_, e.what());
    }
  }
  uint64_t ptr() const { return ptr_; }
  int64_t nbytes() const { return nbytes_; }
  int device() const { return device_; }

 private:
  uint64_t ptr_;
  int64_t nbytes_;
  int device_;
  Release release_;
  const char* what_;
};

// A device buffer this process allocated with cudaMalloc (one weight bucket); freed on destruction.
class CudaBuffer : public DeviceRegion {
 public:
  CudaBuffer(int64_t nbytes, int device)
      : DeviceRegion(llamarl::cuda_malloc(nbytes, device), nbytes, device, &llamarl::cuda_free,
                     "freeing a CUDA weight bucket") {}
};

// Another process's bucket mapped through its CUDA IPC handle; the mapping is closed on destruction.
class CudaIpcMapping : public DeviceRegion {
 public:
  CudaIpcMapping(const std::string& handle, int64_t nbytes, int device)
      : DeviceRegion(llamarl::cuda_ipc_open(handle, device), nbytes, device, &llamarl::cuda_ipc_close,
                     "closing a CUDA IPC mapping") {}
};

py::dict cuda_array_interface(const DeviceRegion& b) {
  py::dict d;
  d["shape"] = py::make_tuple(b.nbytes());
  d["typestr"] = "|u1";
  d["data"] = py::make_tuple(b.ptr(), false);
  d["version"] = 3;
  d["strides"] = py::none();
  d["stream"] = py::none();  // the producer synchronises before handing a version out
  return d;
}

// A writable, C-contiguous export of a Python buffer (a ShmSegment, or a bytearray for one process): the
// export pins the memory (a bytearray cannot be resized while it is held), so keep it alive for as long as
// the native side uses the pointer, waits without the GIL included.
struct HeldBuffer {
  py::buffer_info info;
  explicit HeldBuffer(const py::buffer& buf) : info(buf.request(/*writable=*/true)) {
    int64_t expect = info.itemsize;
    for (ssize_t d = info.ndim - 1; d >= 0; --d) {
      if (info.shape[d] != 1 && info.strides[d] != expect)
        throw std::invalid_argument("the control block buffer must be C-contiguous (got strides that are not)");
      expect *= info.shape[d];
    }
  }
  size_t nbytes() const { return static_cast<size_t>(info.size * info.itemsize); }
};

// The control block inside a held buffer.
llamarl::SyncCtl* ctl_from(const HeldBuffer& held) { return llamarl::ctl_view(held.info.ptr, held.nbytes()); }

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "llamarl native engine: copy schedules on host threads and CUDA streams";

  m.def("build_info", [] {
    py::dict d;
    d["cuda"] = llamarl::cuda_compiled();
#ifdef LLAMARL_CUDA_VERSION
    d["cuda_version"] = std::string(LLAMARL_CUDA_VERSION);
#else
    d["cuda_version"] = py::none();
#endif
#ifdef LLAMARL_CUDA_ARCHS
    d["cuda_archs"] = std::string(LLAMARL_CUDA_ARCHS);
#else
    d["cuda_archs"] = py::none();
#endif
    d["compiler"] = llamarl::compiler_info();
    d["pybind11"] = std::to_string(PYBIND11_VERSION_MAJOR) + "." +
                    std::to_string(PYBIND11_VERSION_MINOR) + "." +
                    std::to_string(PYBIND11_VERSION_PATCH);
    return d;
  }, "What was compiled: {'cuda': bool, 'cuda_version', 'cuda_archs', 'compiler', 'pybind11'}.");

  m.def("validate_ops", [](const OpsArray& ops, int64_t src_nbytes, int64_t dst_nbytes) {
    size_t n;
    const CopyOp* p = ops_view(ops, &n);
    llamarl::validate_ops(p, n, src_nbytes, dst_nbytes);
  }, py::arg("ops"), py::arg("src_nbytes"), py::arg("dst_nbytes"),
        "Raise ValueError if any op reads or writes outside its buffer.");

  m.def("copy_ops_cpu",
        [](uint64_t src, int64_t src_nbytes, uint64_t dst, int64_t dst_nbytes, const OpsArray& ops,
           int num_threads) {
          if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
          check_ptr(src, src_nbytes, "src");
          check_ptr(dst, dst_nbytes, "dst");
          const std::vector<CopyOp> own = ops_copy(ops);
          llamarl::validate_ops(own.data(), own.size(), src_nbytes, dst_nbytes);
          py::gil_scoped_release nogil;
          llamarl::copy_ops_cpu(reinterpret_cast<const uint8_t*>(src), reinterpret_cast<uint8_t*>(dst),
                                own.data(), own.size(), num_threads);
        },
        py::arg("src"), py::arg("src_nbytes"), py::arg("dst"), py::arg("dst_nbytes"), py::arg("ops"),
        py::arg("num_threads") = 1,
        "Execute a copy schedule between two host buffers on num_threads threads (GIL released).");

  m.def("linear_f32_cpu",
        [](uint64_t x, uint64_t w, uint64_t y, int64_t M, int64_t K, int64_t N, int num_threads) {
          if (M < 1 || K < 1 || N < 1) throw std::invalid_argument("linear_f32_cpu: M, K and N must be >= 1");
          check_ptr(x, extent(M, K, 4, "linear_f32_cpu x"), "x");
          check_ptr(w, extent(N, K, 4, "linear_f32_cpu w"), "w");
          check_ptr(y, extent(M, N, 4, "linear_f32_cpu y"), "y");
          py::gil_scoped_release nogil;
          llamarl::linear_f32_cpu(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(w),
                                  reinterpret_cast<float*>(y), M, K, N, num_threads);
        },
        py::arg("x"), py::arg("w"), py::arg("y"), py::arg("M"), py::arg("K"), py::arg("N"),
        py::arg("num_threads") = 1,
        "y[M, N] = x[M, K] @ w[N, K].T for contiguous fp32 host buffers given by address (GIL released); "
        "weights are read once, for decode-sized M.");
  m.def("linear_cpu_isa", &llamarl::linear_cpu_isa, "Instruction set of linear_f32_cpu: avx512f, avx2+fma or scalar.");
  // Fused decode ops (fused_cpu.cpp): a few hundred values per call, so the GIL stays held (cheaper).
  m.def("rms_norm_f32_cpu",
        [](uint64_t x, uint64_t residual, uint64_t w, uint64_t y, uint64_t h, int64_t rows, int64_t D, float eps) {
          check_addresses({{x, "x"}, {w, "w"}, {y, "y"}});
          llamarl::rms_norm_f32_cpu(reinterpret_cast<const float*>(x), reinterpret_cast<const float*>(residual),
                                    reinterpret_cast<const float*>(w), reinterpret_cast<float*>(y),
                                    reinterpret_cast<float*>(h), rows, D, eps);
        },
        py::arg("x"), py::arg("residual"), py::arg("w"), py::arg("y"), py::arg("h"), py::arg("rows"), py::arg("D"),
        py::arg("eps"),
        "RMSNorm of rows x D contiguous fp32 host buffers given by address; residual = h = 0 for none, else "
        "h = x + residual is written and normalised.");
  m.def("rope_f32_cpu",
        [](uint64_t x, int64_t x_token_stride, uint64_t cos, uint64_t sin, uint64_t out, int64_t tokens,
           int64_t heads, int64_t head_dim) {
          check_addresses({{x, "x"}, {cos, "cos"}, {sin, "signed_sin"}, {out, "out"}});
          llamarl::rope_f32_cpu(reinterpret_cast<const float*>(x), x_token_stride, reinterpret_cast<const float*>(cos),
                                reinterpret_cast<const float*>(sin), reinterpret_cast<float*>(out), tokens, heads,
                                head_dim);
        },
        py::arg("x"), py::arg("x_token_stride"), py::arg("cos"), py::arg("signed_sin"), py::arg("out"),
        py::arg("tokens"), py::arg("heads"), py::arg("head_dim"),
        "RoPE of [tokens, heads, head_dim] fp32 host buffers given by address: x's tokens x_token_stride floats "
        "apart (heads contiguous), out contiguous, cos / signed_sin [tokens, head_dim] contiguous.");
  m.def("rope_kv_f32_cpu",
        [](uint64_t q, uint64_t k, uint64_t v, uint64_t cos, uint64_t sin, const std::vector<int64_t>& strides,
           uint64_t q_out, uint64_t kc, uint64_t vc, const std::vector<int64_t>& cache_strides, uint64_t slots,
           int64_t slot0, int64_t S, int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t Dh) {
          if (strides.size() != 6 || cache_strides.size() != 6)
            throw std::invalid_argument("rope_kv_f32_cpu: strides are (q_sb, q_st, k_sb, k_st, v_sb, v_st) and "
                                        "cache_strides (kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss)");
          check_addresses({{q, "q"}, {k, "k"}, {v, "v"}, {cos, "cos"}, {sin, "signed_sin"}, {q_out, "q_out"},
                           {kc, "k_cache"}, {vc, "v_cache"}});
          auto f = [](uint64_t p) { return reinterpret_cast<float*>(p); };
          llamarl::RopeKvArgs a{f(q), f(k), f(v), f(cos), f(sin), strides[0], strides[1], strides[2], strides[3],
                                strides[4], strides[5], f(q_out), f(kc), f(vc), cache_strides[0], cache_strides[1],
                                cache_strides[2], cache_strides[3], cache_strides[4], cache_strides[5],
                                reinterpret_cast<const int64_t*>(slots), slot0, S, B, T, H, Hkv, Dh};
          llamarl::rope_kv_f32_cpu(a);
        },
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("signed_sin"), py::arg("strides"),
        py::arg("q_out"), py::arg("k_cache"), py::arg("v_cache"), py::arg("cache_strides"), py::arg("slots"),
        py::arg("slot0"), py::arg("S"), py::arg("B"), py::arg("T"), py::arg("H"), py::arg("Hkv"), py::arg("Dh"),
        "RoPE on q and k plus one layer's KV-cache write (fp32 host buffers by address, element strides; "
        "slots = 0: slots slot0 + t).");
  m.def("decode_layer_f32_cpu",
        [](const std::vector<uint64_t>& p, const std::vector<int64_t>& n, float eps, int num_threads) {
          if (p.size() != 15 || n.size() != 16)
            throw std::invalid_argument("decode_layer_f32_cpu: expects 15 addresses and 16 sizes (see bindings.cpp)");
          for (int i : {0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13})  // residual (1) and mask (14) may be 0
            if (p[i] == 0) throw std::invalid_argument("decode_layer_f32_cpu: address " + std::to_string(i) +
                                                       " is a null pointer");
          auto c = [](uint64_t v) { return reinterpret_cast<const float*>(v); };
          auto m = [](uint64_t v) { return reinterpret_cast<float*>(v); };
          llamarl::DecodeLayerArgs a{c(p[0]), c(p[1]), m(p[2]), m(p[3]), c(p[4]), c(p[5]), c(p[6]), c(p[7]), c(p[8]),
                                     c(p[9]), c(p[10]), c(p[11]), m(p[12]), m(p[13]), n[0], n[1], n[2], n[3], n[4],
                                     n[5], n[6], n[7], n[8], c(p[14]), n[9], n[10], n[11], n[12], n[13], n[14], n[15],
                                     eps, num_threads};
          py::gil_scoped_release nogil;
          llamarl::decode_layer_f32_cpu(a);
        },
        py::arg("ptrs"), py::arg("sizes"), py::arg("eps"), py::arg("num_threads") = 1,
        "One decoder layer of a decode step (csrc/decode_layer_cpu.h). ptrs: x, residual (0: none), mlp_out, "
        "h_out, w_norm1, w_norm2, w_qkv, w_o, w_gate_up, w_down, cos, signed_sin, k_cache, v_cache, mask (0: none); "
        "sizes: kc_sb, kc_sh, kc_ss, vc_sb, vc_sh, vc_ss, cache_slots, slot, S, mask_sb, B, D, H, Hkv, Dh, I. "
        "GIL released.");
  m.def("decode_attention_f32_cpu",
        [](uint64_t q, uint64_t k, uint64_t v, uint64_t mask, uint64_t out, int64_t B, int64_t Hkv, int64_t G,
           int64_t S, int64_t D, int64_t k_sb, int64_t k_sh, int64_t k_ss, int64_t v_sb, int64_t v_sh, int64_t v_ss,
           int64_t mask_sb, float scale, int num_threads) {
          check_addresses({{q, "q"}, {k, "k"}, {v, "v"}, {out, "out"}});
          py::gil_scoped_release nogil;
          llamarl::decode_attention_f32_cpu(reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(k),
                                            reinterpret_cast<const float*>(v), reinterpret_cast<const float*>(mask),
                                            reinterpret_cast<float*>(out), B, Hkv, G, S, D, k_sb, k_sh, k_ss, v_sb,
                                            v_sh, v_ss, mask_sb, scale, num_threads);
        },
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("out"), py::arg("B"), py::arg("Hkv"),
        py::arg("G"), py::arg("S"), py::arg("D"), py::arg("k_sb"), py::arg("k_sh"), py::arg("k_ss"), py::arg("v_sb"),
        py::arg("v_sh"), py::arg("v_ss"), py::arg("mask_sb"), py::arg("scale"), py::arg("num_threads") = 1,
        "Decode attention over fp32 host buffers given by address and element strides (mask = 0: none); "
        "GIL released.");
  m.def("sample_f32_cpu",
        [](uint64_t logits, int64_t N, int64_t V, float temperature, uint64_t u, uint64_t tokens, uint64_t logprobs,
           int num_threads) {
          if (N > 0) {
            check_addresses({{logits, "logits"}, {tokens, "tokens"}, {logprobs, "logprobs"}});
            if (temperature != 0.0f) {
              check_addresses({{u, "u"}});
              const double* uu = reinterpret_cast<const double*>(u);
              for (int64_t i = 0; i < N; ++i)
                if (!(uu[i] >= 0.0 && uu[i] < 1.0))
                  throw std::invalid_argument("sample_f32_cpu: u[" + std::to_string(i) + "] = " + std::to_string(uu[i]) +
                                              " is not a uniform in [0, 1)");
            }
          }
          py::gil_scoped_release nogil;
          llamarl::sample_f32_cpu(reinterpret_cast<const float*>(logits), N, V, temperature,
                                  reinterpret_cast<const double*>(u), reinterpret_cast<int64_t*>(tokens),
                                  reinterpret_cast<float*>(logprobs), num_threads);
        },
        py::arg("logits"), py::arg("N"), py::arg("V"), py::arg("temperature"), py::arg("u"), py::arg("tokens"),
        py::arg("logprobs"), py::arg("num_threads") = 1,
        "One token and its log-prob per row of fp32 logits [N, V] (by address): greedy for temperature 0, else "
        "inverse-CDF sampling with the float64 uniforms u [N]; GIL released.");
  m.def("cuda_device_count", &llamarl::cuda_device_count);
  m.def("cuda_runtime_version", &llamarl::cuda_runtime_version);
  m.def("copy_ops_cuda",
        [](uint64_t src, int64_t src_nbytes, uint64_t dst, int64_t dst_nbytes, const OpsArray& ops,
           int num_streams, uint64_t stream, int device, const std::string& engine) {
          check_ptr(src, src_nbytes, "src");
          check_ptr(dst, dst_nbytes, "dst");
          const auto eng = cuda_engine(engine);
          check_streams(num_streams);
          const std::vector<CopyOp> own = ops_copy(ops);
          llamarl::validate_ops(own.data(), own.size(), src_nbytes, dst_nbytes);
          py::gil_scoped_release nogil;
          llamarl::copy_ops_cuda(src, dst, own.data(), own.size(), num_streams, stream, device, eng);
        },
        py::arg("src"), py::arg("src_nbytes"), py::arg("dst"), py::arg("dst_nbytes"), py::arg("ops"),
        py::arg("num_streams") = 4, py::arg("stream") = 0, py::arg("device") = 0, py::arg("engine") = "memcpy",
        "Enqueue a copy schedule between device (or peer/IPC-mapped) buffers: engine 'memcpy' = "
        "cudaMemcpy2DAsync on num_streams streams that `stream` waits for, 'kernel' = the SM copy kernel "
        "on `stream`. No host synchronisation.");
  m.def("cuda_synchronize", &llamarl::cuda_synchronize, py::arg("device") = 0);


  // ---- indexed schedules (many source buffers -> many destination buffers) ----
  m.def("copy_indexed_cpu",
        [](const U64Array& src_ptrs, const I64Array& src_nbytes, const U64Array& dst_ptrs,
           const I64Array& dst_nbytes, const OpsArray& ops, int num_threads) {
          if (num_threads < 1) throw std::invalid_argument("num_threads must be >= 1");
          auto segs = resolve_indexed(src_ptrs, src_nbytes, dst_ptrs, dst_nbytes, ops);
          py::gil_scoped_release nogil;
          llamarl::copy_segments_cpu(segs.data(), segs.size(), num_threads);
        },
        py::arg("src_ptrs"), py::arg("src_nbytes"), py::arg("dst_ptrs"), py::arg("dst_nbytes"), py::arg("ops"),
        py::arg("num_threads") = 1,
        "Execute an indexed [n, 8] schedule between tables of host buffers (GIL released).");
  m.def("copy_indexed_cuda",
        [](const U64Array& src_ptrs, const I64Array& src_nbytes, const U64Array& dst_ptrs,
           const I64Array& dst_nbytes, const OpsArray& ops, int num_streams, uint64_t stream, int device,
           const std::string& engine) {
          const auto eng = cuda_engine(engine);
          check_streams(num_streams);
          auto segs = resolve_indexed(src_ptrs, src_nbytes, dst_ptrs, dst_nbytes, ops);
          py::gil_scoped_release nogil;
          llamarl::copy_segments_cuda(segs.data(), segs.size(), num_streams, stream, device, eng);
        },
        py::arg("src_ptrs"), py::arg("src_nbytes"), py::arg("dst_ptrs"), py::arg("dst_nbytes"), py::arg("ops"),
        py::arg("num_streams") = 4, py::arg("stream") = 0, py::arg("device") = 0, py::arg("engine") = "memcpy",
        "Enqueue an indexed [n, 8] schedule between device / IPC-mapped buffers (engine as copy_ops_cuda).");

  // ---- POSIX shared memory ----
  py::class_<llamarl::ShmSegment>(m, "ShmSegment", py::buffer_protocol(),
                                  "A mapped POSIX shared-memory segment (buffer protocol: torch.frombuffer).")
      .def_static("create", [](const std::string& name, int64_t nbytes) {
            return std::unique_ptr<llamarl::ShmSegment>(llamarl::ShmSegment::create(name, nbytes));
          }, py::arg("name"), py::arg("nbytes"), "Create, reserve and map a new segment (this process owns it).")
      .def_static("attach", [](const std::string& name, int64_t nbytes) {
            return std::unique_ptr<llamarl::ShmSegment>(llamarl::ShmSegment::attach(name, nbytes));
          }, py::arg("name"), py::arg("nbytes"), "Map an existing segment; its size must equal nbytes.")
      .def("unlink", &llamarl::ShmSegment::unlink, "Remove the name (owner only, idempotent).")
      .def_property_readonly("name", &llamarl::ShmSegment::name)
      .def_property_readonly("nbytes", &llamarl::ShmSegment::nbytes)
      .def_property_readonly("owner", &llamarl::ShmSegment::owner)
      .def_property_readonly("unlinked", &llamarl::ShmSegment::unlinked)
      .def_property_readonly("address", [](const llamarl::ShmSegment& s) { return reinterpret_cast<uint64_t>(s.data()); })
      .def_buffer([](llamarl::ShmSegment& s) {
        return py::buffer_info(s.data(), 1, py::format_descriptor<uint8_t>::format(), 1, {s.nbytes()}, {1},
                               /*readonly=*/false);
      });
  m.def("shm_unlink", &llamarl::shm_unlink_name, py::arg("name"),
        "Remove a segment name; False if it did not exist.");
  m.def("pid_alive", &llamarl::pid_alive, py::arg("pid"), "True while pid is a live, non-zombie process.");

  // ---- CUDA buckets and IPC ----
  py::class_<CudaBuffer, std::shared_ptr<CudaBuffer>>(m, "CudaBuffer", "cudaMalloc'd bucket, freed when dropped.")
      .def(py::init<int64_t, int>(), py::arg("nbytes"), py::arg("device"))
      .def_property_readonly("ptr", &CudaBuffer::ptr)
      .def_property_readonly("nbytes", &CudaBuffer::nbytes)
      .def_property_readonly("device", &CudaBuffer::device)
      .def("ipc_handle", [](const CudaBuffer& b) { return py::bytes(llamarl::cuda_ipc_get_handle(b.ptr(), b.device())); },
           "The 64-byte cudaIpcMemHandle of the whole bucket.")
      .def("zero", [](const CudaBuffer& b) { llamarl::cuda_memset(b.ptr(), 0, b.nbytes(), b.device()); })
      .def_property_readonly("__cuda_array_interface__", [](const CudaBuffer& b) { return cuda_array_interface(b); });
  py::class_<CudaIpcMapping, std::shared_ptr<CudaIpcMapping>>(m, "CudaIpcMapping",
                                                              "A peer's bucket opened from its IPC handle.")
      .def(py::init([](py::bytes handle, int64_t nbytes, int device) {
             return std::make_shared<CudaIpcMapping>(std::string(handle), nbytes, device);
           }), py::arg("handle"), py::arg("nbytes"), py::arg("device"))
      .def_property_readonly("ptr", &CudaIpcMapping::ptr)
      .def_property_readonly("nbytes", &CudaIpcMapping::nbytes)
      .def_property_readonly("device", &CudaIpcMapping::device)
      .def_property_readonly("__cuda_array_interface__",
                             [](const CudaIpcMapping& b) { return cuda_array_interface(b); });

  // ---- version control block ----
  py::register_exception<llamarl::SyncTimeout>(m, "SyncTimeout", PyExc_TimeoutError);
  py::register_exception<llamarl::PeerDied>(m, "PeerDied", PyExc_RuntimeError);
  m.attr("CTL_NBYTES") = llamarl::ctl_nbytes();
  m.attr("CTL_MAX_SLOTS") = llamarl::kMaxSlots;
  m.attr("CTL_MAX_PEERS") = llamarl::kMaxPeers;
  m.def("ctl_init", [](const py::buffer& buf, int nslots, int n_writers, int n_readers) {
          HeldBuffer held(buf);
          llamarl::ctl_init(held.info.ptr, held.nbytes(), nslots, n_writers, n_readers);
        }, py::arg("buf"), py::arg("nslots"), py::arg("n_writers"), py::arg("n_readers"));
  m.def("ctl_register", [](const py::buffer& buf, bool writer, int rank, int64_t pid) {
          if (pid < 0 || pid > INT32_MAX) throw std::invalid_argument("pid " + std::to_string(pid) + " is not a process id");
          llamarl::ctl_register(ctl_from(HeldBuffer(buf)), writer, rank, pid);
        }, py::arg("buf"), py::arg("writer"), py::arg("rank"), py::arg("pid"));
  m.def("ctl_acquire", [](const py::buffer& buf, int64_t version, double timeout_s) {
          HeldBuffer held(buf);  // pinned until the wait is over
          auto* c = ctl_from(held);
          py::gil_scoped_release nogil;
          return llamarl::ctl_acquire(c, version, timeout_s);
        }, py::arg("buf"), py::arg("version"), py::arg("timeout_s"), "-> (slot, version)");
  m.def("ctl_release", [](const py::buffer& buf, int slot) { llamarl::ctl_release(ctl_from(HeldBuffer(buf)), slot); },
        py::arg("buf"), py::arg("slot"));
  m.def("ctl_claim", [](const py::buffer& buf, int64_t version, double timeout_s) {
          HeldBuffer held(buf);
          auto* c = ctl_from(held);
          py::gil_scoped_release nogil;
          return llamarl::ctl_claim(c, version, timeout_s);
        }, py::arg("buf"), py::arg("version"), py::arg("timeout_s"), "-> slot");
  m.def("ctl_wait_claim", [](const py::buffer& buf, int writer, int64_t version, double timeout_s) {
          HeldBuffer held(buf);
          auto* c = ctl_from(held);
          py::gil_scoped_release nogil;
          return llamarl::ctl_wait_claim(c, writer, version, timeout_s);
        }, py::arg("buf"), py::arg("writer"), py::arg("version"), py::arg("timeout_s"), "-> slot");
  m.def("ctl_finish", [](const py::buffer& buf, int writer, int slot, int64_t version) {
          return llamarl::ctl_finish(ctl_from(HeldBuffer(buf)), writer, slot, version);
        }, py::arg("buf"), py::arg("writer"), py::arg("slot"), py::arg("version"), "-> True if it published");
  m.def("ctl_wait_version", [](const py::buffer& buf, int64_t version, double timeout_s) {
          HeldBuffer held(buf);
          auto* c = ctl_from(held);
          py::gil_scoped_release nogil;
          llamarl::ctl_wait_version(c, version, timeout_s);
        }, py::arg("buf"), py::arg("version"), py::arg("timeout_s"));
  m.def("ctl_abandon", [](const py::buffer& buf, int writer, int64_t version) {
          llamarl::ctl_abandon(ctl_from(HeldBuffer(buf)), writer, version);
        }, py::arg("buf"), py::arg("writer") = -1, py::arg("version") = -1);
  m.def("ctl_snapshot", [](const py::buffer& buf) {
          HeldBuffer held(buf);
          auto* c = ctl_from(held);
          py::dict d;
          d["nslots"] = c->nslots;
          d["n_writers"] = c->n_writers;
          d["n_readers"] = c->n_readers;
          d["latest_slot"] = c->latest_slot.load();
          d["latest_version"] = c->latest_version.load();
          d["claim_version"] = c->claim_version.load();
          d["claim_slot"] = c->claim_slot.load();
          d["last_claimed"] = c->last_claimed.load();
          d["done"] = c->done.load();
          py::list slots;
          for (int i = 0; i < c->nslots; ++i)
            slots.append(py::make_tuple(c->slots[i].state.load(), c->slots[i].version.load(), c->slots[i].readers.load()));
          d["slots"] = slots;
          py::list wp, rp;
          for (int k = 0; k < c->n_writers; ++k) wp.append(c->writer_pid[k].load());
          for (int k = 0; k < c->n_readers; ++k) rp.append(c->reader_pid[k].load());
          d["writer_pids"] = wp;
          d["reader_pids"] = rp;
          return d;
        }, py::arg("buf"), "The control block's fields as a dict (slots: (state, version, readers)).");
}
