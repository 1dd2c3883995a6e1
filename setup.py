"""Build of llamarl._C, the native copy engine (pybind11; never links libtorch).

The C++ part always builds with the host compiler. The CUDA part (csrc/*.cu) builds when nvcc is found
(``$CUDA_HOME/bin/nvcc`` or on PATH) unless ``LLAMARL_BUILD_CUDA=0``; ``LLAMARL_BUILD_CUDA=1`` makes a
missing nvcc an error instead of a CPU-only build. Targets: sm_80 and sm_90 SASS plus compute_90 PTX
(override with ``LLAMARL_CUDA_ARCHS="80;90"``). cudart is linked statically, so the module imports on
machines without a CUDA driver; CUDA calls then raise. ``llamarl._C.build_info()`` tells what was built.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"


def find_nvcc() -> str | None:
    flag = os.environ.get("LLAMARL_BUILD_CUDA", "auto").lower()
    if flag in ("0", "false", "no", "off"):
        return None
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [str(Path(cuda_home) / "bin" / "nvcc")] if cuda_home else []
    candidates += [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    if flag in ("1", "true", "yes", "on"):
        sys.exit("LLAMARL_BUILD_CUDA=1 but nvcc was not found: set CUDA_HOME or put nvcc on PATH")
    return None


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    for tok in out.replace(",", " ").split():
        if tok.startswith("V") and tok[1:2].isdigit():
            return tok[1:]
    return "unknown"


def find_cuda_root(nvcc: str) -> Path:
    """The toolkit directory holding include/cuda_runtime.h (nvcc may be a wrapper script elsewhere)."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for c in [cuda_home, str(Path(nvcc).resolve().parent.parent), "/usr/local/cuda"]:
        if c and (Path(c) / "include" / "cuda_runtime.h").is_file():
            return Path(c)
    sys.exit(f"found nvcc at {nvcc} but no CUDA toolkit with include/cuda_runtime.h: set CUDA_HOME "
             "or build without CUDA (LLAMARL_BUILD_CUDA=0)")


class BuildExt(build_ext):
    """Compiles .cu sources with nvcc into objects, then links them into the pybind11 module."""

    def build_extension(self, ext):
        nvcc = find_nvcc()
        if nvcc is None:
            ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
            print("llamarl: building llamarl._C without CUDA", flush=True)
            return super().build_extension(ext)

        ext.sources = [s for s in ext.sources if not s.endswith("cuda_stub.cpp")]
        cu = [s for s in ext.sources if s.endswith(".cu")]
        ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
        archs = os.environ.get("LLAMARL_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
        gencode = []
        for a in archs:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
        build_tmp = Path(self.build_temp)
        build_tmp.mkdir(parents=True, exist_ok=True)
        cuda_root = find_cuda_root(nvcc)
        jobs = []  # every .cu at once (each nvcc is one process): the build is on the GPU machine's clock
        for src in cu:
            obj = build_tmp / (Path(src).stem + ".cu.o")
            cmd = [nvcc, "-c", src, "-o", str(obj), "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                   f"-I{CSRC}", *gencode]
            print(" ".join(cmd), flush=True)
            jobs.append((src, subprocess.Popen(cmd)))
            ext.extra_objects.append(str(obj))
        failed = [src for src, job in jobs if job.wait() != 0]
        if failed:
            sys.exit(f"nvcc failed on {', '.join(failed)} (its errors are above)")
        lib_dirs = [d for d in (cuda_root / "lib64", cuda_root / "lib", cuda_root / "targets" /
                                "x86_64-linux" / "lib") if d.is_dir()]
        ext.library_dirs += [str(d) for d in lib_dirs]
        ext.libraries += ["cudart_static", "rt", "dl", "pthread"]
        ext.include_dirs.append(str(cuda_root / "include"))
        version = nvcc_version(nvcc)
        ext.define_macros += [("LLAMARL_CUDA_VERSION", f'"{version}"'),
                              ("LLAMARL_CUDA_ARCHS", f'"{";".join(archs)}"')]
        print(f"llamarl: building llamarl._C with CUDA {version} for sm_{', sm_'.join(archs)} + PTX",
              flush=True)
        super().build_extension(ext)


# the C++ sources compile in parallel too: LLAMARL_BUILD_JOBS processes (default: one per CPU)
ParallelCompile("LLAMARL_BUILD_JOBS", default=0).install()

ext = Pybind11Extension(
    "llamarl._C",
    sources=sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp")) +
            sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cu")),
    include_dirs=[str(CSRC)],
    cxx_std=17,
    extra_compile_args=["-O3"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
