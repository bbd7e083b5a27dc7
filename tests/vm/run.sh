#!/usr/bin/env bash
# End-to-end harness: boots QEMU (TCG) guests with QEMU's emulated NVMe controller, binds it to
# vfio-pci inside the guest and runs the picchio-nvme test binaries and `picchio run --store nvme:`
# against it. See tests/vm/README.md.
#
#   tests/vm/run.sh [iommu|noiommu|all|<case>...]     (default: all)
#
# Cases: iommu-512 (q35 + intel-iommu, 512 B LBAs), iommu-4k (4 KiB LBAs), iommu-2ns (two namespaces),
# noiommu-512 (no IOMMU, vfio unsafe no-IOMMU mode), dm (device-mapper faults under the kernel nvme
# driver: tests/vm/guest-dm.sh), tcp (NVMe/TCP: the kernel's nvmet-tcp target on 127.0.0.1 in the
# guest, read by picchio and by the kernel's initiator; guest-tcp.sh). Exit status 0 only if every
# counted check passed.
# Env: VM_BOOT_TIMEOUT (s, default 300) per guest, VM_TEST_TIMEOUT (s, default 240) per test binary,
#      VM_MEM (MiB, default 1024), VM_HUGEPAGES (2 MiB pages, default 64), VM_QUIET=1 (no live console),
#      VM_TEST_ARGS (extra libtest arguments for the driver's test binaries, e.g. a name filter),
#      VM_EXTRA_TESTS (space-separated paths of more static test executables or #! scripts to run).
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
# $PICCHIO_VM_DIR moves the cache (kernel, modules, initramfs, static builds) out of the checkout.
VM="${PICCHIO_VM_DIR:-$ROOT/target/vm}"
TARGET=x86_64-unknown-linux-gnu
BOOT_TIMEOUT="${VM_BOOT_TIMEOUT:-300}"
TEST_TIMEOUT="${VM_TEST_TIMEOUT:-240}"
MEM="${VM_MEM:-1024}"
HUGEPAGES="${VM_HUGEPAGES:-64}"
FIXTURE="$ROOT/tests/fixtures/picchio_c/qwen3_moe"
REF="$ROOT/tests/fixtures/qwen3_moe/reference.json"
REF_Q4="$ROOT/tests/fixtures/qwen3_moe/reference_q4.json"
# GPT-OSS beside Qwen3: converted to Q4 on the host (section 2), packed and run in each guest.
GPT_FIXTURE="$ROOT/tests/fixtures/gpt_oss_mxfp4"
log() { echo "[vm-run] $*" >&2; }
mkdir -p "$VM"
# One run at a time per checkout: runs share target/vm/run and target/vm/cargo.
exec 9>"$VM/run.lock"
if ! flock -n 9; then log "another tests/vm/run.sh holds $VM/run.lock; waiting"; flock 9; fi
T_START="$(date +%s.%N)"

cases=()
for a in "${@:-all}"; do
  case "$a" in
    all) cases+=(iommu-512 iommu-4k iommu-2ns noiommu-512 dm tcp) ;;
    iommu) cases+=(iommu-512 iommu-4k iommu-2ns) ;;
    noiommu) cases+=(noiommu-512) ;;
    dm) cases+=(dm) ;;
    iommu-512 | iommu-4k | iommu-2ns | noiommu-512 | tcp) cases+=("$a") ;;
    -h | --help) awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"; exit 0 ;;
    *) echo "unknown mode/case '$a' (iommu|noiommu|all|iommu-512|iommu-4k|iommu-2ns|noiommu-512|dm|tcp)" >&2; exit 2 ;;
  esac
done

# --- 0. guest kernel + base initramfs (cached; cheap when already done) ---------------------------------
"$HERE/setup.sh"
# shellcheck disable=SC1091
. "$VM/kernel.env"

# --- 1. static test binaries --------------------------------------------------------------------------
# A separate target dir keeps the crt-static RUSTFLAGS from invalidating the normal target/ builds;
# --target keeps them off build scripts and proc macros.
export CARGO_TARGET_DIR="$VM/cargo"
export RUSTFLAGS="-C target-feature=+crt-static"
cd "$ROOT"
BUILD_FAIL=()
json_executables() { # stdin: cargo --message-format=json; stdout: executables of test/bin/example targets
  jq -r 'select(.reason == "compiler-artifact" and .executable != null) | .executable'
}
TEST_BINS=()
NVME_TESTS_NOTE=""
if cargo metadata --no-deps --format-version 1 | jq -e '.packages[] | select(.name == "picchio-nvme")' >/dev/null; then
  log "building picchio-nvme tests (static)"
  # Same artifacts as `cargo test -p picchio-nvme --release --no-run`, but --keep-going so the test
  # targets that do compile still run in the guest when one of them does not (the failure is counted).
  set +e
  out="$(cargo build -p picchio-nvme --release --target "$TARGET" --tests --keep-going --message-format=json 2>"$VM/build-nvme-tests.log")"
  rc=$?
  set -e
  # (not `tcp`: the NVMe/TCP initiator against its in-process target model needs no VFIO and runs in
  # `cargo test` on the host; under TCG its socket timeouts outlast the guest. The tcp case runs the
  # initiator against the kernel's nvmet.)
  mapfile -t TEST_BINS < <(jq -r 'select(.reason == "compiler-artifact" and .executable != null and .profile.test == true and .target.name != "tcp") | .executable' <<<"$out")
  if [ $rc -ne 0 ]; then
    grep -E '^(error|warning: build failed)' "$VM/build-nvme-tests.log" | head -n 20 >&2
    BUILD_FAIL+=("picchio-nvme test targets do not all compile (see target/vm/build-nvme-tests.log)")
    NVME_TESTS_NOTE="cargo build --tests -p picchio-nvme failed on the host"
  elif [ ${#TEST_BINS[@]} -eq 0 ]; then
    NVME_TESTS_NOTE="picchio-nvme has no test targets"
  fi
  if jq -e '.packages[] | select(.name == "picchio-nvme") | .targets[] | select(.kind[] == "example")' \
    < <(cargo metadata --no-deps --format-version 1) >/dev/null; then
    set +e
    # fault-injection: nvme_fault_probe's stray-DMA check (Controller::submit_raw_for_fault_test).
    out="$(cargo build -p picchio-nvme --release --target "$TARGET" --examples --features fault-injection --keep-going --message-format=json 2>"$VM/build-nvme-examples.log")"
    rc=$?
    set -e
    mapfile -t EXAMPLES < <(json_executables <<<"$out")
    if [ $rc -ne 0 ]; then
      grep -E '^error' "$VM/build-nvme-examples.log" | head -n 20 >&2
      BUILD_FAIL+=("picchio-nvme examples do not all compile (see target/vm/build-nvme-examples.log)")
    fi
  fi
else
  NVME_TESTS_NOTE="picchio-nvme is not a workspace member yet"
  log "$NVME_TESTS_NOTE: no driver tests to run"
fi
log "building picchio (static)"
PICCHIO_BIN=""
if out="$(cargo build -p picchio --bin picchio --release --target "$TARGET" --message-format=json 2>"$VM/build-picchio.log")"; then
  PICCHIO_BIN="$(json_executables <<<"$out" | grep '/picchio$' | head -n1)"
else
  tail -n 30 "$VM/build-picchio.log" >&2
  BUILD_FAIL+=("cargo build --bin picchio")
fi
# Harness-owned, driver-independent VFIO probe (plain rustc, no crates).
PROBE_BIN="$VM/probe/vfio_probe"
mkdir -p "$VM/probe"
if [ ! -x "$PROBE_BIN" ] || [ "$HERE/probe/vfio_probe.rs" -nt "$PROBE_BIN" ]; then
  rustc --edition 2021 -O --test --target "$TARGET" -C target-feature=+crt-static \
    -o "$PROBE_BIN" "$HERE/probe/vfio_probe.rs" 2>"$VM/build-probe.log" ||
    { cat "$VM/build-probe.log" >&2; BUILD_FAIL+=("rustc tests/vm/probe/vfio_probe.rs"); PROBE_BIN=""; }
fi
cd - >/dev/null

# --- 2. extra cpio: guest script, binaries (stripped), fixture -------------------------------------------
is_static() { ! LC_ALL=C readelf -l "$1" 2>/dev/null | grep -q 'Requesting program interpreter'; }
STAGE="$VM/run/extra"
rm -rf "$STAGE"; mkdir -p "$STAGE"/{test/bin,test/tests,test/probe,fixture}
install -m 0755 "$HERE/guest.sh" "$STAGE/test/guest.sh"
install -m 0755 "$HERE/guest-dm.sh" "$STAGE/test/guest-dm.sh"
install -m 0644 "$HERE/lib.sh" "$STAGE/test/lib.sh"
install -m 0755 "$HERE/nvmet-export.sh" "$STAGE/test/bin/nvmet-export.sh"
pack_bin() { # $1 = executable, $2 = dest dir
  if [ "$(head -c 2 "$1")" = '#!' ]; then install -m 0755 "$1" "$2/$(basename "$1")"; return; fi
  if ! is_static "$1"; then BUILD_FAIL+=("$(basename "$1") is dynamically linked"); return; fi
  strip --strip-debug -o "$2/$(basename "$1" | sed 's/-[0-9a-f]\{16\}$//')" "$1"
}
for b in "${TEST_BINS[@]}"; do pack_bin "$b" "$STAGE/test/tests"; done
# VM_EXTRA_TESTS: more guest tests (static executables or #! busybox-sh scripts), run like the driver's.
for b in ${VM_EXTRA_TESTS:-}; do pack_bin "$(realpath "$b")" "$STAGE/test/tests"; done
[ -n "$PROBE_BIN" ] && pack_bin "$PROBE_BIN" "$STAGE/test/probe"
for b in "${EXAMPLES[@]:-}"; do [ -n "$b" ] && pack_bin "$b" "$STAGE/test/bin"; done
[ -n "$PICCHIO_BIN" ] && pack_bin "$PICCHIO_BIN" "$STAGE/test/bin"
cp "$FIXTURE"/* "$STAGE/fixture/"
chmod -R u+w "$STAGE/fixture"
# /fixture-gpt-oss: gpt_oss_mxfp4 converted to Q4 by the static picchio just built (it runs here too).
if [ -n "$PICCHIO_BIN" ]; then
  if ! "$PICCHIO_BIN" convert "$GPT_FIXTURE" "$STAGE/fixture-gpt-oss" --no-progress >"$VM/convert-gpt-oss.log" 2>&1; then
    tail -n 5 "$VM/convert-gpt-oss.log" >&2
    BUILD_FAIL+=("picchio convert tests/fixtures/gpt_oss_mxfp4 (see target/vm/convert-gpt-oss.log)")
  fi
fi
EXTRA="$VM/run/extra.cpio"
(cd "$STAGE" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet) > "$EXTRA"
log "extra cpio: $(du -h "$EXTRA" | cut -f1) ($(ls "$STAGE/test/tests" | wc -l) test binaries, probe: $(ls "$STAGE/test/probe" | wc -l), picchio: $([ -n "$PICCHIO_BIN" ] && echo yes || echo no))"

PROMPT_IDS="$(jq -r '.prompt_ids | map(tostring) | join(",")' "$REF")"
EXPECT_TOKENS="$(jq -r '.greedy_ids | map(tostring) | join(" ")' "$REF_Q4")"
GPT_PROMPT_IDS="$(jq -r '.prompt_ids | map(tostring) | join(",")' "$GPT_FIXTURE/reference_q4.json")"
GPT_EXPECT_TOKENS="$(jq -r '.greedy_ids | map(tostring) | join(" ")' "$GPT_FIXTURE/reference_q4.json")"
IMAGE_BYTES="$(stat -c %s "$FIXTURE/experts.picchioflat")"
SCRATCH_OFFSET=$(( (IMAGE_BYTES + (1 << 20) - 1) / (1 << 20) * (1 << 20) ))

# --- 3. one guest per case -------------------------------------------------------------------------
TOTAL_PASS=0; TOTAL_FAIL=0; TOTAL_SKIP=0
SUMMARY=()
for f in "${BUILD_FAIL[@]:-}"; do
  [ -n "$f" ] || continue
  echo "PICCHIO-VM: FAIL host-build $f"; TOTAL_FAIL=$((TOTAL_FAIL + 1))
done

run_case() {
  local c="$1" mode="${1%%-*}" dir="$VM/run/$1"
  local lba=512 ns=1 scratch_ns=1 scratch_off="$SCRATCH_OFFSET" mdts=""
  case "$c" in *-4k) lba=4096 ;; *-2ns) ns=2; scratch_ns=2; scratch_off=0 ;; esac
  # MDTS 10 (4 MiB) where a command may need a chained PRP list; QEMU's default (7, 512 KiB)
  # elsewhere, so transfers are split at MDTS there. Not more: QEMU maps at most 1024 PRP entries
  # per command (IOV_MAX) and fails longer ones with Internal Error.
  case "$c" in iommu-2ns | noiommu-512) mdts=10 ;; esac
  local base="$VM/initramfs-$mode.cpio.gz" boot_timeout="$BOOT_TIMEOUT"
  # tcp runs picchio a few dozen times under TCG (each run in a loaded CI takes 10-20 s): twice the time.
  [ "$c" = tcp ] && boot_timeout=$((BOOT_TIMEOUT * 2))
  [ "$c" = tcp ] && base="$VM/initramfs-iommu.cpio.gz"   # no VFIO there: any base (both hold the tcp modules)
  if [ ! -s "$base" ]; then
    echo "SKIPPED mode $mode ($c): $(grep '^NOIOMMU=' "$VM/kernel.env" | cut -d= -f2-)"
    TOTAL_SKIP=$((TOTAL_SKIP + 1)); SUMMARY+=("$c: SKIPPED (no $mode initramfs)")
    return
  fi
  rm -rf "$dir"; mkdir -p "$dir/env/test"
  cat > "$dir/env/test/env" <<EOF
CASE=$c
MODE=$mode
NAMESPACES=$ns
LBA_SIZE=$lba
PROMPT_IDS=$PROMPT_IDS
EXPECT_TOKENS="$EXPECT_TOKENS"
GPT_PROMPT_IDS=$GPT_PROMPT_IDS
GPT_EXPECT_TOKENS="$GPT_EXPECT_TOKENS"
TEST_TIMEOUT=$TEST_TIMEOUT
HUGEPAGES=$HUGEPAGES
SCRATCH_NSID=$scratch_ns
SCRATCH_OFFSET=$scratch_off
NVME_TESTS_NOTE="$NVME_TESTS_NOTE"
TEST_ARGS="${VM_TEST_ARGS:-}"
QEMU_MDTS=$mdts
EOF
  # tcp: its own guest script replaces /test/guest.sh (a later cpio member overrides an earlier one).
  [ "$c" = tcp ] && tcp_stage "$dir/env"
  (cd "$dir/env" && find . | LC_ALL=C sort | cpio -o -H newc --quiet) > "$dir/env.cpio"
  # The kernel only finds an uncompressed cpio that follows a compressed one at a 4-byte aligned
  # offset (zero padding is skipped), so pad the gzip'd base.
  cp "$base" "$dir/initrd"; truncate -s %512 "$dir/initrd"
  cat "$EXTRA" "$dir/env.cpio" >> "$dir/initrd"

  # Backing files: sparse raw images, the packed image at byte 0 of namespace 1.
  truncate -s 256M "$dir/ns1.img"
  dd if="$FIXTURE/experts.picchioflat" of="$dir/ns1.img" conv=notrunc status=none
  [ "$c" = tcp ] && { truncate -s 64M "$dir/ns1.img"; truncate -s 64M "$dir/ns2.img"; cp "$dir/ns1.img" "$dir/ns2.img"; }
  local q=(qemu-system-x86_64 -accel tcg,thread=multi -cpu max -smp 2 -m "$MEM" -nographic -no-reboot
    -net none -kernel "$KERNEL" -initrd "$dir/initrd"
    -drive "file=$dir/ns1.img,if=none,id=nvm1,format=raw,cache=none,aio=threads")
  # no_timer_check: under TCG on a loaded host the kernel's IO-APIC timer probe can miss its window and
  # panic at t=0 ("timer doesn't work through Interrupt-remapped IO-APIC"), seen once in iommu-4k.
  local append="console=ttyS0 panic=-1 quiet loglevel=4 no_timer_check"
  if [ "$mode" = tcp ]; then
    q+=(-machine q35)
  elif [ "$mode" = iommu ]; then
    q+=(-machine q35,kernel-irqchip=split -device intel-iommu,intremap=on,caching-mode=on)
    append+=" intel_iommu=on"
  else
    q+=(-machine q35)
    append+=" vfio.enable_unsafe_noiommu_mode=1"
  fi
  case "$c" in
    *-4k) q+=(-device "nvme,serial=picchio4k,drive=nvm1,logical_block_size=4096,physical_block_size=4096") ;;
    *-2ns)
      truncate -s 128M "$dir/ns2.img"
      q+=(-drive "file=$dir/ns2.img,if=none,id=nvm2,format=raw,cache=none,aio=threads"
        -device "nvme,id=nvme0,serial=picchio2ns,mdts=$mdts"
        -device nvme-ns,drive=nvm1,bus=nvme0,nsid=1 -device nvme-ns,drive=nvm2,bus=nvme0,nsid=2) ;;
    tcp) # the nvmet target's backing namespaces: nsid 1 with 512 B LBAs, nsid 2 with 4 KiB LBAs
      q+=(-drive "file=$dir/ns2.img,if=none,id=nvm2,format=raw,cache=none,aio=threads"
        -device "nvme,id=nvme0,serial=picchiotcp"
        -device nvme-ns,drive=nvm1,bus=nvme0,nsid=1
        -device nvme-ns,drive=nvm2,bus=nvme0,nsid=2,logical_block_size=4096,physical_block_size=4096) ;;
    *) q+=(-device "nvme,serial=picchio512,drive=nvm1${mdts:+,mdts=$mdts}") ;;
  esac
  q+=(-append "$append")
  printf '%q ' "${q[@]}" > "$dir/qemu.cmd"; echo >> "$dir/qemu.cmd"

  log "case $c: booting (timeout ${boot_timeout}s)"
  local t0 t1 rc=0
  t0="$(date +%s.%N)"
  if [ "${VM_QUIET:-0}" = 1 ]; then
    timeout --kill-after=10 "$boot_timeout" "${q[@]}" </dev/null >"$dir/console.log" 2>&1 || rc=$?
  else
    set +e
    timeout --kill-after=10 "$boot_timeout" "${q[@]}" </dev/null 2>&1 | tee "$dir/console.log" | sed -u "s/^/[$c] /"
    rc="${PIPESTATUS[0]}"
    set -e
  fi
  t1="$(date +%s.%N)"
  local wall; wall="$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')"
  tr -d '\r' < "$dir/console.log" > "$dir/console.txt"

  local p f s extra_fail=0
  p="$(grep -c '^PICCHIO-VM: PASS ' "$dir/console.txt" || true)"
  f="$(grep -c '^PICCHIO-VM: FAIL ' "$dir/console.txt" || true)"
  s="$(grep -c '^PICCHIO-VM: SKIP ' "$dir/console.txt" || true)"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "PICCHIO-VM: FAIL $c:boot-timeout QEMU killed after ${boot_timeout}s"; extra_fail=$((extra_fail + 1))
  elif ! grep -q '^PICCHIO-VM: DONE' "$dir/console.txt"; then
    echo "PICCHIO-VM: FAIL $c:incomplete guest never printed DONE (QEMU exit $rc)"; extra_fail=$((extra_fail + 1))
  fi
  # DMAR lines are accepted only inside a BEGIN/END-EXPECTED-DMAR window (the stray-DMA check),
  # and each window must hold the fault for its IOVA; any other DMAR line fails the case.
  local dmar_out
  dmar_out="$(awk '/^PICCHIO-VM: BEGIN-EXPECTED-DMAR /{w = 1; next} /^PICCHIO-VM: END-EXPECTED-DMAR /{w = 0; next}
                   /DMAR:/ && !w' "$dir/console.txt")"
  if [ -n "$dmar_out" ]; then
    head -n 5 <<<"$dmar_out"
    echo "PICCHIO-VM: FAIL $c:dmar DMAR: lines on the guest console outside an expected-fault window"
    extra_fail=$((extra_fail + 1))
  fi
  local extra_pass=0 wname wiova wline
  while read -r wname wiova; do
    wline="$(awk -v n="$wname" '$0 ~ "^PICCHIO-VM: BEGIN-EXPECTED-DMAR " n " " {w = 1; next}
                               $0 ~ "^PICCHIO-VM: END-EXPECTED-DMAR " n "$" {w = 0; next}
                               w && /DMAR:/' "$dir/console.txt" | grep -m1 "fault addr $wiova" || true)"
    if [ -n "$wline" ]; then
      echo "PICCHIO-VM: PASS $c:$wname-console the DMAR fault for $wiova is in its window: ${wline#*DMAR: }"
      extra_pass=$((extra_pass + 1))
    else
      echo "PICCHIO-VM: FAIL $c:$wname-console no DMAR fault for $wiova on the console inside its window"
      extra_fail=$((extra_fail + 1))
    fi
  done < <(sed -n 's/^PICCHIO-VM: BEGIN-EXPECTED-DMAR \([^ ]*\) \([^ ]*\).*/\1 \2/p' "$dir/console.txt")
  p=$((p + extra_pass))
  if grep -qE 'Kernel panic|BUG: |Oops' "$dir/console.txt"; then
    echo "PICCHIO-VM: FAIL $c:kernel guest kernel panic/BUG/Oops"; extra_fail=$((extra_fail + 1))
  fi
  f=$((f + extra_fail))
  if [ "$f" -gt 0 ] && [ "${VM_QUIET:-0}" = 1 ]; then
    echo "---- console of $c (failed) ----"; sed "s/^/[$c] /" "$dir/console.txt"; echo "----"
  fi
  local libtest
  libtest="$(grep -E '^test result: ' "$dir/console.txt" |
    awk '{for (i = 1; i <= NF; i++) {if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) g += $i}}
         END {printf "%d passed, %d failed, %d ignored", p, f, g}' || true)"
  TOTAL_PASS=$((TOTAL_PASS + p)); TOTAL_FAIL=$((TOTAL_FAIL + f)); TOTAL_SKIP=$((TOTAL_SKIP + s))
  SUMMARY+=("$c: $p passed, $f failed, $s skipped; libtest inside: $libtest; ${wall}s wall (log: ${dir#"$ROOT"/}/console.txt)")
  grep -E '^PICCHIO-VM: (FAIL|SKIP)' "$dir/console.txt" | sed "s/^/  [$c] /" >&2 || true
  # tcp: the qd-sweep figures of both initiators and fio, one line per point.
  grep '^PICCHIO-VM: SIDE-BY-SIDE' "$dir/console.txt" | sed "s/^PICCHIO-VM: /  [$c] /" >&2 || true
}

# The tcp case's guest script and tools, staged into its per-case cpio ($1 = its root).
# fio (for the qd-sweep beside the kernel's initiator) goes in with its shared libraries when the host
# has it (CI installs it): Debian's fio links librados, librbd, glusterfs, ICU... about 80 MB, so only
# this case carries it. /test/bin/fio runs it through the host's dynamic loader.
tcp_stage() {
  install -m 0755 "$HERE/guest-tcp.sh" "$1/test/guest.sh"
  local fio lib
  fio="$(command -v fio || true)"
  [ -n "$fio" ] || return 0
  mkdir -p "$1/test/fio/lib" "$1/test/bin"
  cp -L "$fio" "$1/test/fio/fio"
  for lib in $(ldd "$fio" | awk '$3 ~ /^\// {print $3} $1 ~ /^\/.*ld-linux/ {print $1}'); do
    cp -L "$lib" "$1/test/fio/lib/"
  done
  printf '#!/bin/sh\nexec /test/fio/lib/%s --library-path /test/fio/lib /test/fio/fio "$@"\n' \
    "$(basename "$(ldd "$fio" | awk '$1 ~ /^\/.*ld-linux/ {print $1}')")" > "$1/test/bin/fio"
  chmod 0755 "$1/test/bin/fio"
}

for c in "${cases[@]}"; do run_case "$c"; done

echo
echo "== tests/vm summary (kernel $KVER, TCG)"
for l in "${SUMMARY[@]}"; do echo "  $l"; done
echo "$TOTAL_PASS passed, $TOTAL_FAIL failed, $TOTAL_SKIP skipped ($(awk -v a="$T_START" -v b="$(date +%s.%N)" 'BEGIN{printf "%.0f", b-a}') s total)"
[ "$TOTAL_FAIL" -eq 0 ] && [ "$TOTAL_PASS" -gt 0 ]
