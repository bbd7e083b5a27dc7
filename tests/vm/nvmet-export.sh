#!/bin/sh
# Exports a block device (or a file, through a loop device) as a namespace of an NVMe-oF subsystem
# served over TCP by the Linux kernel's target (nvmet + nvmet-tcp), configured through configfs.
# POSIX sh: runs under busybox in the tests/vm guests and on any Linux machine (as root). docs/nvme-tcp.md.
#
#   nvmet-export.sh add --nqn NQN --device PATH [--nsid N] [--lba 512|4096] [--port ID]
#                       [--addr IPV4] [--svcid PORT] [--inline-data-size BYTES] [--load]
#   nvmet-export.sh port-down --nqn NQN [--port ID]  # unlink the subsystem from the port (its
#                                                     # connections drop; the listener closes with the
#                                                     # port's last subsystem)
#   nvmet-export.sh port-up   --nqn NQN [--port ID]  # link it again
#   nvmet-export.sh ns-disable|ns-enable --nqn NQN [--nsid N]
#   nvmet-export.sh remove    --nqn NQN [--port ID]  # unlink, disable and remove every namespace, the
#                                                     # subsystem, and the port when no subsystem is left
#   nvmet-export.sh show                              # ports, their address, subsystems, namespaces
#
# Defaults: --nsid 1, --port 1, --addr 127.0.0.1, --svcid 4420 (the IANA NVMe/TCP port). --addr 0.0.0.0
# listens on every interface: there is no host authentication here (attr_allow_any_host = 1), so only
# do that on a network you trust.
#
# The namespace's LBA size is the backing block device's logical block size (nvmet's bdev back end;
# `cat /sys/block/X/queue/logical_block_size`). --lba N checks it; for a regular FILE, --lba N
# attaches it to a loop device with that logical block size first (util-linux `losetup -b N
# --direct-io=on`; busybox's losetup has no -b, so there use a block device). Header and data digests
# (CRC32C) are not a target setting: the host asks for them in its ICReq and nvmet-tcp honours that
# (Picchio: PICCHIO_NVME_TCP_DIGESTS=both; the kernel initiator: `nvme connect -g -G`). --load
# modprobes configfs, nvmet, nvmet-tcp and crc32c and mounts configfs when needed.
set -eu

CFG=/sys/kernel/config/nvmet
usage() { sed -n '2,/^set -eu/p' "$0" | sed -e '/^set -eu/d' -e 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "nvmet-export: $*" >&2; exit 1; }
# Writes $2 to configfs attribute $1, naming both in the error.
put() { printf '%s\n' "$2" > "$1" 2>/dev/null || die "writing '$2' to $1 failed"; }

cmd="${1:-}"; [ -n "$cmd" ] || usage; shift
NQN=""; DEV=""; NSID=1; LBA=""; PORT=1; ADDR=127.0.0.1; SVCID=4420; INLINE=""; LOAD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --nqn) NQN="$2"; shift 2 ;;
    --device) DEV="$2"; shift 2 ;;
    --nsid) NSID="$2"; shift 2 ;;
    --lba) LBA="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    --addr) ADDR="$2"; shift 2 ;;
    --svcid) SVCID="$2"; shift 2 ;;
    --inline-data-size) INLINE="$2"; shift 2 ;;
    --load) LOAD=1; shift ;;
    -h | --help) usage ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
case "$LBA" in "" | 512 | 4096) ;; *) die "--lba $LBA: 512 or 4096" ;; esac
case "$NSID" in *[!0-9]* | "" | 0) die "--nsid '$NSID': a namespace ID from 1" ;; esac
case "$PORT" in *[!0-9]* | "") die "--port '$PORT': a number (the configfs port ID, not the TCP port)" ;; esac
case "$SVCID" in *[!0-9]* | "") die "--svcid '$SVCID': a TCP port number" ;; esac

load() {
  if [ ! -d /sys/kernel/config ] || ! grep -q ' /sys/kernel/config configfs' /proc/mounts; then
    if [ $LOAD = 1 ]; then modprobe configfs 2>/dev/null || true; fi
    mount -t configfs none /sys/kernel/config 2>/dev/null || true
  fi
  if [ ! -d "$CFG" ] && [ $LOAD = 1 ]; then modprobe nvmet && modprobe nvmet-tcp && { modprobe crc32c 2>/dev/null || true; }; fi
  [ -d "$CFG" ] || die "$CFG missing: load nvmet and nvmet-tcp (modprobe nvmet-tcp, or --load) and mount configfs"
}
need_nqn() { [ -n "$NQN" ] || die "$cmd: --nqn NQN is required"; }

# Block device to export: the device itself, or a loop device over a regular file (--lba N).
backing() {
  if [ -b "$DEV" ]; then echo "$DEV"; return; fi
  [ -f "$DEV" ] || die "--device $DEV: not a block device or a regular file"
  [ -n "$LBA" ] || die "--device $DEV is a file: give --lba 512|4096 (it is attached to a loop device with that LBA size)"
  losetup --help 2>&1 | grep -q -- '--sector-size' ||
    die "this losetup cannot set a loop device's logical block size (-b): util-linux losetup is needed for a file"
  losetup --find --show --direct-io=on -b "$LBA" "$DEV" || die "losetup -b $LBA $DEV failed"
}

add() {
  need_nqn; [ -n "$DEV" ] || die "add: --device PATH is required"
  load
  bdev="$(backing)"
  lbs="$(cat "/sys/class/block/$(basename "$(readlink -f "$bdev")")/queue/logical_block_size" 2>/dev/null || true)"
  [ -n "$lbs" ] || die "$bdev: cannot read its logical block size from sysfs"
  [ -z "$LBA" ] || [ "$lbs" = "$LBA" ] || die "$bdev has $lbs B logical blocks, --lba asked for $LBA"
  s="$CFG/subsystems/$NQN"
  mkdir -p "$s" 2>/dev/null || die "cannot create subsystem $s (is '$NQN' a valid NQN, at most 223 bytes?)"
  put "$s/attr_allow_any_host" 1
  ns="$s/namespaces/$NSID"
  mkdir -p "$ns" 2>/dev/null || die "cannot create namespace $ns"
  if [ "$(cat "$ns/enable")" = 1 ]; then put "$ns/enable" 0; fi
  put "$ns/device_path" "$bdev"
  put "$ns/enable" 1
  p="$CFG/ports/$PORT"
  mkdir -p "$p" 2>/dev/null || die "cannot create port $p"
  if [ -z "$(ls "$p/subsystems")" ]; then # a port's address can change only while it has no subsystem
    put "$p/addr_trtype" tcp
    put "$p/addr_adrfam" ipv4
    put "$p/addr_traddr" "$ADDR"
    put "$p/addr_trsvcid" "$SVCID"
    [ -z "$INLINE" ] || put "$p/param_inline_data_size" "$INLINE"
  else
    have="$(cat "$p/addr_trtype") $(cat "$p/addr_traddr"):$(cat "$p/addr_trsvcid")"
    [ "$have" = "tcp $ADDR:$SVCID" ] || die "port $PORT already serves $have, not tcp $ADDR:$SVCID (use another --port)"
  fi
  [ -e "$p/subsystems/$NQN" ] || ln -s "$s" "$p/subsystems/$NQN" ||
    die "linking $NQN to port $PORT ($ADDR:$SVCID) failed: see dmesg (address in use? nvmet-tcp loaded?)"
  echo "exported $bdev ($lbs B LBAs, $(($(cat "/sys/class/block/$(basename "$(readlink -f "$bdev")")/size") * 512)) bytes) as namespace $NSID of $NQN on tcp $ADDR:$SVCID (port $PORT)"
}

port_down() {
  need_nqn; load
  l="$CFG/ports/$PORT/subsystems/$NQN"
  [ -L "$l" ] || die "$NQN is not linked to port $PORT"
  rm "$l" || die "rm $l failed"
  echo "unlinked $NQN from port $PORT"
}
port_up() {
  need_nqn; load
  [ -d "$CFG/subsystems/$NQN" ] || die "no subsystem $NQN"
  [ -d "$CFG/ports/$PORT" ] || die "no port $PORT"
  [ -e "$CFG/ports/$PORT/subsystems/$NQN" ] || ln -s "$CFG/subsystems/$NQN" "$CFG/ports/$PORT/subsystems/$NQN" ||
    die "linking $NQN to port $PORT failed: see dmesg"
  echo "linked $NQN to port $PORT"
}
ns_enable() { # $1 = 0|1
  need_nqn; load
  e="$CFG/subsystems/$NQN/namespaces/$NSID/enable"
  [ -f "$e" ] || die "no namespace $NSID in $NQN"
  put "$e" "$1"
  echo "namespace $NSID of $NQN: enable = $1"
}
remove() {
  need_nqn; load
  s="$CFG/subsystems/$NQN"
  [ -d "$s" ] || die "no subsystem $NQN"
  for l in "$CFG"/ports/*/subsystems/"$NQN"; do [ -L "$l" ] && rm "$l"; done
  for ns in "$s"/namespaces/*; do
    [ -d "$ns" ] || continue
    put "$ns/enable" 0
    rmdir "$ns" || die "rmdir $ns failed"
  done
  rmdir "$s" || die "rmdir $s failed (a host still allowed in allowed_hosts?)"
  p="$CFG/ports/$PORT"
  if [ -d "$p" ] && [ -z "$(ls "$p/subsystems")" ]; then rmdir "$p"; fi
  echo "removed $NQN"
}
show() {
  load
  for p in "$CFG"/ports/*; do
    [ -d "$p" ] || continue
    echo "port $(basename "$p"): $(cat "$p/addr_trtype") $(cat "$p/addr_traddr"):$(cat "$p/addr_trsvcid")"
    for l in "$p"/subsystems/*; do [ -L "$l" ] && echo "  subsystem $(basename "$l")"; done
  done
  for s in "$CFG"/subsystems/*; do
    [ -d "$s" ] || continue
    echo "subsystem $(basename "$s") (allow_any_host $(cat "$s/attr_allow_any_host"))"
    for ns in "$s"/namespaces/*; do
      [ -d "$ns" ] && echo "  namespace $(basename "$ns"): $(cat "$ns/device_path") enable $(cat "$ns/enable")"
    done
  done
}

case "$cmd" in
  add) add ;;
  port-down) port_down ;;
  port-up) port_up ;;
  ns-disable) ns_enable 0 ;;
  ns-enable) ns_enable 1 ;;
  remove) remove ;;
  show) show ;;
  -h | --help | help) usage ;;
  *) die "unknown command '$cmd' (add, port-down, port-up, ns-disable, ns-enable, remove, show)" ;;
esac
