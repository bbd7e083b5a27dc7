#!/usr/bin/env bash
# Runs picchio-blockdev's tests (unit and integration, psync and IOCP) for x86_64-pc-windows-gnu
# under Wine, in a throwaway WINEPREFIX, and prints what ran.
# Each test binary runs through wine-runner.sh beside this script: one that Wine fails to start
# (it exits before libtest prints anything) is named on a WINE-LAUNCH line and run once more.
#
# Installs nothing. Needs:
#   rustup target add x86_64-pc-windows-gnu
#   apt-get install -y --no-install-recommends gcc-mingw-w64-x86-64 wine64 procps (pgrep)
#     (Debian bookworm: the MinGW linker and 64-bit Wine 8.0; ~205 MB of downloads, ~35 s here)
#
# Extra arguments go to `cargo test` (e.g. `tests/windows/run.sh --test iocp`, or `-- --nocapture`).
# Wine older than 9.0 (bookworm has 8.0) has no bcryptprimitives.dll, which Rust's std imports at
# start-up; then a stand-in (bcryptprimitives.c beside this script) is built into the prefix.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
target=x86_64-pc-windows-gnu

die() {
    echo "tests/windows/run.sh: $*" >&2
    exit 2
}

wine=""
for w in wine64 /usr/lib/wine/wine64 wine; do
    if command -v "$w" >/dev/null 2>&1; then
        wine="$(command -v "$w")"
        break
    fi
done
[ -n "$wine" ] || die "no Wine found: apt-get install -y wine64"
command -v x86_64-w64-mingw32-gcc >/dev/null 2>&1 || die "no MinGW linker: apt-get install -y gcc-mingw-w64-x86-64"
rustup target list --installed 2>/dev/null | grep -qx "$target" || die "no Rust target: rustup target add $target"
wineserver="$(dirname "$wine")/wineserver"
command -v "$wineserver" >/dev/null 2>&1 || wineserver="$(command -v wineserver || true)"

prefix="$(mktemp -d -t picchio-wine.XXXXXX)"
# A process and everything it started, children first.
kill_tree() {
    local child
    for child in $(pgrep -P "$1"); do kill_tree "$child"; done
    kill -TERM "$1" 2>/dev/null || true
}
# On any exit (bash runs this on SIGTERM and SIGINT too): stop what this script started (cargo
# and the test binaries it runs: left alone they would go on and recreate the prefix), then the
# prefix's Wine processes.
cleanup() {
    local child
    for child in $(pgrep -P $$); do kill_tree "$child"; done
    # -k returns at once; the server writes the prefix's registry as it exits, so wait for that
    # before removing the prefix (or part of it comes back).
    if [ -n "$wineserver" ]; then
        WINEPREFIX="$prefix" "$wineserver" -k 2>/dev/null || true
        WINEPREFIX="$prefix" timeout 60 "$wineserver" -w 2>/dev/null || true
    fi
    rm -rf "$prefix"
}
trap cleanup EXIT
export WINEPREFIX="$prefix" WINEDEBUG=-all,err+all WINEDLLOVERRIDES="mscoree,mshtml=" DISPLAY=

start=$(date +%s)
echo "== wine: $("$wine" --version 2>/dev/null || echo unknown) ($wine), WINEPREFIX=$prefix"
# One server for the whole run, started first: with the default (exit 3 s after the last client) a
# test binary could start while the server is shutting down. wineboot starts the system processes
# (services, device manager) under it with no terminal or pipe of ours, so they don't hold a pipe
# open after the test binaries end.
if [ -n "$wineserver" ]; then "$wineserver" -p; fi
"$wine" wineboot --init </dev/null >/dev/null 2>&1 || die "wineboot --init failed in $prefix"
sys32="$prefix/drive_c/windows/system32"
if [ -e "$sys32/bcryptprimitives.dll" ]; then
    echo "== this Wine has bcryptprimitives.dll"
else
    echo "== building the bcryptprimitives.dll stand-in (ProcessPrng -> RtlGenRandom) into the prefix"
    x86_64-w64-mingw32-gcc -O2 -shared -o "$sys32/bcryptprimitives.dll" "$here/bcryptprimitives.c" -ladvapi32
fi
echo "== prefix ready in $(($(date +%s) - start)) s"

cd "$root"
cargo test -p picchio-blockdev --target "$target" --no-run "$@"
export PICCHIO_WINE="$wine" CARGO_TARGET_X86_64_PC_WINDOWS_GNU_RUNNER="$here/wine-runner.sh"
log="$prefix/cargo-test.log"
set +e
cargo test -p picchio-blockdev --target "$target" "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e

echo
echo "== what ran (cargo test -p picchio-blockdev --target $target under $wine):"
grep -E '^\s+Running |^\s+Doc-tests |^test result:' "$log" | sed -e 's/^ *//' || true
echo "== binaries Wine failed to start (run again once by wine-runner.sh):"
grep -E '^WINE-LAUNCH: ' "$log" || echo "(none)"
echo "== skipped inside tests:"
grep -E '^SKIP ' "$log" | sort -u || echo "(none)"
echo "== total $(($(date +%s) - start)) s, exit status $status"
exit "$status"
