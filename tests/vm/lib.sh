# shellcheck shell=sh
# Helpers shared by the guest scripts (busybox sh inside the QEMU guest): guest.sh (the VFIO cases and,
# through it, guest-dm.sh) and guest-tcp.sh (the NVMe/TCP case) source this file as /test/lib.sh,
# which run.sh stages into every case's cpio. It defines functions only and needs /test/env sourced
# first (TEST_TIMEOUT, PROMPT_IDS, EXPECT_TOKENS). Every check prints exactly one marker line that
# run.sh counts:
#   PICCHIO-VM: PASS <check> [detail]   PICCHIO-VM: FAIL <check> <reason>   PICCHIO-VM: SKIP <check> <reason>
MAGIC=PCHIOFL1
FIXTURE_DIR=/fixture
IMAGE=$FIXTURE_DIR/experts.picchioflat
PICCHIO=/test/bin/picchio

pass() { echo "PICCHIO-VM: PASS $*"; }
fail() { echo "PICCHIO-VM: FAIL $*"; }
skip() { echo "PICCHIO-VM: SKIP $*"; }
# Guest uptime in seconds, and the seconds since an earlier `up` ($1), one decimal.
up() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="$1" -v b="$(up)" 'BEGIN{printf "%.1f", b-a}'; }

# insmod every module of the list file $1 (one path under /lib/modules a line, in load order); a
# module already loaded is fine. Extra args "module.ko=params" give a module its parameters.
load_mods() {
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

# The PCI address of the first NVMe function (class 0x010802: mass storage / NVM / NVMe), or status 1.
nvme_bdf() {
  for d in /sys/bus/pci/devices/*; do
    [ "$(cat "$d/class")" = "0x010802" ] && { basename "$d"; return 0; }
  done
  return 1
}

# Compares the first 4096 bytes of a device with the fixture image, and checks the magic.
check_image() { # $1 = check name, $2 = device
  rm -f /tmp/blk0
  dd if="$2" of=/tmp/blk0 bs=4096 count=1 iflag=direct 2>/dev/null
  m="$(head -c 8 /tmp/blk0 2>/dev/null)"
  head -c 4096 "$IMAGE" > /tmp/img0
  # `picchio pack` writes a model record into the superblock's reserved bytes 96..4096 (docs/format.md):
  # then the 96 bytes of fields equal the image's, the record magic is at 96 and the path at 144.
  head -c 96 /tmp/blk0 > /tmp/blk0.fields; head -c 96 /tmp/img0 > /tmp/img0.fields
  rec="$(dd if=/tmp/blk0 bs=1 skip=96 count=8 2>/dev/null)"
  # The path and the zero after it (a longer recorded path is another directory).
  printf '%s\0' "$FIXTURE_DIR" > /tmp/want.dir
  dd if=/tmp/blk0 of=/tmp/got.dir bs=1 skip=144 count=$((${#FIXTURE_DIR} + 1)) 2>/dev/null
  if [ "$m" != "$MAGIC" ]; then fail "$1" "magic at LBA 0 of $2 is '$m', want $MAGIC"
  elif cmp -s /tmp/blk0 /tmp/img0; then pass "$1" "$2 starts with $MAGIC and equals the image's first 4 KiB"
  elif cmp -s /tmp/blk0.fields /tmp/img0.fields && [ "$rec" = PCHMODEL ] && cmp -s /tmp/want.dir /tmp/got.dir; then
    pass "$1" "$2 starts with $MAGIC, the image's superblock fields and picchio pack's model record naming $FIXTURE_DIR"
  else fail "$1" "first 4 KiB of $2 differ from $IMAGE (and are not its superblock with a model record naming $FIXTURE_DIR)"; fi
}

# picchio run, tokens compared. $1 = check name, $2 = store URI, $3 = stderr pattern that means "this
# build has no such store" (then SKIP instead of FAIL; "" for none); optional $4 = model directory
# (default /fixture), $5 = prompt ids (default PROMPT_IDS), $6 = tokens (default EXPECT_TOKENS).
# Output: /tmp/picchio.json, /tmp/picchio.err.
run_picchio() {
  t0="$(up)"
  want="${6:-$EXPECT_TOKENS}"
  timeout "$TEST_TIMEOUT" $PICCHIO run --model "${4:-/fixture}" --store "$2" --prompt-ids "${5:-$PROMPT_IDS}" \
    -n 16 --json > /tmp/picchio.json 2> /tmp/picchio.err
  rc=$?
  toks="$(tr -d ' \n\r\t' < /tmp/picchio.json | sed -n 's/.*"tokens":\[\([0-9,]*\)\].*/\1/p' | tr ',' ' ')"
  if [ $rc -ne 0 ] && [ -n "$3" ] && grep -q "$3" /tmp/picchio.err; then
    skip "$1" "$(grep -m1 "$3" /tmp/picchio.err)"
  elif [ $rc -ne 0 ]; then
    tail -n 20 /tmp/picchio.err
    fail "$1" "picchio run --store $2 exited $rc: $(tail -n 1 /tmp/picchio.err)"
  elif [ "$toks" != "$want" ]; then
    tail -n 20 /tmp/picchio.err
    fail "$1" "tokens '$toks' != expected '$want'"
  else
    pass "$1" "16 tokens match (store $2, $(since "$t0") s)"
  fi
}

# Value of "key":NUMBER in the one-line JSON of the last `picchio run --json` (/tmp/picchio.json).
json_num() { sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p" /tmp/picchio.json; }

# picchio pack $2 with the arguments after (e.g. --out URI --force) must exit 0 and report the
# read-back ('payload hashes OK'). $1 = check name. Output in /tmp/pack.out; status 1 when it failed.
pack_ok() {
  name="$1"; model="$2"; shift 2
  timeout "$TEST_TIMEOUT" $PICCHIO pack "$model" --no-progress "$@" > /tmp/pack.out 2>&1
  prc=$?
  sed "s/^/picchio pack: /" /tmp/pack.out
  if [ $prc -ne 0 ]; then fail "$name" "picchio pack $model $* exited $prc: $(tail -n 1 /tmp/pack.out)"; return 1
  elif ! grep -q 'payload hashes OK' /tmp/pack.out; then fail "$name" "no 'payload hashes OK' in the output"; return 1
  else pass "$name" "$(grep -m1 'payload hashes OK' /tmp/pack.out | cut -c1-160)"; fi
}

# picchio verify $3 --model $2 must exit 0 and print OK and "$4" (e.g. the entry count). $1 = check name.
verify_ok() {
  timeout "$TEST_TIMEOUT" $PICCHIO verify "$3" --no-progress --model "$2" > /tmp/verify.out 2>&1
  vrc=$?
  sed "s/^/picchio verify: /" /tmp/verify.out
  if [ $vrc -ne 0 ]; then fail "$1" "picchio verify $3 exited $vrc: $(tail -n 1 /tmp/verify.out)"
  elif ! grep -q "$4" /tmp/verify.out || ! grep -q '^OK' /tmp/verify.out; then fail "$1" "no '$4' / OK in the report"
  else pass "$1" "$(head -n 1 /tmp/verify.out | cut -c1-160)"; fi
}
