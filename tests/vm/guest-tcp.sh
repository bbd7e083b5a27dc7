#!/bin/sh
# The `tcp` case of tests/vm (tier S6, NVMe/TCP), run inside the QEMU guest by /init in place of
# guest.sh (run.sh stages it as /test/guest.sh for this case only). The Linux kernel's NVMe-oF target
# (nvmet + nvmet-tcp, configured through configfs by /test/bin/nvmet-export.sh) listens on 127.0.0.1
# and serves the two namespaces of QEMU's emulated NVMe controller (nsid 1: 512 B LBAs, nsid 2:
# 4 KiB LBAs; the host wrote the Qwen3 image at byte 0 of both). Two initiators read it: the kernel's
# (nvme-tcp, /dev/nvme-fabrics → a block device → picchio's raw: tier) and picchio's own
# (`nvme-tcp://`). Every check prints one marker line that run.sh counts:
#   PICCHIO-VM: PASS|FAIL|SKIP <check> <detail>
. /test/env
. /test/lib.sh
EXPORT=/test/bin/nvmet-export.sh
ADDR=127.0.0.1
SVCID=4420
NQN512=nqn.2026-12.dev.picchio:tcp-lba512
NQN4K=nqn.2026-12.dev.picchio:tcp-lba4k
# picchio's nvme-tcp:// log lines: an expert served from safetensors after a failed read, a reconnect.
TCP_FALLBACK_LOG="from the fallback"
TCP_RECONNECT_LOG="reconnected"

# Whether process $1 still runs (a zombie, exited but not yet waited for, does not: kill -0 says it does).
alive() { [ -r "/proc/$1/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status"; }
# Waits (up to $2 tenths of a second) for the command $1 to succeed.
wait_for() { i=0; while [ $i -lt "$2" ]; do eval "$1" && return 0; sleep 0.1; i=$((i + 1)); done; return 1; }

# run_picchio on the Qwen3 fixture and on GPT-OSS (no "store missing" pattern: a failure is a FAIL). $1 = check, $2 = store.
run_qwen() { run_picchio "$1" "$2" "" /fixture "$PROMPT_IDS" "$EXPECT_TOKENS"; }
run_gpt() { run_picchio "$1" "$2" "" /fixture-gpt-oss "$GPT_PROMPT_IDS" "$GPT_EXPECT_TOKENS"; }

# After run_picchio: every expert came from the store (reads > 0, fallbacks 0). $1 = check.
check_no_fallback() {
  reads="$(json_num reads)"; fb="$(json_num fallbacks)"
  if [ ! -s /tmp/picchio.json ]; then fail "$1" "no JSON from picchio run"
  elif [ -z "$reads" ] || [ "$reads" -eq 0 ]; then fail "$1" "no expert read from the store (reads='$reads')"
  elif [ "$fb" != 0 ]; then fail "$1" "$fb experts fell back to safetensors"
  else pass "$1" "$reads expert reads, 0 fallbacks"; fi
}

# `picchio ARGS` that must fail: exit != 0 and stderr naming every pattern given (grep -i -E), within
# TEST_TIMEOUT. $1 = check, $2 = "|"-free patterns separated by ";", $3.. = picchio arguments.
expect_error() {
  name="$1"; pats="$2"; shift 2
  t0="$(up)"
  timeout "$TEST_TIMEOUT" $PICCHIO "$@" > /tmp/err.out 2> /tmp/err.err
  erc=$?
  sed "s/^/$name: /" /tmp/err.err | tail -n 5
  missing=""
  IFS=';'; for pat in $pats; do grep -qiE "$pat" /tmp/err.err || missing="$missing '$pat'"; done; unset IFS
  if [ $erc -eq 0 ]; then fail "$name" "picchio $* exited 0"
  elif [ $erc -eq 124 ] || [ $erc -eq 143 ]; then fail "$name" "picchio $* still running after $TEST_TIMEOUT s"
  elif [ -n "$missing" ]; then fail "$name" "the error does not name$missing: $(grep -m1 -i error /tmp/err.err)"
  else pass "$name" "exit $erc after $(since "$t0") s: $(grep -m1 -i 'error' /tmp/err.err | cut -c1-200)"; fi
}

# Runs "$@" with picchio asking for header and data digests (CRC32C) in its ICReqs. The initiator
# refuses an ICResp that does not grant what it asked, so a pass means the digests were on.
with_digests() {
  PICCHIO_NVME_TCP_DIGESTS=both; export PICCHIO_NVME_TCP_DIGESTS
  "$@"
  unset PICCHIO_NVME_TCP_DIGESTS
}

# Picchio's own initiator against the kernel's target (tier S6): pack, verify and run over nvme-tcp://
# on both LBA sizes, digests on and off, GPT-OSS beside Qwen3, the errors of a wrong NQN, a refused
# connection and a silent listener, and the target taken away in the middle of a run.
tcp_initiator_checks() {
  if $PICCHIO nvme discover "$ADDR:$SVCID" > /tmp/disc.out 2>&1 && grep -q "$NQN512" /tmp/disc.out && grep -q "$NQN4K" /tmp/disc.out; then
    pass tcp-discover "both subsystems listed: $(grep -c nqn /tmp/disc.out) NQN lines"
  else sed 's/^/discover: /' /tmp/disc.out; fail tcp-discover "picchio nvme discover $ADDR:$SVCID does not list $NQN512 and $NQN4K"; fi
  # 512 B LBAs: a 1-layer prefix first (16 entries: proves the writes land), then the whole image.
  pack_ok tcp-pack-prefix-512 /fixture --out "$URI512" --layers 1 --force
  verify_ok tcp-verify-prefix-512 /fixture "$URI512" '16 entries'
  pack_ok tcp-pack-512 /fixture --out "$URI512" --force
  verify_ok tcp-verify-512 /fixture "$URI512" '48 entries'
  run_qwen tcp-run-512 "$URI512"; check_no_fallback tcp-run-512-no-fallback
  with_digests run_qwen tcp-run-512-digests "$URI512"
  # 4 KiB LBAs.
  pack_ok tcp-pack-4k /fixture --out "$URI4K" --force
  verify_ok tcp-verify-4k /fixture "$URI4K" '48 entries'
  run_qwen tcp-run-4k "$URI4K"; check_no_fallback tcp-run-4k-no-fallback
  with_digests run_qwen tcp-run-4k-digests "$URI4K"
  # GPT-OSS on the 512 B namespace, written with digests on.
  with_digests pack_ok tcp-pack-gpt-oss-512 /fixture-gpt-oss --out "$URI512" --force
  verify_ok tcp-verify-gpt-oss-512 /fixture-gpt-oss "$URI512" '32 entries'
  run_gpt tcp-run-gpt-oss-512 "$URI512"; check_no_fallback tcp-run-gpt-oss-512-no-fallback
  with_digests run_gpt tcp-run-gpt-oss-512-digests "$URI512"
  # Errors name the address and the step.
  expect_error tcp-err-wrong-nqn "$ADDR:$SVCID;connect;nqn.2026-12.dev.picchio:no-such" \
    verify "nvme-tcp://$ADDR:$SVCID/nqn.2026-12.dev.picchio:no-such" --model /fixture --no-progress
  expect_error tcp-err-refused "$ADDR:4421;refused" \
    verify "nvme-tcp://$ADDR:4421/$NQN512" --model /fixture --no-progress
  # A listener that accepts and never answers the ICReq.
  sleep 3600 | nc -l -p 4422 > /dev/null 2>&1 &
  ncpid=$!
  if wait_for "listening 4422" 50; then
    expect_error tcp-err-silent "$ADDR:4422;icresp|icreq;no answer|timed? ?out" \
      verify "nvme-tcp://$ADDR:4422/$NQN512" --model /fixture --no-progress
  else fail tcp-err-silent "busybox nc -l -p 4422 did not listen"; fi
  # (ash's `wait $ncpid` waits for the whole pipeline, `sleep 3600` included: end both, wait for neither)
  kill $ncpid 2>/dev/null
  for p in /proc/[0-9]*; do
    [ "$(tr '\0' ' ' < "$p/cmdline" 2>/dev/null)" = "sleep 3600 " ] && kill "${p#/proc/}" 2>/dev/null
  done
  target_down_mid_run
}

# The target goes away in the middle of a run and comes back: the subsystem is unlinked from its port
# (nvmet drops the connections and closes the listener) once the run has started reading experts, and
# linked again once an expert has fallen back to safetensors. The run (4 cache slots, so experts keep
# streaming) must finish with the file tier's tokens, count the experts that fell back (> 0), and
# have reconnected (its log says so).
target_down_mid_run() {
  n=96
  # (--buffered: /fixture is in the initramfs, tmpfs, which has no O_DIRECT)
  timeout "$TEST_TIMEOUT" $PICCHIO run --model /fixture --store file:/fixture/experts.picchioflat --buffered --ecap 4 \
    --prompt-ids "$PROMPT_IDS" -n $n --json > /tmp/file.json 2>/tmp/file.err
  want="$(tr -d ' \n' < /tmp/file.json | sed -n 's/.*"tokens":\[\([0-9,]*\)\].*/\1/p')"
  [ -n "$want" ] || { fail tcp-target-down-mid-run "no tokens from the file tier: $(tail -n 1 /tmp/file.err)"; return; }
  rm -f /tmp/down.json /tmp/down.err
  NO_COLOR=1 timeout "$TEST_TIMEOUT" $PICCHIO -v run --model /fixture --store "$URI4K" --ecap 4 --prompt-ids "$PROMPT_IDS" \
    -n $n --json > /tmp/down.json 2> /tmp/down.err &
  rpid=$!
  wait_for "grep -q 'experts from' /tmp/down.err || ! alive $rpid" 600
  $EXPORT port-down --nqn $NQN4K > /tmp/pd.out 2>&1 || echo "port-down: $(cat /tmp/pd.out)"
  wait_for "grep -qiE '$TCP_FALLBACK_LOG' /tmp/down.err || ! alive $rpid" 600
  $EXPORT port-up --nqn $NQN4K > /tmp/pu.out 2>&1 || echo "port-up: $(cat /tmp/pu.out)"
  wait $rpid; drc=$?
  grep -iE 'nvme-tcp|reconnect|fallback' /tmp/down.err | head -n 12 | sed 's/^/target-down: /'
  got="$(tr -d ' \n' < /tmp/down.json | sed -n 's/.*"tokens":\[\([0-9,]*\)\].*/\1/p')"
  fb="$(sed -n 's/.*"fallbacks":\([0-9]*\).*/\1/p' /tmp/down.json)"
  if [ $drc -ne 0 ]; then fail tcp-target-down-mid-run "picchio run exited $drc: $(tail -n 1 /tmp/down.err)"
  elif [ "$got" != "$want" ]; then fail tcp-target-down-mid-run "tokens differ from the file tier's ($n tokens)"
  elif [ -z "$fb" ] || [ "$fb" -eq 0 ]; then fail tcp-target-down-mid-run "no expert fell back while the target was away (fallbacks '$fb')"
  elif ! grep -qiE "$TCP_RECONNECT_LOG" /tmp/down.err; then fail tcp-target-down-mid-run "no reconnect logged after the target returned"
  else pass tcp-target-down-mid-run "$n tokens equal the file tier's; $fb experts fell back while the port was down; $(grep -m1 -iE "$TCP_RECONNECT_LOG" /tmp/down.err | cut -c1-120)"; fi
}

echo "PICCHIO-VM: CASE $CASE (NVMe/TCP: kernel nvmet-tcp target on $ADDR:$SVCID)"

# ---- 1. the backing namespaces, through the kernel nvme driver -------------------------------------
BDF="$(nvme_bdf)" || { fail tcp-backing "no NVMe PCI function (class 0x010802)"; exit 0; }
load_mods /etc/nvme.modules || { fail tcp-backing "insmod of the nvme modules failed"; exit 0; }
bdev_of() { for d in /sys/bus/pci/devices/"$BDF"/nvme/nvme*/nvme*n"$1"; do [ -b "/dev/$(basename "$d")" ] && { echo "/dev/$(basename "$d")"; return 0; }; done; return 1; }
wait_for 'bdev_of 1 >/dev/null && bdev_of 2 >/dev/null' 200
B512="$(bdev_of 1)"; B4K="$(bdev_of 2)"
lbs() { cat "/sys/block/$(basename "$1")/queue/logical_block_size"; }
if [ -z "$B512" ] || [ -z "$B4K" ]; then fail tcp-backing "namespaces 1/2 of $BDF have no block device after 20 s"; exit 0; fi
if [ "$(lbs "$B512")" = 512 ] && [ "$(lbs "$B4K")" = 4096 ]; then pass tcp-backing "$B512 (512 B LBAs), $B4K (4 KiB LBAs) on $BDF"
else fail tcp-backing "LBA sizes $(lbs "$B512")/$(lbs "$B4K"), want 512/4096"; fi

echo "PICCHIO-VM: INFO uptime $(up) s: backing namespaces ready"
# ---- 2. the target: modules, configfs, loopback, two subsystems on one port --------------------------
if load_mods /etc/tcp.modules && mount -t configfs none /sys/kernel/config && [ -d /sys/kernel/config/nvmet ]; then
  pass tcp-target-modules "$(tr '\n' ' ' < /etc/tcp.modules | sed 's/\.ko//g'); configfs on /sys/kernel/config"
else fail tcp-target-modules "insmod or the configfs mount failed"; exit 0; fi
ip link set lo up
if wait_for "ip addr show lo | grep -q 'inet $ADDR'" 50; then pass tcp-loopback "lo up, $ADDR"
else fail tcp-loopback "no $ADDR on lo: $(ip addr show lo | tr '\n' ' ')"; exit 0; fi
listening() { netstat -ltn 2>/dev/null | grep -qE ":$1 .*LISTEN"; }
export_ns() { # $1 = check, $2 = NQN, $3 = device, $4 = LBA size
  if out="$($EXPORT add --nqn "$2" --device "$3" --lba "$4" --addr $ADDR --svcid $SVCID 2>&1)"; then
    if listening $SVCID; then pass "$1" "$out"; else fail "$1" "exported, but nothing listens on $ADDR:$SVCID"; fi
  else fail "$1" "$out"; fi
}
export_ns tcp-export-512 $NQN512 "$B512" 512
export_ns tcp-export-4k $NQN4K "$B4K" 4096
$EXPORT show | sed 's/^/nvmet: /'
# The script's refusals: a device whose LBA size is not the one asked for.
if out="$($EXPORT add --nqn nqn.2026-12.dev.picchio:wrong-lba --device "$B512" --lba 4096 2>&1)"; then
  fail tcp-export-lba-mismatch "exported $B512 (512 B LBAs) as --lba 4096: $out"
elif echo "$out" | grep -q "512 B logical blocks, --lba asked for 4096"; then pass tcp-export-lba-mismatch "$out"
else fail tcp-export-lba-mismatch "unexpected refusal: $out"; fi

echo "PICCHIO-VM: INFO uptime $(up) s: target exported"
# ---- 3. the kernel's initiator: /dev/nvme-fabrics → block device → picchio's raw: tier ---------------
# Connects to $1 with extra options $2; prints the block device of its namespace 1. The controller
# instance goes to /tmp/kctrl.$1.
kconnect() {
  opts="transport=tcp,traddr=$ADDR,trsvcid=$SVCID,nqn=$1${2:+,$2}"
  exec 3<>/dev/nvme-fabrics || return 1
  printf '%s' "$opts" >&3 || { exec 3>&-; echo "write of '$opts' to /dev/nvme-fabrics failed" >&2; return 1; }
  read -r resp <&3; exec 3>&-
  inst="$(echo "$resp" | sed -n 's/.*instance=\([0-9]*\).*/\1/p')"
  [ -n "$inst" ] || { echo "no instance in /dev/nvme-fabrics' answer '$resp'" >&2; return 1; }
  echo "nvme$inst" > "/tmp/kctrl.$1"
  sub=""
  for s in /sys/class/nvme-subsystem/*; do [ "$(cat "$s/subsysnqn")" = "$1" ] && sub="$s"; done
  [ -n "$sub" ] || { echo "no nvme-subsystem with subsysnqn $1" >&2; return 1; }
  wait_for "ls $sub | grep -q 'n1\$'" 200 || { echo "no namespace block device under $sub" >&2; return 1; }
  dev="/dev/$(ls "$sub" | grep 'nvme[0-9]*n1$' | head -n 1)"
  wait_for "[ -b $dev ]" 100 && echo "$dev"
}
kdisconnect() { echo 1 > "/sys/class/nvme/$(cat "/tmp/kctrl.$1")/delete_controller"; }
K512=""; K4K=""
if K512="$(kconnect $NQN512 "" 2>/tmp/kc.err)"; then
  pass tcp-kernel-connect-512 "$(cat /tmp/kctrl.$NQN512) → $K512, $(lbs "$K512") B LBAs"
else fail tcp-kernel-connect-512 "$(cat /tmp/kc.err)"; K512=""; fi
# Header and data digests on this one: the kernel's initiator asks for them in its ICReq.
if K4K="$(kconnect $NQN4K "hdr_digest,data_digest" 2>/tmp/kc.err)"; then
  pass tcp-kernel-connect-4k-digests "$(cat /tmp/kctrl.$NQN4K) → $K4K, $(lbs "$K4K") B LBAs, hdr_digest,data_digest"
else fail tcp-kernel-connect-4k-digests "$(cat /tmp/kc.err)"; K4K=""; fi
if [ -n "$K512" ]; then
  check_image tcp-kernel-read-image-512 "$K512"
  run_qwen tcp-kernel-raw-512 "raw:$K512"
fi
if [ -n "$K4K" ]; then
  check_image tcp-kernel-read-image-4k "$K4K"
  run_qwen tcp-kernel-raw-4k "raw:$K4K"
  # Writes through the kernel's initiator: GPT-OSS packed onto the 4 KiB namespace over NVMe/TCP
  # (with digests), verified, run, and the bytes checked on the target's backing device.
  pack_ok tcp-kernel-pack-gpt-oss-4k /fixture-gpt-oss --out "raw:$K4K" --force
  verify_ok tcp-kernel-verify-gpt-oss-4k /fixture-gpt-oss "raw:$K4K" '32 entries'
  run_gpt tcp-kernel-raw-gpt-oss-4k "raw:$K4K"
  n="$(dd if="$K4K" bs=4096 count=1 iflag=direct 2>/dev/null | od -An -tu4 -j36 -N4 | tr -d ' ')"
  if dd if="$K4K" of=/tmp/remote.img bs=1M count=8 iflag=direct 2>/dev/null &&
    dd if="$B4K" of=/tmp/local.img bs=1M count=8 iflag=direct 2>/dev/null && cmp -s /tmp/remote.img /tmp/local.img; then
    pass tcp-kernel-backing-4k "the first 8 MiB read over NVMe/TCP equal $B4K's (the image has $n entries)"
  else fail tcp-kernel-backing-4k "the remote namespace and its backing device $B4K differ"; fi
  rm -f /tmp/remote.img /tmp/local.img
  # Back to the Qwen3 image, as the host wrote it.
  pack_ok tcp-kernel-pack-qwen3-4k /fixture --out "raw:$K4K" --force
fi

echo "PICCHIO-VM: INFO uptime $(up) s: kernel initiator checks done"
# ---- 4. picchio's own initiator: nvme-tcp:// -----------------------------------------------------------
URI512="nvme-tcp://$ADDR:$SVCID/$NQN512"
URI4K="nvme-tcp://$ADDR:$SVCID/$NQN4K"
TCP_CHECKS="tcp-discover tcp-pack-prefix-512 tcp-verify-prefix-512 tcp-pack-512 tcp-verify-512 tcp-run-512
  tcp-run-512-no-fallback tcp-run-512-digests tcp-pack-4k tcp-verify-4k tcp-run-4k tcp-run-4k-no-fallback
  tcp-run-4k-digests tcp-pack-gpt-oss-512 tcp-verify-gpt-oss-512 tcp-run-gpt-oss-512
  tcp-run-gpt-oss-512-no-fallback tcp-run-gpt-oss-512-digests tcp-err-wrong-nqn tcp-err-refused
  tcp-err-silent tcp-target-down-mid-run"
# This picchio reads nvme-tcp:// when `run --help` lists it among the stores.
[ -x $PICCHIO ] && $PICCHIO run --help > /tmp/probe.out 2>&1
HAVE_TCP=1
if [ ! -x $PICCHIO ]; then
  HAVE_TCP=0
  for c in $TCP_CHECKS; do skip "$c" "no picchio binary packed (host build failed)"; done
elif ! grep -q 'nvme-tcp://' /tmp/probe.out; then
  HAVE_TCP=0
  why="this picchio has no nvme-tcp:// store (picchio run --help does not list it)"
  for c in $TCP_CHECKS; do skip "$c" "$why"; done
else
  tcp_initiator_checks
fi

# ---- 5. qd-sweep: picchio's initiator beside the kernel's (raw:) and fio on the kernel's device --------
# A 16 MiB synthetic image (16 experts of 1 MiB) on the 4 KiB namespace, written through the kernel's
# initiator. TCG speeds are the emulator's: these figures show the paths work side by side, nothing
# about a network or a drive.
# One line per point of a qd-sweep report ($1, pretty JSON), ours and fio's: MB/s, p50, p99 of the
# read latency. $2 = label of the path.
side_by_side() {
  awk -v label="$2" '
function num(s) { sub(/^[^:]*: */, "", s); sub(/,$/, "", s); return s }
/"engine": "/ { e = $0; sub(/.*"engine": "/, "", e); sub(/".*/, "", e); f = 0; op50 = ""; op99 = ""; om = "" }
/"threads": [0-9]/ { t = num($0) }
/"qd": [0-9]/ { q = num($0) }
/"mb_s": / && !f && om == "" { om = num($0) }
/"p50": / && !f && op50 == "" { op50 = num($0) }
/"p99": / && !f && op99 == "" { op99 = num($0) }
/"bs": [0-9]/ && e != "" { printf "%-28s %-13s T=%s QD=%-3s %8.1f MB/s  p50 %9.0f us  p99 %9.0f us\n", label, e, t, q, om, op50, op99 }
/"fio": \{/ { f = 1; fm = ""; fp50 = ""; fp99 = "" }
f && /"mb_s": / && fm == "" { fm = num($0) }
f && /"p50": / && fp50 == "" { fp50 = num($0) }
f && /"p99": / && fp99 == "" { fp99 = num($0) }
f && /"ours_over_fio"/ { printf "%-28s %-13s T=%s QD=%-3s %8.1f MB/s  p50 %9.0f us  p99 %9.0f us\n", "fio, " label, "(as " e ")", t, q, fm, fp50, fp99; f = 0; e = "" }
' "$1" | sed 's/^/PICCHIO-VM: SIDE-BY-SIDE /'
}
bench_side_by_side() {
  [ -n "$K4K" ] || { fail tcp-bench-synth "no kernel-initiator device for the 4 KiB namespace"; return; }
  if ! timeout "$TEST_TIMEOUT" $PICCHIO synth --arch custom --hidden 512 --moe-intermediate 512 --experts 16 \
    --model-layers 1 --expert-bytes 1048576 --out "raw:$K4K" --force --no-progress > /tmp/synth.out 2>&1; then
    sed 's/^/picchio synth: /' /tmp/synth.out; fail tcp-bench-synth "picchio synth --out raw:$K4K: $(tail -n 1 /tmp/synth.out)"; return
  fi
  pass tcp-bench-synth "$(tail -n 1 /tmp/synth.out | cut -c1-160)"
  bench() { # $1 = check, $2.. = qd-sweep arguments
    name="$1"; shift
    t0="$(up)"
    timeout "$TEST_TIMEOUT" $PICCHIO bench qd-sweep --qd 1,8 --threads 1 --duration 0.5 --json "/tmp/$name.json" "$@" \
      > "/tmp/$name.out" 2>&1
    brc=$?
    sed "s/^/$name: /" "/tmp/$name.out"
    if [ $brc -ne 0 ]; then fail "$name" "picchio bench qd-sweep $* exited $brc: $(tail -n 1 "/tmp/$name.out")"
    else pass "$name" "picchio bench qd-sweep $* ($(since "$t0") s)"; fi
  }
  bench tcp-bench-kernel-initiator --store "raw:$K4K" --engines uring,psync-direct
  if [ -x /test/bin/fio ]; then
    if grep -q '"fio": {' /tmp/tcp-bench-kernel-initiator.json; then pass tcp-bench-fio "fio $(fio --version) beside the raw: points"
    else fail tcp-bench-fio "fio is in the guest but the report has no fio figures ($(grep -o '"skipped":[^]]*' /tmp/tcp-bench-kernel-initiator.json | cut -c1-200))"; fi
  else skip tcp-bench-fio "the host had no fio to stage (apt-get install fio)"; fi
  if [ $HAVE_TCP = 1 ]; then bench tcp-bench-picchio-initiator --store "$URI4K"
  else skip tcp-bench-picchio-initiator "this picchio has no nvme-tcp:// store"; fi
  echo "PICCHIO-VM: SIDE-BY-SIDE qd-sweep of 1 MiB expert reads over NVMe/TCP on 127.0.0.1 in a TCG guest (emulator speed, not a network's)"
  [ -s /tmp/tcp-bench-picchio-initiator.json ] && side_by_side /tmp/tcp-bench-picchio-initiator.json "picchio initiator (nvme-tcp)"
  [ -s /tmp/tcp-bench-kernel-initiator.json ] && side_by_side /tmp/tcp-bench-kernel-initiator.json "kernel initiator (raw:)"
}
echo "PICCHIO-VM: INFO uptime $(up) s: picchio initiator checks done"
bench_side_by_side
echo "PICCHIO-VM: INFO uptime $(up) s: bench done"

# ---- 6. teardown: the kernel's initiator disconnects, the exports go ---------------------------------
for q in $NQN512 $NQN4K; do [ -f "/tmp/kctrl.$q" ] && kdisconnect "$q"; done
if out="$($EXPORT remove --nqn $NQN512 2>&1 && $EXPORT remove --nqn $NQN4K 2>&1)" && ! listening $SVCID &&
  [ -z "$(ls /sys/kernel/config/nvmet/subsystems)" ]; then pass tcp-teardown "$(echo "$out" | tr '\n' ' ')"
else fail tcp-teardown "$out; listening: $(netstat -ltn | grep ":$SVCID" | tr '\n' ' ')"; fi
