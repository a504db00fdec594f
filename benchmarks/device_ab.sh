#!/usr/bin/env bash
# A/B on the GPU machine in one go: this tree and each git revision named, built side by side,
# then one command run in each tree, this tree first.
#
#   bash benchmarks/device_ab.sh "<command>" REV [REV ...]
#
# A REV that is a folder is taken as a tree prepared beside this one (the GPU machine's copy of the
# working tree has no .git: prepare it here with `git worktree add .ab/NAME REV`, ignore .ab/, and
# carry it); otherwise it is checked out with git worktree.
# e.g. bash benchmarks/device_ab.sh "python3 benchmarks/probes/floor_probe.py --only norms
#      --ops layer_norm --dtypes bf16 --no-compile" candidate/ln-one-sum
#
# A revision's tree (a git worktree in /tmp/brrr-ab) starts from a copy of this tree's compiled
# objects, less those whose dependency files name a file of cuda/ or csrc/ that differs between
# the two, so only the changed translation units compile again. The command's output goes to
# $OUT/ab-<tree>.txt (the tree: "here" or the revision with / as -) and its tail to the terminal.
# BRRR_AB_BUILD sets the build command (default: sm_90, as benchmarks/device_run.sh builds).
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { sed -n '2,6p' "$0"; exit 2; }
COMMAND=$1
shift
OUT=${OUT:-/tmp/brrr-device-out}
BUILD=${BRRR_AB_BUILD:-BRRR_CUDA_ARCHS=90 python3 setup.py build_ext --inplace}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then  # peers the image lacks (Liger-Kernel), as device_run.sh takes them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

build() {  # build in the current folder, into $1's log
  local start=$(date +%s)
  if ! bash -c "$BUILD" > "$OUT/build-$1.log" 2>&1; then
    grep -E "error" "$OUT/build-$1.log" | head -20
    tail -5 "$OUT/build-$1.log"
    return 1
  fi
  echo "build $1: $(( $(date +%s) - start )) s; $(grep -h -o 'compiling [0-9]* CUDA files' "$OUT/build-$1.log" || echo 'no CUDA file compiled')"
}

build here || exit 1
HERE=$(pwd)
trees=("here:$HERE")
for rev in "$@"; do
  if [ -d "$rev" ]; then  # a tree prepared beside this one (the GPU machine's copy has no .git)
    tree=$(cd "$rev" && pwd)
    name=$(basename "$tree")
  else
    name=${rev//\//-}
    tree=/tmp/brrr-ab/$name
    git worktree remove --force "$tree" > /dev/null 2>&1
    git worktree add --detach -q "$tree" "$rev" || exit 1
  fi
  rm -rf "$tree/build"
  [ -d build ] && cp -a build "$tree/"
  # The objects to compile again: those depending on a file that differs between the trees.
  changed=$(for file in $( (cd "$HERE" && find cuda csrc setup.py -type f; cd "$tree" && find cuda csrc setup.py -type f) | sort -u); do
    cmp -s "$HERE/$file" "$tree/$file" || echo "$file"
  done)
  if [ -d "$tree/build" ] && [ -n "$changed" ]; then
    while IFS= read -r deps; do
      for file in $changed; do
        if grep -qF "/$file" "$deps"; then rm -f "${deps%.d}.o" "$deps"; break; fi
      done
    done < <(find "$tree/build" -name '*.d')
  fi
  # setuptools skips an extension whose linked library is newer than its sources (the copy's is),
  # and with it the CUDA objects' dependency check: drop the library so that the tree links its own.
  rm -rf "$tree"/build/lib.* "$tree"/brrr/_C*.so
  (cd "$tree" && build "$name") || exit 1
  trees+=("$name:$tree")
done

for entry in "${trees[@]}"; do
  name=${entry%%:*}
  start=$(date +%s)
  (cd "${entry#*:}" && bash -c "$COMMAND") > "$OUT/ab-$name.txt" 2>&1
  echo "== $name: exit $?, $(( $(date +%s) - start )) s"
  grep -v -i -E "warn|^#" "$OUT/ab-$name.txt" | tail -40 | cut -c1-220
done
