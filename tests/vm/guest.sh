#!/bin/sh
# Runs inside the QEMU guest (busybox sh), started by /init. tests/vm/run.sh packs it as /test/guest.sh
# together with /test/env, the test binaries (/test/bin, /test/tests) and the model fixture (/fixture).
# Every check prints exactly one marker line that run.sh counts:
#   PICCHIO-VM: PASS <check> [detail]   PICCHIO-VM: FAIL <check> <reason>   PICCHIO-VM: SKIP <check> <reason>
. /test/env
. /test/lib.sh

# Block device of namespace $1 of our controller, waiting for it up to 20 s.
nsdev() {
  i=0
  while [ $i -lt 200 ]; do
    for d in /sys/bus/pci/devices/"$BDF"/nvme/nvme*/nvme*n"$1"; do
      [ -e "$d" ] && [ -b "/dev/$(basename "$d")" ] && { echo "/dev/$(basename "$d")"; return 0; }
    done
    sleep 0.1; i=$((i + 1))
  done
  return 1
}

# ---- zero-copy expert slots and `picchio pack --out nvme:` (issue 4 A/B) ------------------------------
# After run_picchio with an nvme: store: every expert read went straight into a cache slot in the
# driver's hugepage DMA pool (bounce_bytes 0), nothing fell back. $1 = check name.
check_zero_copy() {
  bb="$(json_num bounce_bytes)"; reads="$(json_num reads)"; fb="$(json_num fallbacks)"
  eng="$(sed -n 's/.*"engine":"\([^"]*\)".*/\1/p' /tmp/picchio.json)"
  if [ ! -s /tmp/picchio.json ]; then fail "$1" "no JSON from picchio run"
  elif [ "$bb" != 0 ]; then fail "$1" "bounce_bytes=$bb, want 0 (engine: $eng; $(grep -m1 -i hugepage /tmp/picchio.err))"
  elif [ -z "$reads" ] || [ "$reads" -eq 0 ]; then fail "$1" "no expert read from the store (reads='$reads')"
  elif [ "$fb" != 0 ]; then fail "$1" "$fb experts fell back to safetensors"
  elif ! echo "$eng" | grep -q 'expert cache slots: nvme DMA pool'; then fail "$1" "engine '$eng' names no DMA slot pool"
  else pass "$1" "$reads expert reads, 0 bounce bytes, 0 fallbacks ($eng)"; fi
}

# `picchio pack /fixture` with $3.. as arguments must be refused (exit != 0) with output matching $2.
# $1 = check name. Output in /tmp/pack.out.
pack_refused() {
  name="$1"; want="$2"; shift 2
  timeout "$TEST_TIMEOUT" $PICCHIO pack /fixture --no-progress "$@" > /tmp/pack.out 2>&1
  prc=$?
  sed "s/^/picchio pack: /" /tmp/pack.out
  if [ $prc -eq 0 ]; then fail "$name" "picchio pack $* exited 0, want a refusal"
  elif ! grep -q "$want" /tmp/pack.out; then fail "$name" "output lacks '$want'"
  else pass "$name" "picchio pack $* -> $(grep -m1 "$want" /tmp/pack.out | cut -c1-160)"; fi
}

# Kernel phase (iommu-2ns): an ext4 superblock (s_log_block_size 2 at byte 1048, magic 0xEF53 at
# 1080) at LBA 0 of the scratch namespace 2, which `pack --out nvme:BDF/2` must then refuse.
pack_nvme_prepare_ns2() {
  [ "$NAMESPACES" -ge 2 ] && [ -n "$DEV2" ] || return 0
  dd if=/dev/zero of=/tmp/ext4 bs=4096 count=1 2>/dev/null
  printf '\002\000\000\000' | dd of=/tmp/ext4 bs=1 seek=1048 conv=notrunc 2>/dev/null
  printf '\123\357' | dd of=/tmp/ext4 bs=1 seek=1080 conv=notrunc 2>/dev/null
  if dd if=/tmp/ext4 of="$DEV2" bs=4096 count=1 oflag=direct conv=notrunc 2>/dev/null; then
    pass pack-nvme-ns2-ext4 "ext4 superblock magic written at byte 1080 of $DEV2"
  else fail pack-nvme-ns2-ext4 "could not write $DEV2"; fi
}

# VFIO phase (iommu-2ns), before the driver tests may use the scratch namespace: refused without
# --force (and nothing written), written with it, then read back by run and verify.
pack_nvme_ns2_checks() {
  [ "$NAMESPACES" -ge 2 ] && [ $HAVE_CLI = 1 ] || return 0
  pack_refused pack-nvme-ns2-refused 'refusing to write the image.*ext2/3/4 file system' --out "nvme:$BDF/2"
  pack_ok pack-nvme-ns2-forced /fixture --out "nvme:$BDF/2" --force
  run_picchio picchio-nvme-ns2 "nvme:$BDF/2" ""
  check_zero_copy picchio-nvme-ns2-zero-copy
  verify_ok verify-nvme-ns2 /fixture "nvme:$BDF/2" '48 entries'
}

# VFIO phase, after the driver tests: rewrite namespace 1 through the driver — first a 1-layer
# prefix image (16 entries: proves the writes land), then the whole fixture (Picchio (C)'s image
# again, which kernel-rebind-image checks after unbind) — and read it back with verify and run.
pack_nvme_ns1_checks() {
  [ $HAVE_CLI = 1 ] || { skip pack-nvme "no picchio binary packed"; return 0; }
  pack_ok pack-nvme-prefix /fixture --out "nvme:$BDF" --layers 1 --force
  verify_ok verify-nvme-prefix /fixture "nvme:$BDF" '16 entries'
  # --no-model-record: Picchio (C)'s bytes exactly, as the host wrote them (the fault probes that
  # follow compare LBA 0.. with the image file); the prefix pack above wrote a record.
  pack_ok pack-nvme /fixture --out "nvme:$BDF" --force --no-model-record
  verify_ok verify-nvme /fixture "nvme:$BDF" '48 entries'
  run_picchio picchio-nvme-after-pack "nvme:$BDF" ""
  check_zero_copy picchio-nvme-after-pack-zero-copy
}
# GPT-OSS beside Qwen3 (VFIO phase, before pack_nvme_ns1_checks writes the Qwen3 image back):
# /fixture-gpt-oss is tests/fixtures/gpt_oss_mxfp4 converted to Q4 on the host (run.sh). Packed onto
# namespace 1 through the driver, verified against the directory (32 entries), then run from there
# with zero-copy slots: the tokens must be the file tier's, i.e. transformers' Q4 tokens
# (GPT_EXPECT_TOKENS; gpt_oss_tiers.rs checks that every file tier gives them).
gpt_oss_nvme_checks() {
  [ $HAVE_CLI = 1 ] || { skip gpt-oss-pack-nvme "no picchio binary packed"; return 0; }
  [ -f /fixture-gpt-oss/config.json ] || { fail gpt-oss-pack-nvme "no /fixture-gpt-oss (the host's convert failed)"; return 0; }
  pack_ok gpt-oss-pack-nvme /fixture-gpt-oss --out "nvme:$BDF" --force || return 0
  verify_ok gpt-oss-verify-nvme /fixture-gpt-oss "nvme:$BDF" '32 entries'
  run_picchio gpt-oss-nvme "nvme:$BDF" "" /fixture-gpt-oss "$GPT_PROMPT_IDS" "$GPT_EXPECT_TOKENS"
  check_zero_copy gpt-oss-nvme-zero-copy
}
# Too few hugepages for the expert cache: with nr_hugepages at the smallest count the driver can start
# with (found by trying 1, 2, ...; every page is then taken by its queues and bounce buffers), the run
# must warn once with the pages needed and the nr_hugepages command, read through bounce buffers
# (bounce_bytes = bytes_read > 0), and still give the tokens. nr_hugepages is restored afterwards.
zero_copy_shortfall_check() {
  [ $HAVE_CLI = 1 ] || { skip nvme-hugepage-shortfall "no picchio binary packed"; return 0; }
  n=1; ok=0
  while [ $n -le 24 ] && [ $ok = 0 ]; do
    echo "$n" > /proc/sys/vm/nr_hugepages
    if timeout "$TEST_TIMEOUT" /test/bin/picchio run --model /fixture --store "nvme:$BDF" --prompt-ids "$PROMPT_IDS" \
      -n 16 --json > /tmp/picchio.json 2> /tmp/picchio.err; then ok=1; else n=$((n + 1)); fi
  done
  echo "$HUGEPAGES" > /proc/sys/vm/nr_hugepages
  toks="$(tr -d ' \n\r\t' < /tmp/picchio.json | sed -n 's/.*"tokens":\[\([0-9,]*\)\].*/\1/p' | tr ',' ' ')"
  warns="$(grep -c 'zero-copy NVMe reads need the expert cache in DMA memory' /tmp/picchio.err)"
  bb="$(json_num bounce_bytes)"; br="$(json_num bytes_read)"
  grep -m1 'zero-copy NVMe reads need' /tmp/picchio.err | sed 's/^/shortfall warning: /'
  if [ $ok = 0 ]; then fail nvme-hugepage-shortfall "picchio run never started with up to 24 hugepages: $(tail -n 1 /tmp/picchio.err)"
  elif [ "$toks" != "$EXPECT_TOKENS" ]; then fail nvme-hugepage-shortfall "tokens '$toks' with $n hugepages"
  elif [ "$warns" != 1 ]; then fail nvme-hugepage-shortfall "$warns shortfall warnings with $n hugepages, want exactly 1"
  elif ! grep -q '1 × 2 MiB hugepages for 48 slots.*echo [0-9]* > /proc/sys/vm/nr_hugepages' /tmp/picchio.err; then
    fail nvme-hugepage-shortfall "the warning does not name the pages needed and the nr_hugepages command"
  elif [ -z "$bb" ] || [ "$bb" = 0 ] || [ "$bb" != "$br" ]; then fail nvme-hugepage-shortfall "bounce_bytes '$bb' != bytes_read '$br' (> 0)"
  else pass nvme-hugepage-shortfall "with $n hugepages: one warning, $bb expert bytes bounced, tokens match"; fi
}
# ---- end of zero-copy / pack sections ------------------------------------------------------------------

# run.sh case `dm` (its initramfs says mode dm): the device-mapper fault cases, with the helpers above.
if [ "$(cat /etc/vm-mode)" = dm ]; then . /test/guest-dm.sh; exit 0; fi

echo "PICCHIO-VM: CASE $CASE mode=$MODE namespaces=$NAMESPACES lba=$LBA_SIZE"

# 1. Find the NVMe function by class code (mass storage / NVM / NVMe).
BDF="$(nvme_bdf)" || { fail find-nvme "no PCI function with class 0x010802"; exit 0; }
pass find-nvme "$BDF $(cat /sys/bus/pci/devices/$BDF/vendor):$(cat /sys/bus/pci/devices/$BDF/device)"

# 2. Kernel nvme driver baseline: it reads the image written at LBA 0 of namespace 1 on the host.
if ! load_mods /etc/nvme.modules; then fail kernel-nvme-load "insmod failed"; exit 0; fi
DEV1="$(nsdev 1)" || { fail kernel-nvme-ns1 "no block device for namespace 1 after 20 s"; exit 0; }
check_image kernel-read-image "$DEV1"
lbs="$(cat /sys/block/"$(basename "$DEV1")"/queue/logical_block_size)"
if [ "$lbs" = "$LBA_SIZE" ]; then pass kernel-lba-size "$lbs"; else fail kernel-lba-size "got $lbs, want $LBA_SIZE"; fi
if [ "$NAMESPACES" -ge 2 ]; then
  if DEV2="$(nsdev 2)"; then pass kernel-ns2 "$DEV2 $(cat /sys/block/"$(basename "$DEV2")"/size) sectors"
  else fail kernel-ns2 "namespace 2 has no block device"; fi
fi
pack_nvme_prepare_ns2
# Kernel path end to end: picchio reading the image from the raw namespace (tier S3/S4).
if [ -x /test/bin/picchio ]; then run_picchio picchio-raw-kernel "raw:$DEV1"
else skip picchio-raw-kernel "no picchio binary packed"; fi

# picchio nvme CLI: run it, show its output on the console, keep it in /tmp/cli.out.
# $1.. = picchio arguments. Returns picchio's exit status.
cli() {
  timeout "$TEST_TIMEOUT" /test/bin/picchio "$@" > /tmp/cli.out 2>&1
  crc=$?
  sed "s/^/picchio $1 $2: /" /tmp/cli.out
  return $crc
}
HAVE_CLI=0; [ -x /test/bin/picchio ] && HAVE_CLI=1

# 2b. picchio nvme list: the controller, on the kernel nvme driver, with its namespace(s).
if [ $HAVE_CLI = 1 ]; then
  if ! cli nvme list; then fail cli-nvme-list "picchio nvme list exited $crc"
  else
    row="$(grep "^$BDF " /tmp/cli.out)"
    want_ns="$(basename "$DEV1")"
    missing=""
    echo "$row" | grep -q "$want_ns" || missing="$want_ns"
    if [ "$NAMESPACES" -ge 2 ] && [ -n "$DEV2" ]; then
      echo "$row" | grep -q "$(basename "$DEV2")" || missing="$missing $(basename "$DEV2")"
    fi
    if [ -z "$row" ]; then fail cli-nvme-list "no row for $BDF"
    elif [ "$(echo "$row" | awk '{print $3}')" != nvme ]; then fail cli-nvme-list "driver column is '$(echo "$row" | awk '{print $3}')', want nvme"
    elif [ -n "$missing" ]; then fail cli-nvme-list "namespace(s) $missing not listed for $BDF"
    else pass cli-nvme-list "$BDF on nvme with $NAMESPACES namespace(s)"; fi
  fi
else skip cli-nvme-list "no picchio binary packed"; fi

# `picchio nvme $1 $BDF` as check cli-nvme-$1 (bind: to vfio-pci; unbind: back to the kernel),
# which passes when the device is then on driver $2. When the CLI fails or is not packed, the same
# by hand in sysfs, so the rest still runs: unbind from the current driver, driver_override = $3
# (empty: none), drivers_probe.
nvme_rebind() { # $1 = bind|unbind, $2 = the driver it must end on, $3 = the fallback's driver_override
  by_cli=0
  if [ $HAVE_CLI = 1 ]; then
    if cli nvme "$1" "$BDF"; then
      if [ "$(basename "$(readlink /sys/bus/pci/devices/"$BDF"/driver 2>/dev/null)" 2>/dev/null)" = "$2" ]; then
        by_cli=1; pass cli-nvme-"$1" "$(head -n 1 /tmp/cli.out)"
      else fail cli-nvme-"$1" "exit 0 but the device is not on $2"; fi
    else fail cli-nvme-"$1" "picchio nvme $1 exited $crc: $(tail -n 1 /tmp/cli.out)"; fi
  else skip cli-nvme-"$1" "no picchio binary packed"; fi
  if [ $by_cli = 0 ]; then
    echo "falling back to manual sysfs $1"
    [ -e /sys/bus/pci/devices/"$BDF"/driver ] && echo "$BDF" > /sys/bus/pci/devices/"$BDF"/driver/unbind
    echo "$3" > /sys/bus/pci/devices/"$BDF"/driver_override
    echo "$BDF" > /sys/bus/pci/drivers_probe
  fi
}

# 3. Hand the controller to vfio-pci: load the vfio modules, then `picchio nvme bind` (falls back to
# driver_override/unbind/drivers_probe by hand when the CLI fails, so the rest still runs).
if [ "$MODE" = noiommu ]; then load_mods /etc/vfio.modules vfio.ko=enable_unsafe_noiommu_mode=1
else load_mods /etc/vfio.modules; fi || { fail vfio-load "insmod failed"; exit 0; }
nvme_rebind bind vfio-pci vfio-pci
drv="$(basename "$(readlink /sys/bus/pci/devices/"$BDF"/driver 2>/dev/null)" 2>/dev/null)"
GROUP=""
[ -e /sys/bus/pci/devices/"$BDF"/iommu_group ] && GROUP="$(basename "$(readlink /sys/bus/pci/devices/"$BDF"/iommu_group)")"
if [ "$MODE" = noiommu ]; then GROUPDEV="/dev/vfio/noiommu-$GROUP"; else GROUPDEV="/dev/vfio/$GROUP"; fi
if [ "$drv" != vfio-pci ]; then fail vfio-bind "driver is '$drv', want vfio-pci"
elif [ -z "$GROUP" ]; then fail vfio-bind "device has no iommu_group"
elif [ ! -c "$GROUPDEV" ] || [ ! -c /dev/vfio/vfio ]; then fail vfio-bind "missing $GROUPDEV or /dev/vfio/vfio ($(ls /dev/vfio | tr '\n' ' '))"
else pass vfio-bind "$BDF on vfio-pci, group $GROUP, $GROUPDEV"; fi

# 4. Hugepages for DMA buffers.
echo "$HUGEPAGES" > /proc/sys/vm/nr_hugepages
mount -t hugetlbfs nodev /dev/hugepages
free_hp="$(awk '/HugePages_Free/ {print $2}' /proc/meminfo)"
if [ "$free_hp" -ge "$HUGEPAGES" ] 2>/dev/null && grep -q ' /dev/hugepages hugetlbfs' /proc/mounts; then
  pass hugepages "$free_hp x $(awk '/Hugepagesize/ {print $2 $3}' /proc/meminfo) free, hugetlbfs on /dev/hugepages"
else fail hugepages "HugePages_Free=$free_hp, want $HUGEPAGES"; fi

# 4b. picchio nvme identify: opens the controller through VFIO, prints Identify data and namespaces.
if [ $HAVE_CLI = 1 ]; then
  if ! cli nvme identify "$BDF"; then fail cli-nvme-identify "picchio nvme identify exited $crc: $(tail -n 1 /tmp/cli.out)"
  else
    sn="$(awk '$1 == "SN" {print $2}' /tmp/cli.out)"
    mn="$(awk '$1 == "MN" {$1 = ""; sub(/^ /, ""); print}' /tmp/cli.out)"
    nns="$(grep -c '^  namespace [0-9]*: LBA size ' /tmp/cli.out)"
    lba1="$(sed -n 's/^  namespace 1: LBA size \([0-9]*\) B.*/\1/p' /tmp/cli.out)"
    if [ -z "$sn" ] || [ -z "$mn" ]; then fail cli-nvme-identify "no SN/MN line"
    elif [ "$lba1" != "$LBA_SIZE" ]; then fail cli-nvme-identify "namespace 1 LBA size '$lba1', want $LBA_SIZE"
    elif [ "$nns" -ne "$NAMESPACES" ]; then fail cli-nvme-identify "$nns namespace line(s), want $NAMESPACES"
    else pass cli-nvme-identify "MN '$mn' SN $sn, $nns namespace(s), nsid 1 LBA $lba1 B"; fi
  fi
else skip cli-nvme-identify "no picchio binary packed"; fi
pack_nvme_ns2_checks

# 5. The driver's test binaries, against the real (emulated) controller. Contract: tests/vm/README.md.
export PICCHIO_NVME_BDF="$BDF" PICCHIO_NVME_VFIO_MODE="$MODE" PICCHIO_NVME_VFIO_GROUP="$GROUPDEV"
export PICCHIO_NVME_NSID=1 PICCHIO_NVME_IMAGE="$IMAGE" PICCHIO_NVME_LBA_SIZE="$LBA_SIZE"
export PICCHIO_NVME_NAMESPACES="$NAMESPACES" PICCHIO_NVME_SCRATCH_NSID="$SCRATCH_NSID"
export PICCHIO_NVME_SCRATCH_OFFSET="$SCRATCH_OFFSET" PICCHIO_HUGETLBFS=/dev/hugepages
export PICCHIO_FIXTURE_MODEL=/fixture RUST_BACKTRACE=1
ntests=0
run_tests() { # $1 = directory, $2 = check-name prefix, $3 = extra libtest arguments
  for t in "$1"/*; do
    [ -x "$t" ] || continue
    ntests=$((ntests + 1))
    name="$(basename "$t")"
    echo "PICCHIO-VM: RUN $2:$name"
    t0="$(up)"
    case "$(head -c 2 "$t")" in '#!') timeout "$TEST_TIMEOUT" "$t" 2>&1 ;; *) # shellcheck disable=SC2086
         timeout "$TEST_TIMEOUT" "$t" --test-threads=1 $3 2>&1 ;; esac
    rc=$?
    dt="$(awk -v a="$t0" -v b="$(up)" 'BEGIN{printf "%.1f", b-a}')"
    if [ $rc -eq 0 ]; then pass "$2:$name" "${dt} s"
    elif [ $rc -eq 143 ] || [ $rc -eq 124 ]; then fail "$2:$name" "timed out after $TEST_TIMEOUT s"
    else fail "$2:$name" "exit $rc (${dt} s)"; fi
  done
}
# The driver's lib tests include the NVMe/TCP replay harness (tcp::replay: a loopback target that
# plays recorded sessions back), which needs the loopback interface up.
ip link set lo up 2>/dev/null || fail loopback "ip link set lo up failed"
run_tests /test/probe probe ""
ntests=0
run_tests /test/tests test "$TEST_ARGS"
[ $ntests -eq 0 ] && skip nvme-tests "no picchio-nvme test binaries packed ($NVME_TESTS_NOTE)"

# 6. picchio reading experts through the user-space driver: any failure or token mismatch FAILS.
if [ -x /test/bin/picchio ]; then run_picchio picchio-nvme "nvme:$BDF" ""; check_zero_copy picchio-nvme-zero-copy
else skip picchio-nvme "no picchio binary packed"; fi
gpt_oss_nvme_checks
pack_nvme_ns1_checks
zero_copy_shortfall_check

# 6b. Driver resilience against the emulated controller (nvme_fault_probe, built with the crate's
# fault-injection feature): Abort + controller reset with reads before and after; in cases whose
# controller has a large MDTS (QEMU_MDTS, set by run.sh) one 4 MiB Read through a chained PRP list.
fault_probe() { # $1 = check name, $2.. = nvme_fault_probe arguments after the BDF
  name="$1"; shift
  timeout "$TEST_TIMEOUT" /test/bin/nvme_fault_probe "$BDF" "$@" > /tmp/probe.out 2> /tmp/probe.err
  prc=$?
  sed "s/^/$name: /" /tmp/probe.err
  if [ $prc -eq 0 ]; then pass "$name" "$(tail -n 1 /tmp/probe.out)"
  else fail "$name" "nvme_fault_probe $* exited $prc: $(tail -n 1 /tmp/probe.err)"; fi
}
resilience_checks() {
  if [ ! -x /test/bin/nvme_fault_probe ]; then fail vfio-reset "no nvme_fault_probe packed"; return; fi
  fault_probe vfio-reset reset 1
  if [ -n "$QEMU_MDTS" ]; then fault_probe vfio-chained-prp chained-prp 1; fi
}

# 6c. `picchio run --store nvme:` stopped by SIGINT mid-generation: exit status 130, the tokens so
# far in a --json result marked "interrupted": "SIGINT", and the driver logs that the controller
# shutdown completed (CC.SHN, CSTS.SHST = 2) before the process exits.
sigint_check() {
  if [ ! -x /test/bin/picchio ]; then fail picchio-nvme-sigint "no picchio binary packed"; return; fi
  rm -f /tmp/sig.out /tmp/sig.err
  NO_COLOR=1 /test/bin/picchio -v run --model /fixture --store "nvme:$BDF" --prompt-ids "$PROMPT_IDS" -n 480 \
    --json > /tmp/sig.out 2> /tmp/sig.err &
  spid=$!
  i=0 # wait (up to 60 s) until the store is open and generation starts
  while [ $i -lt 600 ] && ! grep -q 'experts from' /tmp/sig.err && kill -0 $spid 2>/dev/null; do
    sleep 0.1; i=$((i + 1))
  done
  sleep 0.3
  kill -INT $spid 2>/dev/null
  wait $spid
  src=$?
  sed 's/^/picchio-sigint: /' /tmp/sig.err | tail -n 8
  shut="$(grep -m1 'shutdown complete (CSTS.SHST=2)' /tmp/sig.err)"
  if [ $src -eq 0 ]; then fail picchio-nvme-sigint "the run finished before SIGINT arrived (no test of the signal)"
  elif [ $src -ne 130 ]; then fail picchio-nvme-sigint "exit status $src, want 130"
  elif ! grep -q 'interrupted by SIGINT' /tmp/sig.err; then fail picchio-nvme-sigint "no 'interrupted by SIGINT' error line"
  elif [ -z "$shut" ]; then fail picchio-nvme-sigint "no 'shutdown complete (CSTS.SHST=2)' log line"
  elif ! grep -q '"interrupted": *"SIGINT"' /tmp/sig.out; then
    fail picchio-nvme-sigint "the --json result does not say it was interrupted by SIGINT: $(head -c 300 /tmp/sig.out)"
  else pass picchio-nvme-sigint "exit 130; $(grep -m1 -o 'interrupted by SIGINT.*' /tmp/sig.err); ${shut#*INFO }"; fi
}

# 6d. Deliberate stray DMA (vIOMMU only): a Read whose PRP1 is an unmapped IOVA. The command must
# complete (not hang), the controller must keep working, and the IOMMU must log a DMAR fault for
# that address. The BEGIN/END markers bracket the only console window where run.sh accepts DMAR
# lines; it also requires the fault line inside it.
STRAY_IOVA=0x40000000
DMAR_BEFORE=0; DMAR_AFTER=0
stray_dma_check() {
  if [ "$MODE" != iommu ]; then return; fi
  if [ ! -x /test/bin/nvme_fault_probe ]; then fail stray-dma "no nvme_fault_probe packed"; return; fi
  DMAR_BEFORE="$(dmesg | grep -c 'DMAR:')"
  echo "PICCHIO-VM: BEGIN-EXPECTED-DMAR stray-dma $STRAY_IOVA"
  timeout "$TEST_TIMEOUT" /test/bin/nvme_fault_probe "$BDF" stray-dma "$STRAY_IOVA" > /tmp/stray.out 2> /tmp/stray.err
  xrc=$?
  i=0 # the fault is reported by the IOMMU's interrupt: wait for it in the kernel log (10 s)
  while [ $i -lt 100 ] && ! dmesg | grep 'DMAR:' | grep -q "fault addr $STRAY_IOVA"; do sleep 0.1; i=$((i + 1)); done
  sleep 1 # let the console catch up before closing the window
  echo "PICCHIO-VM: END-EXPECTED-DMAR stray-dma"
  DMAR_AFTER="$(dmesg | grep -c 'DMAR:')"
  sed 's/^/stray-dma: /' /tmp/stray.err
  line="$(dmesg | grep 'DMAR:' | grep -m1 "fault addr $STRAY_IOVA")"
  if [ $xrc -ne 0 ]; then fail stray-dma "nvme_fault_probe stray-dma exited $xrc: $(tail -n 1 /tmp/stray.err)"
  elif [ -z "$line" ]; then fail stray-dma "no DMAR fault for $STRAY_IOVA in the kernel log within 10 s"
  else pass stray-dma "$(tail -n 1 /tmp/stray.out); kernel: ${line#*DMAR: }"; fi
}

resilience_checks
sigint_check
stray_dma_check

# 7. Give the controller back to the kernel with `picchio nvme unbind` (manual sysfs fallback) and
# check the image is intact.
nvme_rebind unbind nvme ""
if DEV1="$(nsdev 1)"; then check_image kernel-rebind-image "$DEV1"
else fail kernel-rebind-image "namespace 1 did not come back under the kernel nvme driver"; fi

# 8. IOMMU faults (QEMU's nvme completes a blocked DMA with success, so the log is the only witness).
# The DMAR lines logged during the stray-DMA window (6d) are expected; any other fails.
faults="$(dmesg | grep 'DMAR:' | awk -v a="$DMAR_BEFORE" -v b="$DMAR_AFTER" 'NR <= a || NR > b' |
  grep -iE 'fault|DMA (Read|Write)|PTE')"
if [ -n "$faults" ]; then echo "$faults" | sed 's/^/guest-dmesg: /'; fail dmar-faults "IOMMU fault lines in dmesg"
else pass dmar-faults "none"; fi
