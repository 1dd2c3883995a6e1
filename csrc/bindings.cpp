// The one binding file of llamarl._C: argument checks at the boundary, then the engine.
// Buffers cross as (address, nbytes) pairs so the extension never links libtorch; Python passes
// tensor.data_ptr() / tensor.nbytes (see llamarl/_native.py).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "copy_engine.h"

namespace py = pybind11;
using llamarl::CopyOp;

namespace {

using OpsArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

const CopyOp* ops_view(const OpsArray& ops, size_t* n) {
  if (ops.ndim() != 2 || ops.shape(1) != 6)
    throw std::invalid_argument(
        "ops must be an int64 array of shape [n, 6] with columns (src_offset, dst_offset, rows, "
        "row_bytes, src_stride, dst_stride); got ndim=" + std::to_string(ops.ndim()) +
        (ops.ndim() == 2 ? ", shape[1]=" + std::to_string(ops.shape(1)) : std::string()));
  *n = static_cast<size_t>(ops.shape(0));
  return reinterpret_cast<const CopyOp*>(ops.data());
}

void check_ptr(uint64_t ptr, int64_t nbytes, const char* name) {
  if (nbytes < 0) throw std::invalid_argument(std::string(name) + "_nbytes must be >= 0");
  if (ptr == 0 && nbytes > 0) throw std::invalid_argument(std::string(name) + " is a null pointer");
}

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
          size_t n;
          const CopyOp* p = ops_view(ops, &n);
          llamarl::validate_ops(p, n, src_nbytes, dst_nbytes);
          py::gil_scoped_release nogil;
          llamarl::copy_ops_cpu(reinterpret_cast<const uint8_t*>(src), reinterpret_cast<uint8_t*>(dst),
                                p, n, num_threads);
        },
        py::arg("src"), py::arg("src_nbytes"), py::arg("dst"), py::arg("dst_nbytes"), py::arg("ops"),
        py::arg("num_threads") = 1,
        "Execute a copy schedule between two host buffers on num_threads threads (GIL released).");

  m.def("cuda_device_count", &llamarl::cuda_device_count);
  m.def("cuda_runtime_version", &llamarl::cuda_runtime_version);
  m.def("copy_ops_cuda",
        [](uint64_t src, int64_t src_nbytes, uint64_t dst, int64_t dst_nbytes, const OpsArray& ops,
           int num_streams, uint64_t stream, int device) {
          check_ptr(src, src_nbytes, "src");
          check_ptr(dst, dst_nbytes, "dst");
          size_t n;
          const CopyOp* p = ops_view(ops, &n);
          llamarl::validate_ops(p, n, src_nbytes, dst_nbytes);
          py::gil_scoped_release nogil;
          llamarl::copy_ops_cuda(src, dst, p, n, num_streams, stream, device);
        },
        py::arg("src"), py::arg("src_nbytes"), py::arg("dst"), py::arg("dst_nbytes"), py::arg("ops"),
        py::arg("num_streams") = 4, py::arg("stream") = 0, py::arg("device") = 0,
        "Enqueue a copy schedule between device (or peer/IPC-mapped) buffers as cudaMemcpy2DAsync on "
        "num_streams streams; `stream` waits for all of them. No host synchronisation.");
  m.def("cuda_synchronize", &llamarl::cuda_synchronize, py::arg("device") = 0);

}
