"""Packaging and the build: the sdist carries what a build needs, a wheel built from it works and
says what it is, a change of build configuration rebuilds what it affects (CUDA or not, archs),
and the small things a user meets first (brrr --version, a source tree without a built extension).

The builds run in copies of the source tree. The configuration test uses a stand-in CUDA
toolchain (an `nvcc` script that compiles C stubs for the launchers and records its calls), so it
checks setup.py's decisions in seconds, with or without a real nvcc; CI compiles the real kernels.
"""

import email
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

import brrr

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the brrr under test is imported from, for subprocesses: the source tree or site-packages.
BRRR_PATH = os.path.dirname(os.path.dirname(os.path.abspath(brrr.__file__)))

needs_source_tree = pytest.mark.skipif(
    not (os.path.exists(os.path.join(REPO, "setup.py")) and os.path.isdir(os.path.join(REPO, "brrr"))),
    reason="builds from the source tree, which is not beside these tests (a run against an installed wheel)")


def run(args, cwd, env=None, check=True):
    result = subprocess.run(args, cwd=cwd, env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                            timeout=600, start_new_session=True)  # no terminal: the build's start line stays in stdout
    if check:
        assert result.returncode == 0, f"{args}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def copy_tree(destination):
    """The source tree as a fresh clone has it: no build outputs, no GPU results."""
    shutil.copytree(REPO, destination, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "*.so", "*.o", "__pycache__", ".pytest_cache", "results"))
    return destination


def info_of(folder):
    """build_info() of the brrr in folder (a source tree built in place, or an unpacked wheel)."""
    code = "import json, brrr; print(json.dumps(brrr.build_info()))"
    return json.loads(run([sys.executable, "-c", code], cwd=folder, env={"PYTHONPATH": str(folder)}).stdout)


def section_names(shared_object):
    out = subprocess.run(["readelf", "-S", "-W", shared_object], capture_output=True, text=True, check=True).stdout
    return {line.split("]", 1)[1].split()[0] for line in out.splitlines() if "]" in line and line.split("]", 1)[1].strip()}


# --- sdist and wheel -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    tree = copy_tree(tmp_path_factory.mktemp("sdist") / "brrr")
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(tree.parent / "dist"), "."], cwd=tree)
    (archive,) = (tree.parent / "dist").glob("brrr-*.tar.gz")
    return tree, archive


@needs_source_tree
def test_sdist_holds_every_source_a_build_needs(sdist):
    import tarfile

    tree, archive = sdist
    with tarfile.open(archive) as tar:
        members = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for folder in ("csrc", "cuda", "brrr", "tests"):
        for name in os.listdir(tree / folder):
            if not name.startswith("__pycache__"):
                assert f"{folder}/{name}" in members, f"{folder}/{name} is not in the sdist"
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "requirements-test.txt", "LICENSE"):
        assert name in members
    assert not [m for m in members if m.endswith((".so", ".o")) or m.startswith("benchmarks/results")]


@pytest.fixture(scope="module")
def wheel(sdist, tmp_path_factory):
    """A CPU-only wheel built from the sdist, unpacked."""
    import tarfile

    _, archive = sdist
    work = tmp_path_factory.mktemp("wheel")
    with tarfile.open(archive) as tar:
        tar.extractall(work, filter="data")
    (unpacked,) = work.glob("brrr-*")
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(work / "dist"), "."], cwd=unpacked,
        env={"BRRR_CPU_ONLY": "1"})
    (path,) = (work / "dist").glob("brrr-*.whl")
    site = work / "site"
    with zipfile.ZipFile(path) as archive:
        archive.extractall(site)
    return path, site


@needs_source_tree
def test_wheel_built_from_the_sdist_works(wheel, tmp_path):
    _, site = wheel
    code = textwrap.dedent("""
        import json, numpy as np, brrr
        x = np.linspace(-3, 3, 4097, dtype=np.float32)
        y = brrr.gelu(x)
        from math import erf, sqrt
        want = np.array([v * 0.5 * (1 + erf(v / sqrt(2))) for v in x.astype(np.float64)])
        assert np.allclose(y, want, rtol=2e-5, atol=2e-6), abs(y - want).max()
        print(json.dumps(dict(brrr.build_info(), file=brrr.__file__)))
    """)
    # Run from an empty folder: nothing but the unpacked wheel provides brrr.
    result = run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site)})
    info = json.loads(result.stdout)
    assert info["file"].startswith(str(site)) and info["cuda_compiled"] is False
    version = run([sys.executable, "-m", "brrr", "--version"], cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert version.stdout.strip() == f"brrr {brrr.__version__} (CPU only: built without CUDA)"


@needs_source_tree
def test_wheel_metadata_and_contents(wheel):
    path, site = wheel
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_string(archive.read(metadata_name).decode())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "brrr = brrr.__main__:main" in archive.read(entry_points).decode()
    assert metadata["Version"] == brrr.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]  # the licence's text travels with the wheel
    assert [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL"))
    assert {"Homepage", "Repository", "Issues"} <= set(urls)
    assert any(c.startswith("Programming Language :: Python :: 3") for c in metadata.get_all("Classifier"))
    requires = metadata.get_all("Requires-Dist")
    assert [r for r in requires if "extra ==" not in r] == ["numpy>=1.23"], "torch must stay optional"
    assert not [r for r in requires if r.startswith("torch") and "==" in r.split(";")[0]], "torch must not be pinned"
    assert not [n for n in names if n.startswith(("csrc/", "cuda/", "tests/"))]
    assert {"brrr/diagnose/__init__.py", "brrr/diagnose/common.py", "brrr/diagnose/step.py"} <= set(names)
    (shared,) = [n for n in names if n.startswith("brrr/_C.") and n.endswith(".so")]
    sections = section_names(str(site / shared))
    assert ".text" in sections and not [s for s in sections if s.startswith(".debug")], sections


# --- the build configuration ---------------------------------------------------------------------

FAKE_NVCC = '''\
#!{python}
"""Stands in for nvcc: C stubs for the extern "C" launchers a .cu file defines (they report no
CUDA device), make-style dependencies of its local includes, and one line per call in calls.log."""
import os, re, subprocess, sys

args = sys.argv[1:]
if args == ["--version"]:
    print("Cuda compilation tools, release 13.0, V13.0.0")
    sys.exit(0)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.log"), "a") as log:
    log.write(" ".join(args) + "\\n")
source, obj, deps = args[args.index("-c") + 1], args[args.index("-o") + 1], args[args.index("-MF") + 1]
folders = [os.path.dirname(source)] + [a[2:] for a in args if a.startswith("-I")]
seen, todo = [], [source]
while todo:
    path = todo.pop()
    if path in seen:
        continue
    seen.append(path)
    for name in re.findall(r'^#include "([^"]+)"', open(path).read(), re.M):
        todo += [os.path.join(f, name) for f in folders if os.path.exists(os.path.join(f, name))][:1]
stubs = []
for kind, name in re.findall(r'^extern "C" (int|const char \\*)\\s*(brrr_cuda_\\w+)\\(', open(source).read(), re.M):
    stubs.append(f"int {{name}}() {{{{ return 100; }}}}" if kind == "int" else f'const char *{{name}}() {{{{ return "no device"; }}}}')
stub = obj[:-2] + "_stub.c"
with open(stub, "w") as f:
    f.write("\\n".join(stubs) + "\\n")
subprocess.run(["cc", "-c", "-fPIC", stub, "-o", obj], check=True)
with open(deps, "w") as f:
    f.write(obj + ": " + " ".join(seen) + "\\n")
'''


@pytest.fixture
def fake_cuda(tmp_path):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "lib64").mkdir()
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(FAKE_NVCC.format(python=sys.executable))
    nvcc.chmod(0o755)
    subprocess.run(["ar", "rc", str(home / "lib64" / "libcudart_static.a")], check=True)
    # The C compiler without optimisation (the last -O wins): these tests check which files a build
    # compiles and what it links, which -O3 does not change, and they build the tree many times over.
    quick_cc = home / "bin" / "quick-cc"
    quick_cc.write_text('#!/bin/sh\nexec cc "$@" -O0\n')
    quick_cc.chmod(0o755)
    return home


def toolchain(home):
    """The stand-in CUDA toolchain and the quick C compiler, as a build's environment names them."""
    return {"CUDA_HOME": str(home), "CC": str(home / "bin" / "quick-cc")}


def nvcc_calls(home):
    log = home / "bin" / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


def compiled_sources(calls):
    return sorted(os.path.basename(args[args.index("-c") + 1]) for args in map(str.split, calls))


@needs_source_tree
def test_a_change_of_configuration_rebuilds_what_it_affects(tmp_path, fake_cuda):
    tree = copy_tree(tmp_path / "tree")
    env = dict(toolchain(fake_cuda), BRRR_CPU_ONLY="0", BRRR_CUDA_ARCHS="80")
    build = [sys.executable, "setup.py", "build_ext", "--inplace"]
    texts = [(tree / "cuda" / f).read_text() for f in os.listdir(tree / "cuda")]
    # 4 dtypes of each instantiated header, of both parts where it splits them
    parts = [2 if "\n#if BRRR_INSTANTIATE_PART == 0\n" in t else 1 for t in texts if "\n#ifdef BRRR_INSTANTIATE\n" in t]
    units = 4 * sum(parts) + len([f for f in os.listdir(tree / "cuda") if f.endswith(".cu")])
    assert 2 in parts  # the split is exercised

    result = run(build, tree, env)
    assert f"brrr: compiling {units} CUDA files for sm_80 with nvcc 13.0.0" in result.stdout
    assert f"[{units}/{units}]" in result.stdout
    calls = nvcc_calls(fake_cuda)
    assert len(calls) == units and all("-gencode=arch=compute_80,code=sm_80" in c for c in calls)
    info = info_of(tree)
    assert (info["cuda_compiled"], info["cuda_archs"]) == (True, "80")
    (shared,) = (tree / "brrr").glob("_C.*.so")
    built = shared.stat().st_mtime_ns

    run(build, tree, env)  # nothing changed: nothing is compiled or linked
    assert nvcc_calls(fake_cuda) == [] and shared.stat().st_mtime_ns == built

    # CPU-only in a build folder of its own, as `--build-temp` gives: the same extension file.
    cpu_only = build + ["--build-temp", str(tmp_path / "cpu-only")]
    run(cpu_only, tree, dict(env, BRRR_CPU_ONLY="1"))
    assert nvcc_calls(fake_cuda) == []
    assert info_of(tree)["cuda_compiled"] is False

    run(build, tree, dict(env, BRRR_CUDA_ARCHS="80;90"))
    calls = nvcc_calls(fake_cuda)
    assert len(calls) == units and all("code=sm_90" in c and "code=compute_90" in c for c in calls)
    info = info_of(tree)
    assert (info["cuda_compiled"], info["cuda_archs"]) == (True, "80;90")

    result = run(build, tree, env)  # back to sm_80: its objects are reused, the extension relinked
    assert nvcc_calls(fake_cuda) == [] and "rebuilding" in result.stdout
    assert info_of(tree)["cuda_archs"] == "80"

    # A fresh build folder, as pip gives an editable install: the kernels are not compiled again.
    run(build + ["--build-temp", str(tmp_path / "fresh")], tree, dict(env, BRRR_CUDA_ARCHS="80;90"))
    assert nvcc_calls(fake_cuda) == [] and info_of(tree)["cuda_archs"] == "80;90"
    run(build, tree, env)

    # The CPU-only build folder is as its last build left it, older than the extension file:
    # only the configuration compiled into that file tells that it is not CPU-only.
    result = run(cpu_only, tree, dict(env, BRRR_CPU_ONLY="1"))
    assert "rebuilding" in result.stdout and info_of(tree)["cuda_compiled"] is False

    os.utime(tree / "cuda" / "norm_kernels.cuh")  # an edited header: the units that include it
    run(build, tree, env)
    assert compiled_sources(nvcc_calls(fake_cuda)) == [f"norm_{d}_{part}.cu" for d in ("bf16", "f16", "f32", "f64")
                                                       for part in (0, 1)]


@needs_source_tree
def test_a_cpu_only_wheel_from_a_tree_built_with_cuda_is_cpu_only(tmp_path, fake_cuda):
    """The stale build of the report: `BRRR_CPU_ONLY=1 pip wheel` over a tree whose build/ holds a
    CUDA build gave that CUDA build."""
    tree = copy_tree(tmp_path / "tree")
    run([sys.executable, "setup.py", "build"], tree, dict(toolchain(fake_cuda), BRRR_CPU_ONLY="0", BRRR_CUDA_ARCHS="90"))
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", "dist", "."], tree,
        dict(toolchain(fake_cuda), BRRR_CPU_ONLY="1"))
    (path,) = (tree / "dist").glob("brrr-*.whl")
    with zipfile.ZipFile(path) as archive:
        archive.extractall(tmp_path / "site")
    assert info_of(tmp_path / "site")["cuda_compiled"] is False


@needs_source_tree
@pytest.mark.parametrize("value", ["sm_90", "80;x", ";"])
def test_bad_cuda_archs_are_refused_by_name(tmp_path, fake_cuda, value):
    tree = copy_tree(tmp_path / "tree")
    result = run([sys.executable, "setup.py", "build_ext", "--inplace"], tree,
                 dict(toolchain(fake_cuda), BRRR_CPU_ONLY="0", BRRR_CUDA_ARCHS=value), check=False)
    assert result.returncode != 0 and "BRRR_CUDA_ARCHS: expected SM versions" in result.stderr
    assert "Traceback" not in result.stderr


@needs_source_tree
@pytest.mark.parametrize("name, value, message", [
    ("BRRR_NVCC_FLAGS", '-Xcompiler "-O2', "BRRR_NVCC_FLAGS: expected nvcc flags as a shell would split them"),
    ("BRRR_CPU_ONLY", "maybe", "BRRR_CPU_ONLY: expected 1 or 0, got 'maybe'"),
    # "false" is not CPU-only: the build goes on to CUDA, and there to the bad archs
    ("BRRR_CPU_ONLY", "false", "BRRR_CUDA_ARCHS: expected SM versions"),
])
def test_bad_build_settings_are_refused_by_name(tmp_path, fake_cuda, name, value, message):
    tree = copy_tree(tmp_path / "tree")
    env = dict(toolchain(fake_cuda), BRRR_CPU_ONLY="0", BRRR_CUDA_ARCHS="x" if value == "false" else "80")
    result = run([sys.executable, "setup.py", "build_ext", "--inplace"], tree, dict(env, **{name: value}), check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# --- first contact -------------------------------------------------------------------------------


def test_version():
    result = run([sys.executable, "-m", "brrr", "--version"], cwd=REPO, env={"PYTHONPATH": BRRR_PATH})
    info = brrr.build_info()
    archs = ", ".join(f"sm_{a}" for a in info["cuda_archs"].split(";"))
    kernels = f"CUDA kernels for {archs}" if info["cuda_compiled"] else "CPU only: built without CUDA"
    assert result.stdout.strip() == f"brrr {brrr.__version__} ({kernels})"


@pytest.mark.parametrize("args", [["--version"], ["diagnose", "overhead"], ["diagnose", "memory", "--device", "cpu"],
                                  ["diagnose", "compute", "--dtype", "float32"], ["ceilings"],
                                  ["ceilings", "--device", "cpu"]])
def test_the_command_line_without_torch_says_so_in_one_line(tmp_path, args):
    (tmp_path / "torch.py").write_text("raise ImportError(\"No module named 'torch'\")\n")  # a Python without torch
    result = run([sys.executable, "-m", "brrr", *args], cwd=tmp_path,
                 env={"PYTHONPATH": os.pathsep.join([str(tmp_path), BRRR_PATH])}, check=False)
    assert "Traceback" not in result.stderr, result.stderr
    if args == ["--version"]:
        assert result.returncode == 0 and result.stdout.startswith(f"brrr {brrr.__version__} (")
    else:
        assert result.returncode == 1
        assert result.stderr.startswith("brrr: diagnose and ceilings need PyTorch (pip install torch)"), result.stderr


def test_import_brrr_with_torch_blocked_works_on_numpy(tmp_path):
    """sys.modules["torch"] = None, the usual way of blocking an installed torch: brrr takes it as
    absent (it tried to load its torch layer and failed)."""
    code = ("import sys; sys.modules['torch'] = None\nimport numpy, brrr\n"
            "print(brrr.gelu(numpy.zeros(2, numpy.float32)).tolist())")
    result = run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": BRRR_PATH}, check=False)
    assert result.returncode == 0 and result.stdout.strip() == "[0.0, 0.0]", result.stderr


# -S: no site-packages, so that an editable install of brrr (whose import hook would supply the
# missing brrr._C from its own tree) stays out; the import fails at _C, before anything else.
IMPORT_WITHOUT_SITE = [sys.executable, "-S", "-c", "import brrr"]


def test_a_source_tree_without_the_extension_says_what_to_do(tmp_path):
    package = tmp_path / "brrr"
    shutil.copytree(os.path.dirname(brrr.__file__), package, ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
    (tmp_path / "setup.py").write_text("")
    result = run(IMPORT_WITHOUT_SITE, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == ("ImportError: brrr's C extension is not built in this source "
                                                      "tree: pip install -e . or run from elsewhere")
    assert "circular import" not in result.stderr


def test_an_installed_package_without_the_extension_keeps_pythons_error(tmp_path):
    """Outside a source tree the missing extension is a broken install, and Python's own error says so."""
    shutil.copytree(os.path.dirname(brrr.__file__), tmp_path / "brrr", ignore=shutil.ignore_patterns("_C.*", "__pycache__"))
    result = run(IMPORT_WITHOUT_SITE, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, check=False)
    assert result.returncode == 1 and "cannot import name '_C'" in result.stderr
