"""Build brrr._C: csrc/*.c with the C compiler, cuda/*.cu with nvcc when it is found.

Environment:
  BRRR_CPU_ONLY=1          build without CUDA even if nvcc is present
  BRRR_CUDA_ARCHS="80;90"  SM architectures to compile machine code for (PTX of the last one is
                           embedded too, so newer GPUs JIT it)
  CUDA_HOME / CUDA_PATH    where to look for nvcc first (then /usr/local/cuda, then PATH)
  BRRR_SANITIZE=address,undefined   compile and link the C code with these sanitizers (tests only)
"""

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
C_FLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]


def find_cuda_home():
    if os.environ.get("BRRR_CPU_ONLY", "0") not in ("", "0"):
        return None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return home
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


def cuda_archs():
    archs = [a.strip() for a in os.environ.get("BRRR_CUDA_ARCHS", "80;90").replace(",", ";").split(";")]
    return [a for a in archs if a]


class BuildExt(build_ext):
    def build_extensions(self):
        cuda_home = find_cuda_home()
        os.makedirs(self.build_temp, exist_ok=True)
        archs = cuda_archs() if cuda_home else []
        with open(os.path.join(self.build_temp, "brrr_build_config.h"), "w") as f:
            f.write(f'#define BRRR_BUILD_CUDA_ARCHS "{";".join(archs)}"\n')
            f.write(f"#define BRRR_WITH_CUDA {1 if cuda_home else 0}\n")
        for ext in self.extensions:
            ext.include_dirs.append(self.build_temp)
            if cuda_home:
                ext.extra_objects += self.compile_cuda(cuda_home, archs)
                ext.library_dirs.append(os.path.join(cuda_home, "lib64"))
                # cudart is linked statically; its symbols stay private so that the CUDA runtime
                # of PyTorch or CuPy in the same process is never confused with ours.
                ext.libraries += ["cudart_static", "stdc++", "rt", "pthread", "dl"]
                ext.extra_link_args.append("-Wl,--exclude-libs,ALL")
        super().build_extensions()

    def compile_cuda(self, cuda_home, archs):
        nvcc = os.path.join(cuda_home, "bin", "nvcc")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        sources = sorted(f for f in os.listdir(os.path.join(ROOT, "cuda")) if f.endswith(".cu"))

        def compile_one(name):
            obj = os.path.join(self.build_temp, name + ".o")
            cmd = [nvcc, "-c", os.path.join(ROOT, "cuda", name), "-o", obj, "-O3", "-std=c++17",
                   "-Xcompiler", "-fPIC,-fvisibility=hidden,-Wall,-Wextra,-Werror",
                   "-Werror", "all-warnings", "--expt-relaxed-constexpr", *gencode]
            print(" ".join(cmd), flush=True)
            subprocess.check_call(cmd)
            return obj

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            return list(pool.map(compile_one, sources))


sanitize = os.environ.get("BRRR_SANITIZE", "")
san_flags = [f"-fsanitize={sanitize}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"] if sanitize else []

extension = Extension(
    "brrr._C",
    sources=sorted(os.path.join("csrc", f) for f in os.listdir(os.path.join(ROOT, "csrc")) if f.endswith(".c")),
    include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "cuda"), numpy.get_include()],
    # OpenMP: the CPU kernels' threads (libgomp; the same runtime PyTorch's CPU wheels load).
    extra_compile_args=C_FLAGS + ["-fopenmp"] + san_flags,
    extra_link_args=["-fopenmp"] + san_flags,
)

setup(ext_modules=[extension], cmdclass={"build_ext": BuildExt})
