#!/bin/sh
# Device-mapper fault cases: run.sh's case `dm`. Sourced by /test/guest.sh after its helpers (nsdev,
# and /test/lib.sh's pass, fail, skip, up, load_mods, json_num) when /etc/vm-mode is `dm` (the initramfs setup.sh builds
# with dm-mod, dm-flakey, dm-delay and Debian's dmsetup). Every check prints one PICCHIO-VM marker.
#
# The disk is QEMU's NVMe controller on the kernel nvme driver: Picchio (C)'s Qwen3 image at byte 0 of
# namespace 1 (written by run.sh), the GPT-OSS image packed here at GPT_BASE, a scratch region at
# SCRATCH_BASE for the pack cases. Every dm table maps a window of that namespace; the faults are the
# kernel's own targets:
#   linear            control: same tokens, no fallback, verify OK
#   error (middle)    the middle third of the payloads fails with EIO: same tokens, the failed experts
#                     served from safetensors and counted; verify names exactly those (layer, expert)
#   error (header)    the superblock fails: run and verify stop with an error naming device and superblock
#   flakey            payloads up 1 s / down 1 s: same tokens in every run, each error a counted fallback
#   flakey, corrupt   reads in a down interval return a changed byte (corrupt_bio_byte), no error:
#                     under --verify the same tokens, each corrupted payload a hash mismatch fallback
#   delay             every read held 100 ms: same tokens, no fallback, the delay in the read latency;
#                     verify OK
#   pack, head error  the signature scan cannot read the first 256 KiB: pack stops before writing
#   pack onto error   `pack --out raw:` stops with an error naming the device and offset, no success line
#   pack onto flakey  drop_writes (writes vanish) and error_writes: the read-back or the write fails
SECT=512
GPT_BASE=$((64 << 20))
SCRATCH_BASE=$((128 << 20))
DELAY_MS=100

dms() { DM_DISABLE_UDEV=1 dmsetup "$@"; }

# dm_create NAME LINE...: /dev/mapper/NAME from the table lines (start length target args).
dm_create() {
  n="$1"; shift
  printf '%s\n' "$@" > /tmp/dm.table
  if ! dms create "$n" /tmp/dm.table > /tmp/dm.err 2>&1; then
    sed "s/^/dmsetup create $n: /" /tmp/dm.err; sed "s/^/  table: /" /tmp/dm.table; return 1
  fi
  [ -b "/dev/mapper/$n" ] || { echo "dmsetup create $n: no /dev/mapper/$n"; return 1; }
}
dm_remove() { dms remove --retry "$1" > /dev/null 2>&1 || dms remove "$1"; }

# Header of the image at byte $2 of device $1 (first 64 KiB, O_DIRECT) into /tmp/hdr; the superblock
# fields the cases need (docs/format.md): N_ENTRIES, N_EXPERTS, INDEX_OFF, DATA_OFF.
read_header() {
  dd if="$1" of=/tmp/hdr bs=4096 skip=$(($2 / 4096)) count=16 iflag=direct 2> /dev/null
  u32() { od -An -t u4 -j "$1" -N 4 /tmp/hdr | tr -d ' '; }
  N_EXPERTS="$(u32 24)"; N_ENTRIES="$(u32 36)"; INDEX_OFF="$(u32 40)"; DATA_OFF="$(u32 56)"
  [ "$(head -c 8 /tmp/hdr)" = PCHIOFL1 ] && [ "$N_ENTRIES" -gt 0 ] 2> /dev/null
}

# "(layer L, expert E)" of every index entry (in /tmp/hdr) whose payload [offset, offset + padded_len)
# meets the image bytes [$1, $2), one per line, in index order.
keys_in() {
  od -An -v -t u4 -j "$INDEX_OFF" -N $((N_ENTRIES * 24)) /tmp/hdr | tr -s ' \n' '\n\n' | grep -v '^$' |
    awk -v a="$1" -v b="$2" -v nx="$N_EXPERTS" '{w[NR % 6] = $1}
      NR % 6 == 0 {i = NR / 6 - 1; off = w[1] + w[2] * 4294967296; pl = w[4]
                   if (off < b && off + pl > a) printf "(layer %d, expert %d)\n", int(i / nx), i % nx}'
}

# picchio run of model $3 with prompt $4 on store $2; tokens must be $5. $1 = check name, then picchio
# run options. RUN_OK=1 when it exited 0 with the tokens (/tmp/picchio.json, /tmp/picchio.err kept);
# otherwise the check FAILs here.
dm_run() {
  name="$1" store="$2" model="$3" prompt="$4" want="$5"; shift 5
  t0="$(up)"
  timeout "$TEST_TIMEOUT" /test/bin/picchio run --model "$model" --store "$store" --prompt-ids "$prompt" \
    -n 16 --json "$@" > /tmp/picchio.json 2> /tmp/picchio.err
  rc=$?
  RUN_S="$(awk -v a="$t0" -v b="$(up)" 'BEGIN{printf "%.1f", b-a}')"
  toks="$(tr -d ' \n\r\t' < /tmp/picchio.json | sed -n 's/.*"tokens":\[\([0-9,]*\)\].*/\1/p' | tr ',' ' ')"
  RUN_OK=0
  if [ $rc -ne 0 ]; then tail -n 8 /tmp/picchio.err; fail "$name" "picchio run --store $store $* exited $rc: $(tail -n 1 /tmp/picchio.err)"
  elif [ "$toks" != "$want" ]; then tail -n 8 /tmp/picchio.err; fail "$name" "tokens '$toks' != the file tier's '$want' (store $store $*)"
  else RUN_OK=1; fi
}

# The fallback summary line picchio logs at exit (empty when nothing fell back).
fallback_line() { grep -m1 -o '[0-9]* expert loads ([0-9]* distinct experts) were served by the fallback.*' /tmp/picchio.err; }

# picchio verify of $2 with --model $3 into /tmp/verify.out; VRC = its exit status.
dm_verify() {
  timeout "$TEST_TIMEOUT" /test/bin/picchio verify "$2" --no-progress --model "$3" > /tmp/verify.out 2>&1
  VRC=$?
  sed "s/^/picchio verify $1: /" /tmp/verify.out | head -n 40
}

# ---- cases -----------------------------------------------------------------------------------------

# Control: the image through dm-linear. $1 = tag, $2 = image byte offset on DEV1, $3 = model, $4 = prompt,
# $5 = tokens, $6 = image sectors.
case_linear() {
  dm_create "lin-$1" "0 $6 linear $DEV1 $(($2 / SECT))" || { fail "dm-linear-$1" "dmsetup create failed"; return; }
  dm_run "dm-linear-$1" "raw:/dev/mapper/lin-$1" "$3" "$4" "$5"
  if [ $RUN_OK = 1 ]; then
    fb="$(json_num fallbacks)"; reads="$(json_num reads)"
    if [ "$fb" != 0 ] || [ "$(json_num store_errors)" != 0 ]; then fail "dm-linear-$1" "$fb fallbacks on a healthy linear map"
    elif [ -z "$reads" ] || [ "$reads" -eq 0 ]; then fail "dm-linear-$1" "no expert read from the store"
    else pass "dm-linear-$1" "tokens match, $reads reads, 0 fallbacks ($RUN_S s)"; fi
  fi
  LIN_LAT="$(json_num read_latency_mean_ms)"
  dm_verify "lin-$1" "raw:/dev/mapper/lin-$1" "$3"
  if [ $VRC -eq 0 ] && grep -q '^OK' /tmp/verify.out; then pass "dm-linear-$1-verify" "$(head -n 1 /tmp/verify.out | cut -c1-140)"
  else fail "dm-linear-$1-verify" "picchio verify exited $VRC: $(tail -n 1 /tmp/verify.out)"; fi
  dm_remove "lin-$1"
}

# The middle third of the payloads remapped to `error`. Arguments as case_linear.
case_error() {
  tag="$1" base="$2" model="$3" prompt="$4" want="$5" sectors="$6"
  read_header "$DEV1" "$base" || { fail "dm-error-$tag" "no image header at byte $base of $DEV1"; return; }
  img=$((sectors * SECT)); span=$((img - DATA_OFF))
  a=$((DATA_OFF + span / 3 / 4096 * 4096)); b=$((DATA_OFF + 2 * span / 3 / 4096 * 4096))
  keys_in "$a" "$b" > /tmp/want.keys
  nk="$(wc -l < /tmp/want.keys)"
  n="err-$tag"
  dm_create "$n" "0 $((a / SECT)) linear $DEV1 $((base / SECT))" "$((a / SECT)) $(((b - a) / SECT)) error" \
    "$((b / SECT)) $(((img - b) / SECT)) linear $DEV1 $(((base + b) / SECT))" ||
    { fail "dm-error-$tag" "dmsetup create failed"; return; }
  echo "dm-error-$tag: image bytes [$a, $b) of /dev/mapper/$n fail with EIO: $nk experts ($(head -n 1 /tmp/want.keys) ...)"
  for io in uring psync; do
    dm_run "dm-error-$tag-$io" "raw:/dev/mapper/$n" "$model" "$prompt" "$want" --io "$io"
    [ $RUN_OK = 1 ] || continue
    fb="$(json_num fallbacks)"; se="$(json_num store_errors)"
    if [ -z "$fb" ] || [ "$fb" -eq 0 ]; then fail "dm-error-$tag-$io" "no fallback although $nk experts are unreadable"
    elif [ "$fb" != "$se" ]; then fail "dm-error-$tag-$io" "fallbacks $fb != store_errors $se"
    elif ! grep -q "/dev/mapper/$n.*os error 5\|/dev/mapper/$n.*Input/output error" /tmp/picchio.err; then
      fail "dm-error-$tag-$io" "no warning naming /dev/mapper/$n and EIO on stderr"
    else pass "dm-error-$tag-$io" "tokens match; $fb fallbacks = $se store errors; $(fallback_line | cut -c1-120) ($RUN_S s)"; fi
  done
  dm_verify "$n" "raw:/dev/mapper/$n" "$model"
  grep -o '^  (layer [0-9]*, expert [0-9]*): reading the payload' /tmp/verify.out | sed 's/^  //; s/: reading the payload$//' > /tmp/got.keys
  if [ $VRC -eq 0 ]; then fail "dm-error-$tag-verify" "picchio verify exited 0 on an image with $nk unreadable experts"
  elif [ "$nk" -eq 0 ]; then fail "dm-error-$tag-verify" "the error region [$a, $b) holds no payload (harness bug)"
  elif ! cmp -s /tmp/want.keys /tmp/got.keys; then
    fail "dm-error-$tag-verify" "named $(wc -l < /tmp/got.keys) failing experts, want the $nk in [$a, $b): $(diff /tmp/want.keys /tmp/got.keys | grep '^[-+](' | head -n 4 | tr '\n' ' ')"
  elif [ "$(grep -c '^  (layer' /tmp/verify.out)" != "$nk" ]; then fail "dm-error-$tag-verify" "other failures besides the read errors"
  else pass "dm-error-$tag-verify" "exit $VRC, names exactly the $nk experts in the error region: $(head -n 1 /tmp/got.keys) .. $(tail -n 1 /tmp/got.keys)"; fi
  dm_remove "$n"
}

# The superblock's block remapped to `error`: run and verify stop with an error that names the device.
case_error_header() {
  n=err-sb
  dm_create "$n" "0 8 error" "8 $(($1 - 8)) linear $DEV1 8" || { fail dm-error-superblock "dmsetup create failed"; return; }
  timeout "$TEST_TIMEOUT" /test/bin/picchio run --model /fixture --store "raw:/dev/mapper/$n" --prompt-ids "$PROMPT_IDS" \
    -n 4 --json > /tmp/picchio.json 2> /tmp/picchio.err
  rc=$?
  tail -n 3 /tmp/picchio.err | sed 's/^/picchio run err-sb: /'
  if [ $rc -eq 0 ]; then fail dm-error-superblock "picchio run exited 0 with an unreadable superblock"
  elif ! grep -q "/dev/mapper/$n.*superblock" /tmp/picchio.err; then fail dm-error-superblock "the error does not name /dev/mapper/$n and the superblock"
  else pass dm-error-superblock "exit $rc: $(grep -m1 "/dev/mapper/$n" /tmp/picchio.err | cut -c1-160)"; fi
  dm_verify "$n" "raw:/dev/mapper/$n" /fixture
  if [ $VRC -eq 0 ]; then fail dm-error-superblock-verify "picchio verify exited 0"
  elif ! grep -q "/dev/mapper/$n.*superblock" /tmp/verify.out; then fail dm-error-superblock-verify "the error does not name the device and the superblock"
  else pass dm-error-superblock-verify "exit $VRC: $(grep -m1 "/dev/mapper/$n" /tmp/verify.out | cut -c1-160)"; fi
  dm_remove "$n"
}

# Payloads on `flakey` (up 1 s, down 1 s; reads in a down interval fail with EIO), the superblock and
# index linear. Up to 8 runs at --ecap 4 (so experts are re-read all along the run): every run gives the
# tokens and counts each error as one fallback; at least one run must have met a down interval.
case_flakey() {
  tag="$1" base="$2" model="$3" prompt="$4" want="$5" sectors="$6"
  read_header "$DEV1" "$base" || { fail "dm-flakey-$tag" "no image header at byte $base of $DEV1"; return; }
  d=$((DATA_OFF / SECT)); n="flk-$tag"
  dm_create "$n" "0 $d linear $DEV1 $((base / SECT))" "$d $((sectors - d)) flakey $DEV1 $((base / SECT + d)) 1 1" ||
    { fail "dm-flakey-$tag" "dmsetup create failed"; return; }
  runs=0; hit=0; bad=""; tot_fb=0
  while [ $runs -lt 8 ] && [ $hit -lt 1 ] && [ -z "$bad" ]; do
    runs=$((runs + 1))
    dm_run "dm-flakey-$tag" "raw:/dev/mapper/$n" "$model" "$prompt" "$want" --ecap 4
    [ $RUN_OK = 1 ] || { bad=1; break; }
    fb="$(json_num fallbacks)"; se="$(json_num store_errors)"
    echo "dm-flakey-$tag run $runs: $fb fallbacks, $se store errors, $(json_num reads) reads ($RUN_S s)"
    if [ "$fb" != "$se" ]; then bad="run $runs: fallbacks $fb != store_errors $se"; fi
    [ "$fb" -gt 0 ] 2> /dev/null && { hit=$((hit + 1)); tot_fb=$((tot_fb + fb)); }
  done
  if [ "$bad" = 1 ]; then :
  elif [ -n "$bad" ]; then fail "dm-flakey-$tag" "$bad"
  elif [ $hit -eq 0 ]; then fail "dm-flakey-$tag" "$runs runs never read during a down interval"
  else pass "dm-flakey-$tag" "$runs run(s), tokens match in each; $tot_fb fallbacks = store errors; $(fallback_line | cut -c1-100)"; fi
  dm_remove "$n"
}

# Payloads on `flakey` with `corrupt_bio_byte 32 r 1 0` (up 1 s, down 1 s): a read in a down interval
# completes without error but with the 32nd byte of its data set to 1, silent corruption only a hash
# can see. Up to 8 runs with --verify at --ecap 4: every run gives the tokens, each corrupted payload
# fails its SHA-256 and is served by the fallback (fallbacks = store_errors); at least one run must
# have met a down interval and named a hash mismatch.
case_flakey_corrupt() {
  tag="$1" base="$2" model="$3" prompt="$4" want="$5" sectors="$6"
  read_header "$DEV1" "$base" || { fail "dm-flakey-corrupt-$tag" "no image header at byte $base of $DEV1"; return; }
  d=$((DATA_OFF / SECT)); n="flc-$tag"
  dm_create "$n" "0 $d linear $DEV1 $((base / SECT))" \
    "$d $((sectors - d)) flakey $DEV1 $((base / SECT + d)) 1 1 5 corrupt_bio_byte 32 r 1 0" ||
    { fail "dm-flakey-corrupt-$tag" "dmsetup create failed"; return; }
  runs=0; hit=0; bad=""; tot_fb=0; line=""
  while [ $runs -lt 8 ] && [ $hit -lt 1 ] && [ -z "$bad" ]; do
    runs=$((runs + 1))
    dm_run "dm-flakey-corrupt-$tag" "raw:/dev/mapper/$n" "$model" "$prompt" "$want" --ecap 4 --verify
    [ $RUN_OK = 1 ] || { bad=1; break; }
    fb="$(json_num fallbacks)"; se="$(json_num store_errors)"
    echo "dm-flakey-corrupt-$tag run $runs: $fb fallbacks, $se store errors, $(json_num reads) reads ($RUN_S s)"
    if [ "$fb" != "$se" ]; then bad="run $runs: fallbacks $fb != store_errors $se"; fi
    if [ "$fb" -gt 0 ] 2> /dev/null; then
      tot_fb=$((tot_fb + fb)); line="$(fallback_line)"
      case "$line" in
        *"hash mismatch"*) hit=$((hit + 1)) ;;
        *) bad="run $runs: $fb fallbacks but none for a hash mismatch: $line" ;;
      esac
    fi
  done
  if [ "$bad" = 1 ]; then :
  elif [ -n "$bad" ]; then fail "dm-flakey-corrupt-$tag" "$bad"
  elif [ $hit -eq 0 ]; then fail "dm-flakey-corrupt-$tag" "$runs runs never read during a down interval"
  else pass "dm-flakey-corrupt-$tag" "$runs run(s) with --verify, tokens match in each; $tot_fb fallbacks = store errors; $(echo "$line" | cut -c1-100)"; fi
  dm_remove "$n"
}

# Every read held DELAY_MS by `delay`: same tokens, no fallback, and the delay shows in the mean read
# latency (dm-delay holds each bio at least DELAY_MS less one jiffy: a lower bound, not a timing race).
case_delay() {
  n="dly-$1"
  dm_create "$n" "0 $6 delay $DEV1 $(($2 / SECT)) $DELAY_MS" || { fail "dm-delay-$1" "dmsetup create failed"; return; }
  dm_run "dm-delay-$1" "raw:/dev/mapper/$n" "$3" "$4" "$5"
  if [ $RUN_OK = 1 ]; then
    fb="$(json_num fallbacks)"; reads="$(json_num reads)"; lat="$(json_num read_latency_mean_ms)"; wait="$(json_num read_wait_ms)"
    if [ "$fb" != 0 ] || [ "$(json_num store_errors)" != 0 ]; then fail "dm-delay-$1" "$fb fallbacks on a slow but healthy device"
    elif [ -z "$reads" ] || [ "$reads" -eq 0 ]; then fail "dm-delay-$1" "no expert read from the store"
    elif [ -z "$lat" ] || [ "$lat" -lt $((DELAY_MS / 2)) ]; then fail "dm-delay-$1" "read_latency_mean_ms '$lat' < $((DELAY_MS / 2)) with $DELAY_MS ms reads"
    elif [ "$wait" -lt "$DELAY_MS" ]; then fail "dm-delay-$1" "read_wait_ms $wait < one delay of $DELAY_MS ms"
    else pass "dm-delay-$1" "tokens match, 0 fallbacks; $reads reads, mean latency $lat ms (linear: ${LIN_LAT:-?} ms), read_wait_ms $wait ($RUN_S s)"; fi
  fi
  dm_verify "$n" "raw:/dev/mapper/$n" "$3"
  if [ $VRC -eq 0 ] && grep -q '^OK' /tmp/verify.out; then pass "dm-delay-$1-verify" "$(head -n 1 /tmp/verify.out | cut -c1-140)"
  else fail "dm-delay-$1-verify" "picchio verify exited $VRC: $(tail -n 1 /tmp/verify.out)"; fi
  dm_remove "$n"
}

# `pack --out raw:` onto a device that fails: exit non-zero, an error naming the device, never the
# success line; and what is left there is not taken for an image. $1 = check, $2 = expected error text
# (grep -i pattern), then the table lines.
case_pack_fails() {
  name="$1" pat="$2"; shift 2
  n=pk
  dm_create "$n" "$@" || { fail "$name" "dmsetup create failed"; return; }
  timeout "$TEST_TIMEOUT" /test/bin/picchio pack /fixture --no-progress --out "raw:/dev/mapper/$n" --force > /tmp/pack.out 2>&1
  prc=$?
  sed "s/^/picchio pack $name: /" /tmp/pack.out | tail -n 6
  if [ $prc -eq 0 ]; then fail "$name" "picchio pack exited 0 onto a failing device"
  elif grep -q 'payload hashes OK\|^packed ' /tmp/pack.out; then fail "$name" "a success line although pack failed"
  elif ! grep -q "/dev/mapper/$n" /tmp/pack.out || ! grep -qi "$pat" /tmp/pack.out; then fail "$name" "the error does not name /dev/mapper/$n and '$pat': $(tail -n 1 /tmp/pack.out)"
  else
    dm_verify "$name" "raw:/dev/mapper/$n" /fixture
    if [ $VRC -eq 0 ]; then fail "$name" "the failed pack left an image that verifies"
    else pass "$name" "exit $prc: $(grep -m1 -i "$pat" /tmp/pack.out | cut -c1-170); verify then exits $VRC"; fi
  fi
  dm_remove "$n"
}

# ---- main ------------------------------------------------------------------------------------------
echo "PICCHIO-VM: CASE $CASE mode=$MODE (device-mapper faults)"
BDF=""
for d in /sys/bus/pci/devices/*; do
  [ "$(cat "$d/class")" = "0x010802" ] && { BDF="$(basename "$d")"; break; }
done
[ -n "$BDF" ] || { fail dm-setup "no NVMe function"; return 0; }
load_mods /etc/nvme.modules || { fail dm-setup "insmod nvme failed"; return 0; }
DEV1="$(nsdev 1)" || { fail dm-setup "no block device for namespace 1"; return 0; }
load_mods /etc/dm.modules || { fail dm-setup "insmod of the device-mapper modules failed"; return 0; }
targets="$(dms targets 2>&1)"
missing=""
for t in linear error flakey delay; do echo "$targets" | grep -q "^$t " || missing="$missing $t"; done
if [ -n "$missing" ]; then echo "$targets"; fail dm-targets "missing target(s):$missing"; return 0; fi
pass dm-targets "$(dms version 2> /dev/null | grep -i driver | tr -s ' ' | cut -c1-60); targets: $(echo "$targets" | awk '{printf "%s ", $1}')"

QWEN_SECT=$((($(stat -c %s "$IMAGE") + 4095) / 4096 * 8))
# GPT-OSS: packed onto the namespace at GPT_BASE (nothing maps the namespace yet, so no holder).
GPT_SECT=""
if [ -f /fixture-gpt-oss/config.json ]; then
  timeout "$TEST_TIMEOUT" /test/bin/picchio pack /fixture-gpt-oss --no-progress --out "raw:$DEV1@$GPT_BASE" --force \
    > /tmp/pack.out 2>&1
  prc=$?
  if [ $prc -eq 0 ] && grep -q 'payload hashes OK' /tmp/pack.out && read_header "$DEV1" "$GPT_BASE"; then
    last="$(od -An -v -t u4 -j $((INDEX_OFF + 24 * (N_ENTRIES - 1))) -N 16 /tmp/hdr | awk '{print $1 + $4}')"
    GPT_SECT=$(((last + 4095) / 4096 * 8))
    pass dm-gpt-oss-pack "$N_ENTRIES entries at byte $GPT_BASE of $DEV1, $((GPT_SECT * SECT)) bytes"
  else sed 's/^/picchio pack gpt-oss: /' /tmp/pack.out | tail -n 5; fail dm-gpt-oss-pack "picchio pack exited $prc"; fi
else fail dm-gpt-oss-pack "no /fixture-gpt-oss (the host's convert failed)"; fi

case_linear qwen3 0 /fixture "$PROMPT_IDS" "$EXPECT_TOKENS" "$QWEN_SECT"
case_error qwen3 0 /fixture "$PROMPT_IDS" "$EXPECT_TOKENS" "$QWEN_SECT"
case_error_header "$QWEN_SECT"
case_flakey qwen3 0 /fixture "$PROMPT_IDS" "$EXPECT_TOKENS" "$QWEN_SECT"
case_flakey_corrupt qwen3 0 /fixture "$PROMPT_IDS" "$EXPECT_TOKENS" "$QWEN_SECT"
case_delay qwen3 0 /fixture "$PROMPT_IDS" "$EXPECT_TOKENS" "$QWEN_SECT"
if [ -n "$GPT_SECT" ]; then
  case_error gpt-oss "$GPT_BASE" /fixture-gpt-oss "$GPT_PROMPT_IDS" "$GPT_EXPECT_TOKENS" "$GPT_SECT"
  case_flakey gpt-oss "$GPT_BASE" /fixture-gpt-oss "$GPT_PROMPT_IDS" "$GPT_EXPECT_TOKENS" "$GPT_SECT"
  case_flakey_corrupt gpt-oss "$GPT_BASE" /fixture-gpt-oss "$GPT_PROMPT_IDS" "$GPT_EXPECT_TOKENS" "$GPT_SECT"
fi

S=$((SCRATCH_BASE / SECT)); PK=4096 # 2 MiB of scratch for the Qwen3 image (401,408 bytes)
# The first 256 KiB are what pack reads to look for signatures before it writes anything.
case_pack_fails dm-pack-head-unreadable 'read the first blocks for signatures' \
  "0 256 linear $DEV1 $S" "256 256 error" "512 $((PK - 512)) linear $DEV1 $((S + 512))"
case_pack_fails dm-pack-onto-error 'write of [0-9]* bytes at offset' \
  "0 512 linear $DEV1 $S" "512 128 error" "640 $((PK - 640)) linear $DEV1 $((S + 640))"
case_pack_fails dm-pack-onto-drop-writes 'reading it back did not give it' "0 $PK flakey $DEV1 $S 0 1 1 drop_writes"
case_pack_fails dm-pack-onto-error-writes 'write of [0-9]* bytes at offset' "0 $PK flakey $DEV1 $S 0 1 1 error_writes"
dms remove_all > /dev/null 2>&1
