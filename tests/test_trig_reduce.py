"""The large-argument range reduction of the CUDA trig functions, compiled for the host and
checked against exact values (mpmath), including arguments near multiples of pi/2."""

import os
import random
import shutil
import struct
import subprocess

import pytest

mpmath = pytest.importorskip("mpmath")
HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def checker(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    exe = str(tmp_path_factory.mktemp("trig") / "check")
    subprocess.check_call([cxx, "-O2", "-I", os.path.join(HERE, "..", "cuda"), os.path.join(HERE, "trig_reduce_check.cc"),
                           "-o", exe])
    return exe


def test_reduction_is_exact(checker):
    mpmath.mp.prec = 300
    rng = random.Random(1)
    xs = []
    for _ in range(5000):
        bits = (rng.getrandbits(1) << 31) | ((rng.randint(16, 127) + 127) << 23) | rng.getrandbits(23)
        xs.append(struct.unpack("<f", struct.pack("<I", bits))[0])
    for k in range(1, 600):  # the floats closest to multiples of pi/2 stress the cancellation
        f = struct.unpack("<f", struct.pack("<f", float(mpmath.mpf(k * 104729) * mpmath.pi / 2)))[0]
        if abs(f) > 2 ** 16:
            xs.append(f)
    out = subprocess.run([checker], input="\n".join(x.hex() for x in xs), capture_output=True, text=True,
                         check=True).stdout.split("\n")
    for x, line in zip(xs, out):
        q, r = line.split()
        y = mpmath.mpf(x) * 2 / mpmath.pi
        k = int(mpmath.nint(y))
        exact = (y - k) * mpmath.pi / 2
        assert int(q) == k % 4, x
        assert abs(mpmath.mpf(float(r)) - exact) <= 1e-13 * abs(exact) + mpmath.mpf(1e-300), x
