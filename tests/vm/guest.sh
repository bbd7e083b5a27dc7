#!/bin/sh
# Runs inside the QEMU guest (busybox sh), started by /init. tests/vm/run.sh packs it as /test/guest.sh
# together with /test/env, the test binaries (/test/bin, /test/tests) and the model fixture (/fixture).
# Every check prints exactly one marker line that run.sh counts:
#   PICCHIO-VM: PASS <check> [detail]   PICCHIO-VM: FAIL <check> <reason>   PICCHIO-VM: SKIP <check> <reason>
. /test/env
MAGIC=PCHIOFL1
IMAGE=/fixture/experts.picchioflat

pass() { echo "PICCHIO-VM: PASS $*"; }
fail() { echo "PICCHIO-VM: FAIL $*"; }
skip() { echo "PICCHIO-VM: SKIP $*"; }
up() { cut -d' ' -f1 /proc/uptime; }

load_mods() { # $1 = list file; extra args "module.ko=params"
  list="$1"; shift
  while read -r ko; do
    params=""
    for p in "$@"; do case "$p" in "$ko="*) params="${p#*=}" ;; esac; done
    # shellcheck disable=SC2086
    insmod "/lib/modules/$ko" $params 2>/tmp/insmod.err || {
      grep -q 'File exists' /tmp/insmod.err || { echo "insmod $ko failed: $(cat /tmp/insmod.err)"; return 1; }
    }
  done < "$list"
}

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

# Compares the first 4096 bytes of a device with the fixture image, and checks the magic.
check_image() { # $1 = check name, $2 = device
  rm -f /tmp/blk0
  dd if="$2" of=/tmp/blk0 bs=4096 count=1 iflag=direct 2>/dev/null
  m="$(head -c 8 /tmp/blk0 2>/dev/null)"
  head -c 4096 "$IMAGE" > /tmp/img0
  if [ "$m" != "$MAGIC" ]; then fail "$1" "magic at LBA 0 of $2 is '$m', want $MAGIC"
  elif ! cmp -s /tmp/blk0 /tmp/img0; then fail "$1" "first 4 KiB of $2 differ from $IMAGE"
  else pass "$1" "$2 starts with $MAGIC and equals the image's first 4 KiB"; fi
}

# picchio run, tokens compared with EXPECT_TOKENS. $1 = check name, $2 = store URI, $3 = stderr
# pattern that means "this build has no such store" (then SKIP instead of FAIL).
run_picchio() {
  t0="$(up)"
  timeout "$TEST_TIMEOUT" /test/bin/picchio run --model /fixture --store "$2" --prompt-ids "$PROMPT_IDS" \
    -n 16 --json > /tmp/picchio.json 2> /tmp/picchio.err
  rc=$?
  toks="$(tr -d ' \n\r\t' < /tmp/picchio.json | sed -n 's/.*"tokens":\[\([0-9,]*\)\].*/\1/p' | tr ',' ' ')"
  if [ $rc -ne 0 ] && [ -n "$3" ] && grep -q "$3" /tmp/picchio.err; then
    skip "$1" "$(grep -m1 "$3" /tmp/picchio.err)"
  elif [ $rc -ne 0 ]; then
    tail -n 20 /tmp/picchio.err
    fail "$1" "picchio run --store $2 exited $rc"
  elif [ "$toks" != "$EXPECT_TOKENS" ]; then
    tail -n 20 /tmp/picchio.err
    fail "$1" "tokens '$toks' != expected '$EXPECT_TOKENS'"
  else
    pass "$1" "16 tokens match (store $2, $(awk -v a="$t0" -v b="$(up)" 'BEGIN{printf "%.1f", b-a}') s)"
  fi
}

echo "PICCHIO-VM: CASE $CASE mode=$MODE namespaces=$NAMESPACES lba=$LBA_SIZE"

# 1. Find the NVMe function by class code (mass storage / NVM / NVMe).
BDF=""
for d in /sys/bus/pci/devices/*; do
  [ "$(cat "$d/class")" = "0x010802" ] && { BDF="$(basename "$d")"; break; }
done
if [ -z "$BDF" ]; then fail find-nvme "no PCI function with class 0x010802"; exit 0; fi
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

# 3. Hand the controller to vfio-pci: load the vfio modules, then `picchio nvme bind` (falls back to
# driver_override/unbind/drivers_probe by hand when the CLI fails, so the rest still runs).
if [ "$MODE" = noiommu ]; then load_mods /etc/vfio.modules vfio.ko=enable_unsafe_noiommu_mode=1
else load_mods /etc/vfio.modules; fi || { fail vfio-load "insmod failed"; exit 0; }
bound_by_cli=0
if [ $HAVE_CLI = 1 ]; then
  if cli nvme bind "$BDF"; then
    if [ "$(basename "$(readlink /sys/bus/pci/devices/"$BDF"/driver 2>/dev/null)" 2>/dev/null)" = vfio-pci ]; then
      bound_by_cli=1; pass cli-nvme-bind "$(head -n 1 /tmp/cli.out)"
    else fail cli-nvme-bind "exit 0 but the device is not on vfio-pci"; fi
  else fail cli-nvme-bind "picchio nvme bind exited $crc: $(tail -n 1 /tmp/cli.out)"; fi
else skip cli-nvme-bind "no picchio binary packed"; fi
if [ $bound_by_cli = 0 ]; then
  echo "falling back to manual sysfs bind"
  [ -e /sys/bus/pci/devices/"$BDF"/driver ] && echo "$BDF" > /sys/bus/pci/devices/"$BDF"/driver/unbind
  echo vfio-pci > /sys/bus/pci/devices/"$BDF"/driver_override
  echo "$BDF" > /sys/bus/pci/drivers_probe
fi
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
run_tests /test/probe probe ""
ntests=0
run_tests /test/tests test "$TEST_ARGS"
[ $ntests -eq 0 ] && skip nvme-tests "no picchio-nvme test binaries packed ($NVME_TESTS_NOTE)"

# 6. picchio reading experts through the user-space driver: any failure or token mismatch FAILS.
if [ -x /test/bin/picchio ]; then run_picchio picchio-nvme "nvme:$BDF" ""
else skip picchio-nvme "no picchio binary packed"; fi

# 7. Give the controller back to the kernel with `picchio nvme unbind` (manual sysfs fallback) and
# check the image is intact.
unbound_by_cli=0
if [ $HAVE_CLI = 1 ]; then
  if cli nvme unbind "$BDF"; then
    if [ "$(basename "$(readlink /sys/bus/pci/devices/"$BDF"/driver 2>/dev/null)" 2>/dev/null)" = nvme ]; then
      unbound_by_cli=1; pass cli-nvme-unbind "$(head -n 1 /tmp/cli.out)"
    else fail cli-nvme-unbind "exit 0 but the device is not on nvme"; fi
  else fail cli-nvme-unbind "picchio nvme unbind exited $crc: $(tail -n 1 /tmp/cli.out)"; fi
else skip cli-nvme-unbind "no picchio binary packed"; fi
if [ $unbound_by_cli = 0 ]; then
  echo "falling back to manual sysfs rebind"
  [ -e /sys/bus/pci/devices/"$BDF"/driver ] && echo "$BDF" > /sys/bus/pci/devices/"$BDF"/driver/unbind
  echo > /sys/bus/pci/devices/"$BDF"/driver_override
  echo "$BDF" > /sys/bus/pci/drivers_probe
fi
if DEV1="$(nsdev 1)"; then check_image kernel-rebind-image "$DEV1"
else fail kernel-rebind-image "namespace 1 did not come back under the kernel nvme driver"; fi

# 8. IOMMU faults (QEMU's nvme completes a blocked DMA with success, so the log is the only witness).
faults="$(dmesg | grep 'DMAR:' | grep -iE 'fault|DMA (Read|Write)|PTE' )"
if [ -n "$faults" ]; then echo "$faults" | sed 's/^/guest-dmesg: /'; fail dmar-faults "IOMMU fault lines in dmesg"
else pass dmar-faults "none"; fi
