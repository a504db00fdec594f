#!/usr/bin/env bash
# compute-sanitizer over brrr's CUDA tests on the lent GPU, one log per tool in $OUT.
#
#   bash benchmarks/sanitize.sh "<pytest targets>" [seconds per tool] [tools]
#
# memcheck and racecheck instrument only brrr's kernels (kernel-name filter): PyTorch's own
# kernels run uninstrumented, which keeps the suite within minutes. initcheck instruments every
# kernel (a write by an uninstrumented kernel would look uninitialised to it).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/brrr-device-out}
mkdir -p "$OUT"
TESTS=${1:-tests}
LIMIT=${2:-150}
TOOLS=${3:-memcheck racecheck initcheck}
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# BRRR_SKIP_BUILD=1: the extension was just built in place (by device_run.sh in the same call).
if [ "${BRRR_SKIP_BUILD:-0}" != 1 ] && ! BRRR_CUDA_ARCHS=90 python3 setup.py build_ext --inplace --force > /tmp/brrr-build.log 2>&1; then
  tail -20 /tmp/brrr-build.log
  exit 1
fi
"$SAN" --version | tail -1 | tee "$OUT/sanitizer-version.txt"
status=0
for tool in $TOOLS; do
  filter=(--kernel-name kns=brrr)
  [ "$tool" = initcheck ] && filter=()
  start=$(date +%s)
  timeout "$LIMIT" "$SAN" --tool "$tool" "${filter[@]}" --error-exitcode 99 --print-limit 1000000 --show-backtrace no \
    python3 -m pytest $TESTS -q -m cuda -p no:cacheprovider -x > /tmp/sanitizer-$tool.log 2>&1
  rc=$?
  # Reports counted by the kernel they occurred in, then the log without the repeats.
  grep -E "^=========     at " /tmp/sanitizer-$tool.log | sed -E 's/^=========     at //; s/\(.*//' | sort | uniq -c | sort -rn \
    > "$OUT/sanitizer-$tool-by-kernel.txt"
  { head -60 /tmp/sanitizer-$tool.log; echo "..."; grep -v -E "^=========" /tmp/sanitizer-$tool.log | tail -5;
    grep "ERROR SUMMARY" /tmp/sanitizer-$tool.log; } > "$OUT/sanitizer-$tool.log"
  [ $rc -ne 0 ] && status=1
  echo "$tool: exit $rc in $(( $(date +%s) - start )) s; $(grep -E '^[0-9]+ (passed|failed)|ERROR SUMMARY' "$OUT/sanitizer-$tool.log" | tr '\n' ' ')"
done
exit $status
