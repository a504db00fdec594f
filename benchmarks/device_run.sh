#!/usr/bin/env bash
# One call on the lent H200: build brrr for sm_90 (+PTX), run the CUDA tests, run benchmarks,
# print the tables, and leave everything in $OUT: env.txt, tests.log, bench.log and one .json and
# .md per benchmark module, written as they are measured (a run cut short keeps what it had).
#
#   bash benchmarks/device_run.sh "<pytest targets for the CUDA tests>" "<benchmark files>"
#
# Both arguments are optional (defaults: all tests, all benchmarks); "none" skips a stage.
# BRRR_TEST_TIMEOUT and BRRR_BENCH_TIMEOUT (seconds) bound the test and benchmark stages.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/brrr-device-out}
mkdir -p "$OUT"
RESULTS="$OUT"
TESTS=${1:-tests}
BENCH=${2:-benchmarks}
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$RESULTS/env.txt"

# Peers that the H200 image lacks travel as wheels in .whl/ (named in the call's carry list):
# Liger-Kernel, pure Python on the image's triton.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

start=$(date +%s)
# BRRR_SKIP_BUILD=1: a later call on the same machine reuses the extension the first one built.
if [ "${BRRR_SKIP_BUILD:-0}" = 1 ]; then
  echo "build: reused"
elif ! BRRR_CUDA_ARCHS=90 python3 setup.py build_ext --inplace --force > /tmp/brrr-build.log 2>&1; then
  grep -E "error|Error" /tmp/brrr-build.log | head -40
  tail -20 /tmp/brrr-build.log
  exit 1
fi
echo "build: $(( $(date +%s) - start )) s"
python3 -c "import brrr; print(brrr.build_info())"
python3 -c "import liger_kernel; print('liger-kernel', getattr(liger_kernel, '__version__', 'present'))" 2>/dev/null | tee -a "$RESULTS/env.txt"

status=0
if [ "$TESTS" != "none" ]; then
  start=$(date +%s)
  # With pytest-xdist, BRRR_TEST_WORKERS processes (default 12) of 2 CPU threads each: on a
  # 16-core H200 host the whole CUDA suite takes about 6 minutes that way, where workers with
  # torch's default thread count crowd the cores and run ten times slower. Tests that time the
  # GPU against itself (test_floor_probe.py) need it to themselves: they run alone afterwards.
  parallel=()
  alone=()
  targets=($TESTS)  # words, globs expanded
  if python3 -c "import xdist" 2> /dev/null && [ "${BRRR_TEST_WORKERS:-12}" -gt 1 ]; then
    parallel=(-n "${BRRR_TEST_WORKERS:-12}" --ignore=tests/test_floor_probe.py)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
    # test_floor_probe.py named outright would still be collected beside the others: it runs alone.
    kept=()
    for t in "${targets[@]}"; do
      case $t in
        *test_floor_probe.py*) alone+=("$t") ;;
        tests | tests/) kept+=("$t"); alone+=(tests/test_floor_probe.py) ;;
        *) kept+=("$t") ;;
      esac
    done
    targets=("${kept[@]}")
  fi
  status=0
  if [ ${#targets[@]} -gt 0 ]; then
    timeout "${BRRR_TEST_TIMEOUT:-3000}" python3 -m pytest "${targets[@]}" -q -m cuda -p no:cacheprovider --maxfail=20 \
      "${parallel[@]}" 2>&1 | tee "$RESULTS/tests.log" | tail -25
    status=${PIPESTATUS[0]}
  fi
  if [ ${#parallel[@]} -gt 0 ] && [ ${#alone[@]} -gt 0 ] && [ "$status" = 0 ]; then
    timeout 600 python3 -m pytest "${alone[@]}" -q -m cuda -p no:cacheprovider 2>&1 | tee -a "$RESULTS/tests.log" | tail -3
    status=${PIPESTATUS[0]}
  fi
  echo "tests: $(( $(date +%s) - start )) s, exit $status"
fi
if [ "$BENCH" != "none" ]; then
  start=$(date +%s)
  BRRR_BENCH_OUT="$RESULTS" timeout "${BRRR_BENCH_TIMEOUT:-3000}" python3 -m pytest $BENCH -q -p no:cacheprovider 2>&1 |
    tee "$RESULTS/bench.log" | tail -8
  echo "benchmarks: $(( $(date +%s) - start )) s"
  for md in "$RESULTS"/*.md; do echo "== $md"; cat "$md"; done
fi
# Everything in one archive as well, for callers that can fetch only a few files back.
tar -czf /tmp/brrr-results.tgz -C "$RESULTS" . && mv /tmp/brrr-results.tgz "$RESULTS/results.tgz"
exit $status
