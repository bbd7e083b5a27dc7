#!/usr/bin/env bash
# Prepares everything the QEMU/VFIO NVMe end-to-end harness (tests/vm/run.sh) needs, under target/vm/.
# Idempotent: a second run only re-checks what is cached. Needs root and Debian's apt repositories.
#
#   tests/vm/setup.sh            # mode iommu (stock Debian modules) + mode noiommu (rebuilt vfio.ko)
#   VM_NOIOMMU=0 tests/vm/setup.sh   # skip the no-IOMMU vfio.ko rebuild (saves ~150 MB of downloads)
#
# Outputs (target/vm/):
#   vmlinux                     guest kernel (ELF, booted via PVH; falls back to bzImage if extraction fails)
#   initramfs-iommu.cpio.gz     busybox + /init + nvme and vfio modules (stock)
#   initramfs-noiommu.cpio.gz   same, with vfio.ko rebuilt with CONFIG_VFIO_NOIOMMU (absent if skipped)
#   kernel.env                  KVER=..., KERNEL=..., NOIOMMU=yes|SKIPPED:<reason>
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
# $PICCHIO_VM_DIR moves the cache (kernel, modules, initramfs, static builds) out of the checkout.
VM="${PICCHIO_VM_DIR:-$ROOT/target/vm}"
mkdir -p "$VM"
export DEBIAN_FRONTEND=noninteractive
log() { echo "[vm-setup] $*" >&2; }
exec 8>"$VM/setup.lock"
if ! flock -n 8; then log "another setup.sh holds $VM/setup.lock; waiting"; flock 8; fi

if [ "$(id -u)" -ne 0 ]; then
  echo "tests/vm/setup.sh: needs root (apt-get install)" >&2
  exit 1
fi

# --- 1. host packages -------------------------------------------------------------------------------
APT_UPDATED=0
apt_install() {
  local missing=()
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$APT_UPDATED" = 0 ]; then apt-get update -qq; APT_UPDATED=1; fi
  log "apt-get install ${missing[*]}"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
apt_install qemu-system-x86 busybox-static cpio kmod xz-utils jq binutils

# --- 2. guest kernel --------------------------------------------------------------------------------
# linux-image-amd64 is a moving metapackage: resolve the versioned package every time (old ABIs leave
# the mirror). apt-cache needs lists; update once if it knows nothing.
resolve_kpkg() {
  apt-cache depends linux-image-amd64 2>/dev/null |
    awk '/Depends: linux-image-[0-9]/ {print $2; exit}'
}
KPKG="$(resolve_kpkg || true)"
if [ -z "$KPKG" ] && [ "$APT_UPDATED" = 0 ]; then apt-get update -qq; APT_UPDATED=1; KPKG="$(resolve_kpkg || true)"; fi
[ -n "$KPKG" ] || { echo "cannot resolve the kernel package from linux-image-amd64" >&2; exit 1; }
KDIR="$VM/kernel/$KPKG"
if [ ! -f "$KDIR/.extracted" ]; then
  log "downloading $KPKG"
  rm -rf "$KDIR"; mkdir -p "$KDIR/dl"
  chmod 0777 "$KDIR/dl"   # apt-get download runs as _apt when it can
  (cd "$KDIR/dl" && apt-get download -qq "$KPKG" 2>&1 | grep -v 'unsandboxed' >&2 || true)
  ls "$KDIR"/dl/*.deb >/dev/null
  dpkg-deb -x "$KDIR"/dl/*.deb "$KDIR/root"
  rm -rf "$KDIR/dl"
  touch "$KDIR/.extracted"
fi
KVER="$(ls "$KDIR/root/lib/modules" | head -n1)"
BZ="$KDIR/root/boot/vmlinuz-$KVER"
[ -f "$BZ" ] || { echo "no $BZ in $KPKG" >&2; exit 1; }

# vmlinux: the XZ payload of the bzImage is the ELF; booting it directly (PVH) skips SeaBIOS and the
# in-guest XZ decompression under TCG (about 3 s instead of 6 s per boot).
if [ ! -s "$KDIR/vmlinux" ]; then
  off="$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$BZ" | head -n1 | cut -d: -f1 || true)"
  # (tail gets SIGPIPE when xz stops after the stream: judge by the ELF magic, not the exit status)
  [ -n "$off" ] && { tail -c +"$((off + 1))" "$BZ" | xz -dc --single-stream > "$KDIR/vmlinux.tmp" 2>/dev/null || true; }
  if [ -s "$KDIR/vmlinux.tmp" ] && [ "$(head -c 4 "$KDIR/vmlinux.tmp" | od -An -tx1 | tr -d ' ')" = "7f454c46" ]; then
    mv "$KDIR/vmlinux.tmp" "$KDIR/vmlinux"
  else
    rm -f "$KDIR/vmlinux.tmp"; log "could not extract vmlinux; using the bzImage"
  fi
fi
if [ -s "$KDIR/vmlinux" ]; then KERNEL="$KDIR/vmlinux"; else KERNEL="$BZ"; fi
ln -sfn "$KERNEL" "$VM/vmlinux"

# modules.dep is not shipped in the .deb; make it on the extracted tree.
MODROOT="$KDIR/root"
if [ ! -s "$MODROOT/lib/modules/$KVER/modules.dep" ]; then
  depmod -b "$MODROOT" "$KVER"
fi

# Load order (dependencies first) from modprobe --show-depends on the extracted tree.
mod_order() {
  local m
  for m in "$@"; do
    modprobe -d "$MODROOT" -S "$KVER" --show-depends "$m" | awk '$1 == "insmod" {print $2}'
  done | awk '!seen[$0]++'
}
mapfile -t NVME_MODS < <(mod_order nvme)
mapfile -t VFIO_MODS < <(mod_order vfio vfio_iommu_type1 vfio-pci)
[ ${#NVME_MODS[@]} -gt 0 ] && [ ${#VFIO_MODS[@]} -gt 0 ] || { echo "module resolution failed" >&2; exit 1; }
# NVMe/TCP (tier S6, the `tcp` case): the kernel's NVMe-oF target (configfs, nvmet, nvmet-tcp), its
# initiator (nvme-fabrics, nvme-tcp) and CRC32C for header/data digests; loaded by guest-tcp.sh.
mapfile -t TCP_MODS < <(mod_order configfs nvmet nvmet-tcp nvme-fabrics nvme-tcp crc32c_generic)
[ ${#TCP_MODS[@]} -gt 0 ] || { echo "module resolution failed (nvmet-tcp)" >&2; exit 1; }

# --- 3. no-IOMMU vfio.ko (Debian builds without CONFIG_VFIO_NOIOMMU) -----------------------------------
NOIOMMU_STATUS="SKIPPED: not attempted"
NOI="$VM/noiommu/$KVER"
build_noiommu() {
  if [ -s "$NOI/vfio.ko" ]; then return 0; fi
  local major; major="$(echo "$KVER" | cut -d. -f1-2)"
  apt_install "linux-headers-$KVER" "linux-source-$major" gcc make libc6-dev || return 1
  local tarball; tarball="$(ls /usr/src/linux-source-"$major".tar.* 2>/dev/null | head -n1)"
  [ -n "$tarball" ] || { log "no linux-source tarball"; return 1; }
  rm -rf "$NOI"; mkdir -p "$NOI/src"
  tar -xf "$tarball" -C "$NOI/src" --strip-components=3 --wildcards "linux-source-$major/drivers/vfio/*" \
    --exclude "*/vfio/pci/*" --exclude "*/vfio/platform/*" --exclude "*/vfio/mdev/*" --exclude "*/vfio/fsl-mc/*" || return 1
  # Objects of vfio.ko as the 6.1 Makefile lists them (vfio-y, plus container.o when VFIO_CONTAINER).
  local objs
  objs="$(sed -e ':a' -e '/\\$/N; s/\\\n//; ta' "$NOI/src/Makefile" |
    sed -n 's/^vfio-y[ :+]*=\(.*\)$/\1/p; s/^vfio-\$(CONFIG_VFIO_CONTAINER)[ :+]*=\(.*\)$/\1/p' | tr -s '\n\t ' '   ')"
  [ -n "$objs" ] || { log "cannot read vfio objects from drivers/vfio/Makefile"; return 1; }
  grep -q 'CONFIG_VFIO_NOIOMMU' "$NOI/src/vfio_main.c" 2>/dev/null || grep -rq 'CONFIG_VFIO_NOIOMMU' "$NOI/src"/*.c || { log "source has no NOIOMMU code"; return 1; }
  printf 'obj-m := vfio.o\nvfio-y := %s\nccflags-y += -DCONFIG_VFIO_NOIOMMU=1\n' "$objs" > "$NOI/src/Kbuild"
  mv "$NOI/src/Makefile" "$NOI/src/Makefile.orig"
  log "building vfio.ko with CONFIG_VFIO_NOIOMMU ($objs)"
  make -s -C "/usr/src/linux-headers-$KVER" M="$NOI/src" modules >"$NOI/build.log" 2>&1 || { tail -n 20 "$NOI/build.log" >&2; return 1; }
  cp "$NOI/src/vfio.ko" "$NOI/vfio.ko"
}
if [ "${VM_NOIOMMU:-1}" = 0 ]; then
  NOIOMMU_STATUS="SKIPPED: VM_NOIOMMU=0"
elif build_noiommu; then
  NOIOMMU_STATUS="yes"
else
  NOIOMMU_STATUS="SKIPPED: vfio.ko rebuild with CONFIG_VFIO_NOIOMMU failed (see $NOI/build.log)"
fi

# --- 4. initramfs -------------------------------------------------------------------------------------
BUSYBOX="$(command -v busybox || true)"
[ -x /bin/busybox ] && BUSYBOX=/bin/busybox
file_is_static() { ! LC_ALL=C readelf -l "$1" 2>/dev/null | grep -q 'Requesting program interpreter'; }
if ! file_is_static "$BUSYBOX"; then echo "$BUSYBOX is not static (busybox-static expected)" >&2; exit 1; fi

# Rebuilt only when an input changes (stamp = hash of inputs).
build_initramfs() { # $1=name $2=replacement vfio.ko or ""
  local name="$1" vfio_ko="$2" out="$VM/initramfs-$1.cpio.gz"
  local stamp
  stamp="$( { sha256sum "$HERE/init" "$BUSYBOX" "${NVME_MODS[@]}" "${VFIO_MODS[@]}" "${TCP_MODS[@]}" ${vfio_ko:+"$vfio_ko"}; echo "$KVER"; } | sha256sum | cut -c1-16)"
  if [ -s "$out" ] && [ "$(cat "$out.stamp" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  local d="$VM/initramfs-$name.d"
  rm -rf "$d"; mkdir -p "$d"/{bin,dev,proc,sys,tmp,mnt,etc,lib/modules,test/bin,fixture}
  cp "$BUSYBOX" "$d/bin/busybox"
  ln -s busybox "$d/bin/sh"
  install -m 0755 "$HERE/init" "$d/init"
  local m b
  : > "$d/etc/nvme.modules"; : > "$d/etc/vfio.modules"
  for m in "${NVME_MODS[@]}"; do b="$(basename "$m")"; cp "$m" "$d/lib/modules/$b"; echo "$b" >> "$d/etc/nvme.modules"; done
  for m in "${VFIO_MODS[@]}"; do b="$(basename "$m")"; cp "$m" "$d/lib/modules/$b"; echo "$b" >> "$d/etc/vfio.modules"; done
  : > "$d/etc/tcp.modules"
  for m in "${TCP_MODS[@]}"; do b="$(basename "$m")"; cp "$m" "$d/lib/modules/$b"; echo "$b" >> "$d/etc/tcp.modules"; done
  if [ -n "$vfio_ko" ]; then cp "$vfio_ko" "$d/lib/modules/vfio.ko"; fi
  echo "$name" > "$d/etc/vm-mode"
  echo "$KVER" > "$d/etc/kver"
  (cd "$d" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet) | gzip -9 > "$out.tmp"
  mv "$out.tmp" "$out"
  echo "$stamp" > "$out.stamp"
  rm -rf "$d"
  log "built $out ($(du -h "$out" | cut -f1))"
}
build_initramfs iommu ""
if [ "$NOIOMMU_STATUS" = yes ]; then
  build_initramfs noiommu "$NOI/vfio.ko"
else
  rm -f "$VM/initramfs-noiommu.cpio.gz"
  echo "SKIPPED mode noiommu: ${NOIOMMU_STATUS#SKIPPED: }"
fi

# --- 4b. device-mapper initramfs (run.sh case `dm`, tests/vm/guest-dm.sh) ----------------------------
# The iommu initramfs with a second gzip'd cpio appended (the kernel unpacks both; later entries win):
# dm-mod (with the linear and error targets), dm-flakey and dm-delay with their dependencies, listed in
# /etc/dm.modules; Debian's dynamically linked dmsetup with the libraries ldd names (run with
# DM_DISABLE_UDEV=1: the guest has no udev, libdevmapper makes the /dev/mapper nodes itself); and
# /etc/vm-mode = dm, which makes guest.sh run guest-dm.sh.
apt_install dmsetup
mapfile -t DM_MODS < <(mod_order dm-mod dm-flakey dm-delay)
[ ${#DM_MODS[@]} -ge 3 ] || { echo "device-mapper module resolution failed" >&2; exit 1; }
build_initramfs_dm() {
  local out="$VM/initramfs-dm.cpio.gz" base="$VM/initramfs-iommu.cpio.gz" dmsetup stamp d m b lib
  dmsetup="$(command -v dmsetup)"
  mapfile -t DM_LIBS < <(ldd "$dmsetup" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
  stamp="$( { sha256sum "$base" "$dmsetup" "${DM_LIBS[@]}" "${DM_MODS[@]}"; echo "$KVER"; } | sha256sum | cut -c1-16)"
  if [ -s "$out" ] && [ "$(cat "$out.stamp" 2>/dev/null)" = "$stamp" ]; then return 0; fi
  d="$VM/initramfs-dm.d"
  rm -rf "$d"; mkdir -p "$d"/{sbin,etc,lib/modules}
  install -m 0755 "$dmsetup" "$d/sbin/dmsetup"
  for lib in "${DM_LIBS[@]}"; do mkdir -p "$d$(dirname "$lib")"; cp -L "$lib" "$d$lib"; done
  : > "$d/etc/dm.modules"
  for m in "${DM_MODS[@]}"; do b="$(basename "$m")"; cp "$m" "$d/lib/modules/$b"; echo "$b" >> "$d/etc/dm.modules"; done
  echo dm > "$d/etc/vm-mode"
  cp "$base" "$out.tmp"; truncate -s %512 "$out.tmp"   # the second cpio must start 4-byte aligned
  (cd "$d" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet) | gzip -9 >> "$out.tmp"
  mv "$out.tmp" "$out"
  echo "$stamp" > "$out.stamp"
  rm -rf "$d"
  log "built $out ($(du -h "$out" | cut -f1); dm modules: ${#DM_MODS[@]}, dmsetup + ${#DM_LIBS[@]} libraries)"
}
build_initramfs_dm

cat > "$VM/kernel.env" <<EOF
KPKG=$KPKG
KVER=$KVER
KERNEL=$KERNEL
NOIOMMU=$NOIOMMU_STATUS
EOF
log "ready: kernel $KVER ($(basename "$KERNEL")), nvme modules: ${#NVME_MODS[@]}, vfio modules: ${#VFIO_MODS[@]}, tcp modules: ${#TCP_MODS[@]}, noiommu: $NOIOMMU_STATUS"
