#!/usr/bin/env bash
# fuzz/run.sh [SECONDS [TARGET...]]: builds every fuzz target (cargo-fuzz, libFuzzer,
# AddressSanitizer, debug assertions), replays each target's checked-in corpus (fuzz/corpus/<target>/),
# then fuzzes each target (or only the TARGETs named) for SECONDS (default 60) into a scratch corpus
# (fuzz/scratch/<target>/, seeded from the checked-in one, which is never written). Fails on any crash, hang (-timeout) or oversized
# allocation (-malloc_limit_mb); a failing input is saved under fuzz/artifacts/<target>/.
# Prints the executions per target. See docs/fuzzing.md.
#
# Needs cargo-fuzz (`cargo install --locked cargo-fuzz@0.13.2`). The toolchain is stable: cargo fuzz
# passes -Z flags (-Zsanitizer=address), which RUSTC_BOOTSTRAP=1 lets a stable rustc accept.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-60}
shift || true
export RUSTC_BOOTSTRAP=1
if ! command -v cargo-fuzz >/dev/null; then
  echo "fuzz/run.sh: cargo-fuzz is not installed (cargo install --locked cargo-fuzz@0.13.2)" >&2
  exit 1
fi
mapfile -t targets < <(cargo fuzz list)
if [ $# -gt 0 ]; then
  for t in "$@"; do
    printf '%s\n' "${targets[@]}" | grep -qx "$t" || { echo "fuzz/run.sh: no target $t (cargo fuzz list)" >&2; exit 1; }
  done
  targets=("$@")
fi
t0=$SECONDS
cargo fuzz build -O -a
echo "fuzz: built every target in $((SECONDS - t0)) s"
# cargo fuzz builds into $CARGO_TARGET_DIR when it is set (.ci/run keeps it in its cache), else fuzz/target.
bin=${CARGO_TARGET_DIR:-target}/x86_64-unknown-linux-gnu/release
# The targets' scratch model directories (tempfile) go here, in memory when /dev/shm is there: the
# file targets rewrite a file per input, and on ext4 each rewrite of a truncated file waits for the
# disk (8x fewer executions). libFuzzer exits without running their destructors, so the whole folder
# is removed at the end.
if [ -d /dev/shm ] && [ -w /dev/shm ]; then
  TMPDIR=$(mktemp -d /dev/shm/picchio-fuzz.XXXXXX)
else
  TMPDIR="$PWD/scratch/tmp"
  mkdir -p "$TMPDIR"
fi
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT
# Limits: inputs up to 64 KiB; any single allocation above 512 MiB, RSS above 2 GiB or an input
# taking over 10 s is a finding.
limits=(-max_len=65536 -malloc_limit_mb=512 -rss_limit_mb=2048 -timeout=10)
failed=()
summary=()
for t in "${targets[@]}"; do
  mkdir -p "scratch/$t" "artifacts/$t"
  log="scratch/$t.log"
  # Replay: each checked-in input once.
  if ! "$bin/$t" "${limits[@]}" -artifact_prefix="artifacts/$t/" "corpus/$t"/* >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "fuzz: $t: a checked-in corpus input fails (log: fuzz/$log)"
    failed+=("$t (corpus)")
    continue
  fi
  replayed=$(ls "corpus/$t" | wc -l)
  # Fuzz: new inputs go to the scratch corpus (the first directory), the checked-in one only seeds.
  if "$bin/$t" "${limits[@]}" -max_total_time="$secs" -print_final_stats=1 \
      -artifact_prefix="artifacts/$t/" "scratch/$t" "corpus/$t" >"$log" 2>&1; then
    status=ok
  else
    status=FAILED
    tail -n 60 "$log"
    failed+=("$t")
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 || true)
  line="$t: $status, corpus replayed ($replayed inputs), ${execs:-?} executions in ${secs} s, ${cov:-cov: ?}, scratch corpus $(ls "scratch/$t" | wc -l) inputs"
  echo "fuzz: $line"
  summary+=("$line")
done
echo "fuzz summary:"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]} (inputs in fuzz/artifacts/)"
  exit 1
fi
echo "fuzz: all ${#targets[@]} targets passed"
