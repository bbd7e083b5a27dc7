#!/usr/bin/env bash
# Cargo's runner for x86_64-pc-windows-gnu test binaries (set by run.sh): runs one under Wine.
#
# A binary Wine fails to start is not a test result. CI once saw a test binary exit 1 under Wine
# with no output at all, not even libtest's "running N tests" (the same binary passed on every rerun,
# loaded or idle). When a binary exits non-zero before libtest has printed its first line, this
# says so, with the exit status, and runs it once more; a second such exit, or any failure after
# libtest started, is the binary's result.
set -uo pipefail
: "${PICCHIO_WINE:?run.sh sets PICCHIO_WINE}"
[ $# -ge 1 ] || { echo "usage: wine-runner.sh BINARY.exe [ARG...] (cargo passes them)" >&2; exit 2; }
out="$(mktemp -t picchio-wine-run.XXXXXX)"
trap 'rm -f "$out"' EXIT
for attempt in 1 2; do
    "$PICCHIO_WINE" "$@" 2>&1 | tee "$out"
    status=${PIPESTATUS[0]}
    if [ "$status" -eq 0 ] || grep -qE $'^running [0-9]+ tests?\r?$' "$out"; then
        exit "$status"
    fi
    echo "WINE-LAUNCH: $(basename "$1") exited with status $status before libtest printed anything (attempt $attempt of 2)" >&2
done
exit "$status"
