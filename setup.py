"""Build brrr._C: csrc/*.c with the C compiler, cuda/*.cu with nvcc when it is found.

Environment:
  BRRR_CPU_ONLY=1          build without CUDA even if nvcc is present (seconds instead of minutes)
  BRRR_CUDA_ARCHS="80;90"  SM architectures to compile machine code for (PTX of the last one is
                           embedded too, so newer GPUs JIT it)
  CUDA_HOME / CUDA_PATH    where to look for nvcc first (then /usr/local/cuda, then PATH)
  BRRR_BUILD_JOBS=N        compiler processes at a time, C and nvcc (default: the CPUs this
                           process may use)
  BRRR_NVCC_FLAGS="..."    more nvcc flags, after brrr's own (release wheels add
                           --compress-mode=size: a 5x smaller fatbin for about 10% more build time)
  BRRR_SANITIZE=address,undefined   compile and link the C code with these sanitizers, keeping
                           debug info (tests only; other builds are stripped of it)

The configuration a build compiles in (CUDA or not, nvcc and its version, archs, compilers and
flags) is written into brrr._C as a marker; a build whose configuration differs from the marker in
the existing brrr._C rebuilds it, so a change of configuration never leaves a stale one behind.
CUDA objects are kept per configuration in the tree's build/ folder (an editable install's
temporary build folder included) and reused while they are newer than every file nvcc read for
them (its dependency list); ccache or sccache, when on PATH, also caches them across trees.

The kernel templates of cuda/<family>_kernels.cuh are instantiated once per dtype (DTYPES) by the
header's own `#ifdef BRRR_INSTANTIATE` block: the build compiles each such header once per dtype,
each in a translation unit of its own, so that the dtypes compile in parallel; a block that splits
its instantiations by `#if BRRR_INSTANTIATE_PART == 0` (the forward; else the backward) is
compiled twice per dtype, once per part.
"""

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.modified import newer_group

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC, CUDA = os.path.join(ROOT, "csrc"), os.path.join(ROOT, "cuda")

# Flag lists: extend these (or the sanitizer's below) rather than the commands that use them.
# -fno-trapping-math: no code here reads the floating-point exception flags, and without it GCC
# will not compute both sides of a float select unmasked, so AVX2 left the transcendental loops
# of the CPU kernels (csrc/cpu_math.h) scalar.
C_FLAGS = ["-std=c11", "-O3", "-fno-trapping-math", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"]
LINK_FLAGS = []
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Werror", "all-warnings",
              "-Xcompiler", "-fPIC,-fvisibility=hidden,-Wall,-Wextra,-Werror"]
# cudart is linked statically; its symbols stay private so that the CUDA runtime of PyTorch or
# CuPy in the same process is never confused with ours.
CUDA_LIBRARIES = ["cudart_static", "stdc++", "rt", "pthread", "dl"]
CUDA_LINK_FLAGS = ["-Wl,--exclude-libs,ALL"]
STRIP_FLAGS = ["-Wl,--strip-debug"]

DEFAULT_CUDA_ARCHS = "80;90"
DTYPES = {"f32": "float", "f16": "__half", "bf16": "__nv_bfloat16", "f64": "double"}
# CPU time of one architecture's share of a whole CUDA build, measured on a 2-core AMD EPYC
# (Zen 5) VM with nvcc 13.0 (docs/install.md); for the estimate printed when the build starts.
CUDA_CPU_SECONDS_PER_ARCH = 90


def env_flag(name):
    text = os.environ.get(name, "0")
    if text.strip().lower() not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
        raise SystemExit(f"{name}: expected 1 or 0, got {text!r}")
    return text.strip().lower() in ("1", "true", "yes", "on")


def find_cuda_home():
    if env_flag("BRRR_CPU_ONLY"):
        return None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return home
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


# C files that are not an op family (a family's csrc/<family>.c defines brrr_<family>_ops).
CORE_SOURCES = ("chain_jit.c", "cpu.c", "module.c", "op.c", "tensor.c")
# What the chains compiled at run time include (csrc/chain_jit.c), embedded in brrr._C as text for
# NVRTC, with stand-ins for the two system headers they name (NVRTC has no system headers).
JIT_HEADERS = ("brrr_cuda.h", "trig_reduce.h", "elementary.cuh", "chain_math.cuh", "chain_math.inc", "chain_apply.inc",
               "chain_math_end.inc")
JIT_SYSTEM_HEADERS = {
    "stdint.h": "typedef signed char int8_t;\ntypedef short int16_t;\ntypedef int int32_t;\ntypedef long long int64_t;\n"
                "typedef unsigned char uint8_t;\ntypedef unsigned short uint16_t;\ntypedef unsigned int uint32_t;\n"
                "typedef unsigned long long uint64_t;\ntypedef unsigned long long uintptr_t;\n"
                "#define INT64_C(c) c##LL\n#define UINT64_C(c) c##ULL\n#define INT32_MAX 2147483647\n",
    "string.h": "",  # memcpy is a builtin of NVRTC
}


def c_string(text):
    """text as a C string literal, one source line per line of text."""
    lines = text.splitlines(keepends=True) or [""]
    return "\n".join(json.dumps(line) for line in lines)


def jit_headers_source():
    """brrr_jit_headers.h: the names and texts of JIT_HEADERS and JIT_SYSTEM_HEADERS."""
    headers = dict(JIT_SYSTEM_HEADERS)
    for name in JIT_HEADERS:
        with open(os.path.join(CUDA, name)) as f:
            headers[name] = f.read()
    names = ", ".join(json.dumps(name) for name in headers)
    texts = ",\n".join(c_string(text) for text in headers.values())
    return ("/* Generated by setup.py: the headers of the chains compiled at run time (csrc/chain_jit.c). */\n"
            f"#define BRRR_JIT_HEADER_COUNT {len(headers)}\n"
            f"static const char *const BRRR_JIT_HEADER_NAMES[] = {{{names}}};\n"
            f"static const char *const BRRR_JIT_HEADER_TEXTS[] = {{\n{texts}}};\n")


def brrr_version():
    with open(os.path.join(ROOT, "brrr", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def op_families():
    """The op families: csrc/<family>.c, every C file but the core's."""
    return [os.path.basename(path)[:-2] for path in files_in(CSRC, (".c",)) if os.path.basename(path) not in CORE_SOURCES]


def cuda_archs():
    text = os.environ.get("BRRR_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)
    archs = [a.strip() for a in text.replace(",", ";").split(";") if a.strip()]
    if not archs or not all(re.fullmatch(r"\d{2,3}a?", a) for a in archs):
        raise SystemExit(f"BRRR_CUDA_ARCHS: expected SM versions separated by ';', such as \"80;90\", got {text!r}")
    return archs


def extra_nvcc_flags():
    text = os.environ.get("BRRR_NVCC_FLAGS", "")
    try:
        return shlex.split(text)
    except ValueError as e:  # an unclosed quote or a trailing backslash
        raise SystemExit(f"BRRR_NVCC_FLAGS: expected nvcc flags as a shell would split them, got {text!r} ({e})") from None


def build_jobs():
    text = os.environ.get("BRRR_BUILD_JOBS")
    if text is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not text.isdigit() or int(text) < 1:
        raise SystemExit(f"BRRR_BUILD_JOBS: expected a positive number of processes, got {text!r}")
    return int(text)


def nvcc_version(nvcc):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release [\d.]+, V([\d.]+)", out)
    return found.group(1) if found else out.strip().splitlines()[-1]


def compiler_cache():
    """ccache or sccache in front of nvcc, when one is on PATH."""
    for name in ("sccache", "ccache"):
        path = shutil.which(name)
        if path:
            return [path]
    return []


def write_if_changed(path, text):
    """Write text to path unless it holds it already (an unchanged file keeps its time stamp)."""
    try:
        with open(path) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(path, "w") as f:
        f.write(text)


def short_hash(value):
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def files_in(folder, suffixes):
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(suffixes))


def instantiated_headers():
    """cuda/*.cuh files with a BRRR_INSTANTIATE block, compiled once per dtype: (path, parts), parts
    2 where the block splits its instantiations by BRRR_INSTANTIATE_PART (0 and 1), each part a
    translation unit of its own, else 1."""
    headers = []
    for path in files_in(CUDA, (".cuh",)):
        with open(path) as f:
            text = f.read()
        if re.search(r"^#ifdef BRRR_INSTANTIATE$", text, re.M):
            headers.append((path, 2 if re.search(r"^#if BRRR_INSTANTIATE_PART == 0$", text, re.M) else 1))
    return headers


def read_dependencies(path):
    """The files a make-style dependency file lists (nvcc -MD -MF), or None if it is unreadable."""
    try:
        with open(path) as f:
            text = f.read().replace("\\\n", " ")
    except OSError:
        return None
    _, _, files = text.partition(": ")
    return files.split()


def is_up_to_date(obj, deps_file):
    deps = read_dependencies(deps_file)
    if not deps or not os.path.exists(obj):
        return False
    built = os.path.getmtime(obj)
    return all(os.path.exists(d) and os.path.getmtime(d) <= built for d in deps)


def announce(line):
    """Print line, and show it on the terminal too when pip hides the build's output (pip shows
    it only with -v)."""
    print(line, flush=True)
    if sys.stdout.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line + "\n")
    except OSError:
        pass  # no terminal (CI, a pipe): the printed line is all there is


def about(seconds):
    if seconds < 90:
        return "about a minute" if seconds > 40 else "under a minute"
    return f"about {round(seconds / 60)} minutes"


def compile_each_source_in_parallel(compile_sources):
    """The C compiler's compile(), one source per call, build_jobs() at a time: setuptools compiles
    an extension's sources one after another (its -j runs extensions, and brrr has one)."""
    def compile(sources, **options):
        with ThreadPoolExecutor(max_workers=build_jobs()) as pool:
            return [obj for objects in pool.map(lambda source: compile_sources([source], **options), sources)
                    for obj in objects]
    return compile


class BuildExt(build_ext):
    def build_extensions(self):
        (ext,) = self.extensions
        os.makedirs(self.build_temp, exist_ok=True)
        cuda_home = find_cuda_home()
        archs = cuda_archs() if cuda_home else []
        nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
        nvcc_flags = NVCC_FLAGS + extra_nvcc_flags()
        cuda_config = {"nvcc": nvcc, "version": nvcc_version(nvcc), "flags": nvcc_flags, "archs": archs} if nvcc else None

        ext.include_dirs.append(self.build_temp)
        ext.depends += files_in(CSRC, (".h", ".inc")) + (files_in(CUDA, (".cu", ".cuh", ".h", ".inc")) if nvcc else
                                                  [os.path.join(CUDA, name) for name in JIT_HEADERS])
        write_if_changed(os.path.join(self.build_temp, "brrr_jit_headers.h"), jit_headers_source())
        if nvcc:
            ext.library_dirs.append(os.path.join(cuda_home, "lib64"))
            ext.libraries += CUDA_LIBRARIES
            ext.extra_link_args += CUDA_LINK_FLAGS
        config = {"cuda": cuda_config, "python": sys.version, "numpy": numpy.__version__,
                  "compiler": self.compiler.compiler_so, "c_flags": ext.extra_compile_args,
                  "link": self.compiler.linker_so + ext.extra_link_args + ext.libraries}
        marker = f"brrr-build-config {short_hash(config)}"
        write_if_changed(os.path.join(self.build_temp, "brrr_build_config.h"),
                         f'#define BRRR_BUILD_CUDA_ARCHS "{";".join(archs)}"\n'
                         f"#define BRRR_WITH_CUDA {1 if nvcc else 0}\n"
                         f'#define BRRR_VERSION "{brrr_version()}"\n'
                         # Every csrc/<family>.c but the core defines brrr_<family>_ops: module.c adds them all.
                         "#define BRRR_FAMILIES(X)" + "".join(f" X({name})" for name in op_families()) + "\n")
        marker_source = os.path.join(self.build_temp, "brrr_build_config.c")
        write_if_changed(marker_source,
                         "/* Generated by setup.py: the build configuration, which setup.py looks for in an\n"
                         " * existing brrr._C to tell whether it was built the same way. */\n"
                         f'__attribute__((used)) const char brrr_build_config[] = "{marker}";\n')
        ext.sources.append(os.path.relpath(marker_source, ROOT) if marker_source.startswith(ROOT) else marker_source)

        ext_path = self.get_ext_fullpath(ext.name)
        recompile = self.force  # --force: every object; a changed configuration relinks, reusing what is current
        if os.path.exists(ext_path) and not self.force and not self.contains(ext_path, marker):
            print(f"brrr: rebuilding {os.path.basename(ext_path)}: it was built with another configuration")
            self.force = True
        if nvcc and (self.force or newer_group(ext.sources + ext.depends, ext_path)):
            ext.extra_objects += self.compile_cuda(nvcc, cuda_config, recompile)
        self.compiler.compile = compile_each_source_in_parallel(self.compiler.compile)
        super().build_extensions()

    def cuda_objects_folder(self, name):
        """build/<name> in the source tree, shared by every build of it: pip gives an editable
        install a fresh temporary build folder, which would compile every kernel again after a
        `pip install .`; build_temp where the tree is read-only."""
        folder = os.path.join(ROOT, "build", name)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            folder = os.path.join(self.build_temp, name)
            os.makedirs(folder, exist_ok=True)
        return folder

    @staticmethod
    def contains(path, marker):
        with open(path, "rb") as f:
            return marker.encode() in f.read()

    def compile_cuda(self, nvcc, cuda_config, recompile):
        """Objects of every CUDA translation unit, compiled in parallel where they are out of date
        (all of them with recompile)."""
        archs = cuda_config["archs"]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
        gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
        folder = self.cuda_objects_folder(f"cuda-{short_hash(cuda_config)}")
        units = []  # (label, source, object); the costly instantiations first, for the parallel schedule
        for header, parts in instantiated_headers():
            family = os.path.basename(header).removesuffix("_kernels.cuh").removesuffix(".cuh")
            for suffix, c_type in DTYPES.items():
                for part in range(parts):
                    name = f"{family}_{suffix}" + (f"_{part}" if parts > 1 else "")
                    source = os.path.join(folder, name + ".cu")
                    write_if_changed(source, f"// Generated by setup.py: {os.path.basename(header)} instantiated for one "
                                             "dtype.\n"
                                             f"#define BRRR_INSTANTIATE {c_type}\n"
                                             f"#define BRRR_INSTANTIATE_PART {part}\n"
                                             f'#include "{os.path.basename(header)}"\n')
                    units.append((name.replace("_", " "), source, source[:-3] + ".o"))
        for source in files_in(CUDA, (".cu",)):
            name = os.path.basename(source)[:-3]
            units.append((name, source, os.path.join(folder, name + ".o")))
        stale = [u for u in units if recompile or not is_up_to_date(u[2], u[2][:-2] + ".d")]
        if not stale:
            return [obj for _, _, obj in units]

        jobs = min(build_jobs(), len(stale))
        sm = ", ".join(f"sm_{a}" for a in archs)
        announce(f"brrr: compiling {len(stale)} CUDA files for {sm} with nvcc {cuda_config['version']}, {jobs} at a "
                 f"time: {about(CUDA_CPU_SECONDS_PER_ARCH * len(archs) * len(stale) / len(units) / jobs)} "
                 "(BRRR_CPU_ONLY=1 builds without CUDA in seconds; pip install -v shows each file)")
        launcher = compiler_cache()
        include = [f"-I{CUDA}"]
        print(f"brrr: {' '.join(launcher + [nvcc] + cuda_config['flags'] + gencode)}", flush=True)

        def compile_one(unit):
            label, source, obj = unit
            started = time.perf_counter()
            subprocess.run(launcher + [nvcc, "-c", source, "-o", obj, "-MD", "-MF", obj[:-2] + ".d", *include,
                                       *cuda_config["flags"], *gencode], check=True)
            return label, time.perf_counter() - started

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(compile_one, unit) for unit in stale]
            for done, future in enumerate(as_completed(futures), 1):
                label, seconds = future.result()
                print(f"brrr: [{done:2d}/{len(stale)}] {label:<14} {seconds:5.1f} s", flush=True)
        print(f"brrr: CUDA files compiled in {time.perf_counter() - started:.0f} s", flush=True)
        return [obj for _, _, obj in units]


sanitize = os.environ.get("BRRR_SANITIZE", "")
san_flags = [f"-fsanitize={sanitize}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"] if sanitize else []

extension = Extension(
    "brrr._C",
    sources=[os.path.relpath(path, ROOT) for path in files_in(CSRC, (".c",))],
    include_dirs=[CSRC, CUDA, numpy.get_include()],
    # OpenMP: the CPU kernels' threads (libgomp; the same runtime PyTorch's CPU wheels load).
    extra_compile_args=C_FLAGS + ["-fopenmp"] + san_flags,
    extra_link_args=LINK_FLAGS + ["-fopenmp"] + (san_flags if sanitize else STRIP_FLAGS),
)

setup(ext_modules=[extension], cmdclass={"build_ext": BuildExt})
