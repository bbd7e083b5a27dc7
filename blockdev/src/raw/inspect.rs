//! What writing an image to a device would destroy, and the decision: [`Finding`]s (uses from
//! [`crate::host`], signatures from [`super::scan_signatures`] and `blkid`), their [`Verdict`]s,
//! [`decide`], the [`Inspection`] plan `picchio pack --out raw:` prints, and the [`WritePermit`]
//! that alone opens a [`super::DeviceSink`].

use std::fmt;

use picchio_core::human_bytes as human;
use picchio_core::io::read_blocking;

use super::blkid::BlkidProbe;
use super::signature::{scan_signatures, Signature, SignatureKind, HEAD_BYTES};
use super::RawTarget;
use crate::error::{Error, Result};
use crate::host::{Host, Use};
use crate::psync::{PsyncOptions, PsyncQueue};

impl RawTarget {
    /// Reads (never writes) what writing an image of `image_len` bytes here would overwrite or
    /// disturb, as the running system sees it ([`Host::current`]): how the device and its
    /// partitions are used ([`Host::uses`]), whether it backs `/` ([`Host::root_backing`]), and the
    /// signatures in its first [`HEAD_BYTES`] (and in those at the image's start), by our own scan
    /// and by `blkid -p` where installed ([`BlkidProbe`]).
    ///
    /// # Errors
    /// [`Error::Inspect`] when the mount table cannot be read; the [`PsyncQueue::open`] errors and
    /// [`Error::Inspect`] when the device's first blocks cannot be read.
    pub fn inspect(&self, image_len: u64) -> Result<Inspection> {
        self.inspect_with(image_len, &Host::current()?)
    }

    /// [`RawTarget::inspect`] against a given view of the system.
    ///
    /// # Errors
    /// As [`RawTarget::inspect`].
    pub fn inspect_with(&self, image_len: u64, host: &Host) -> Result<Inspection> {
        let mut findings: Vec<Finding> =
            host.uses(self.device.devnum, &self.device.name).into_iter().map(Finding::from).collect();
        if let Some(root) = host.root_backing().get(&self.device.devnum) {
            findings.push(Finding::BacksRoot { device: self.device.name.clone(), root: root.clone() });
        }
        let base = self.base().0;
        let written = base..base.saturating_add(image_len);
        let mut starts = vec![0];
        if base != 0 {
            starts.push(base);
        }
        let mut queue = PsyncQueue::open(&self.device.path, PsyncOptions::direct(1))?;
        let lbs = u64::from(self.device.logical_block);
        for start in starts {
            let len = HEAD_BYTES.min(self.device.size - start) / lbs * lbs;
            if len == 0 {
                continue;
            }
            let head = read_blocking(&mut queue, start, len as u32).map_err(|cause| Error::Inspect {
                path: self.device.path.clone(),
                what: "read the first blocks for signatures",
                cause,
            })?;
            let ours = scan_signatures(head.as_slice(), start);
            let probe = BlkidProbe::run(&self.device.path, start);
            if let Some(probe) = probe.filter(|p| blkid_adds_to(p, &ours)) {
                findings.push(Finding::Blkid { probe });
            }
            for signature in ours {
                let overwritten = written.contains(&signature.offset);
                findings.push(Finding::Signature { signature, overwritten });
            }
        }
        Ok(Inspection { target: self.clone(), image_len, findings })
    }
}

/// Our [`SignatureKind`] for a `blkid` `TYPE` or `PTTYPE` value, where we know the kind.
fn kind_of_blkid(value: &str) -> Option<SignatureKind> {
    Some(match value {
        "ext2" | "ext3" | "ext4" | "ext4dev" | "jbd" => SignatureKind::Ext,
        "xfs" | "xfs_external_log" => SignatureKind::Xfs,
        "btrfs" => SignatureKind::Btrfs,
        "f2fs" => SignatureKind::F2fs,
        "swap" | "swsuspend" => SignatureKind::Swap,
        "crypto_LUKS" => SignatureKind::Luks,
        "vfat" => SignatureKind::Vfat,
        "exfat" => SignatureKind::Exfat,
        "ntfs" => SignatureKind::Ntfs,
        "LVM2_member" => SignatureKind::Lvm2,
        "linux_raid_member" => SignatureKind::MdRaid,
        "iso9660" => SignatureKind::Iso9660,
        "squashfs" => SignatureKind::Squashfs,
        "zfs_member" => SignatureKind::Zfs,
        "bcache" => SignatureKind::Bcache,
        "reiserfs" => SignatureKind::Reiserfs,
        "jfs" => SignatureKind::Jfs,
        "nilfs2" => SignatureKind::Nilfs2,
        "BitLocker" => SignatureKind::BitLocker,
        "ceph_bluestore" => SignatureKind::CephBluestore,
        "dos" | "PMBR" => SignatureKind::Mbr,
        "gpt" => SignatureKind::Gpt,
        _ => return None,
    })
}

/// Whether a `blkid` probe says more than our own scan `ours` of the same bytes: it found a type or
/// partition table we did not (or do not know), or could not decide between several.
fn blkid_adds_to(probe: &BlkidProbe, ours: &[Signature]) -> bool {
    let claims = [probe.get("TYPE"), probe.get("PTTYPE")];
    probe.ambivalent
        || claims.into_iter().flatten().any(|v| kind_of_blkid(v).is_none_or(|k| !ours.iter().any(|s| s.kind == k)))
}

impl From<Use> for Finding {
    fn from(u: Use) -> Finding {
        Finding::InUse(u)
    }
}

/// One thing found on (or about) a device that writing it would destroy or disturb.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finding {
    /// The device, or a partition of it, is in use by the kernel: mounted, an active swap area, or
    /// held by device-mapper / md ([`Use`], from the host inspection).
    InUse(Use),
    /// A partition table, file-system, volume or image signature.
    Signature {
        /// What and where.
        signature: Signature,
        /// Whether the image overwrites the signature's bytes (else they stay, describing a device
        /// whose contents the image has overwritten).
        overwritten: bool,
    },
    /// `blkid -p` (util-linux libblkid) found a file system, volume or partition table that our
    /// own scan did not (a kind we do not know, or one we missed), or several it cannot decide
    /// between. Refused unless forced, like a signature.
    Blkid {
        /// What it reported.
        probe: BlkidProbe,
    },
    /// The device backs the root file system.
    BacksRoot {
        /// The device.
        device: String,
        /// How: the device `/` is on, and the chain down to this one.
        root: String,
    },
}

/// What a [`Finding`] means for writing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    /// Said, not a reason to refuse (an earlier `.picchioflat` image being overwritten).
    Note,
    /// Refused unless `--force`.
    Refuse,
    /// Refused even with `--force` (the device backing `/`).
    RefuseAlways,
}

/// The write decision over a target's findings, shared by every writer (`raw:` devices here, NVMe
/// namespaces through the user-space driver): refused when any finding is
/// [`Verdict::RefuseAlways`], or when any is [`Verdict::Refuse`] and `force` is false.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Write. `overridden` holds the reasons `--force` overrode (empty without such findings); the
    /// caller logs them.
    Write {
        /// [`Finding::reason`] of each [`Verdict::Refuse`] finding that `force` overrode.
        overridden: Vec<String>,
    },
    /// Do not write.
    Refuse {
        /// The reasons, `; `-joined, the always-refused ones first.
        reasons: String,
        /// Whether `--force` cannot change it (a [`Verdict::RefuseAlways`] finding).
        always: bool,
    },
}

/// Decides whether findings allow a write; see [`Decision`].
pub fn decide(findings: &[Finding], force: bool) -> Decision {
    let reasons =
        |v: Verdict| -> Vec<String> { findings.iter().filter(|f| f.verdict() == v).map(Finding::reason).collect() };
    let always = reasons(Verdict::RefuseAlways);
    let unless_forced = reasons(Verdict::Refuse);
    if !always.is_empty() || (!force && !unless_forced.is_empty()) {
        let mut all = always.clone();
        if !force {
            all.extend(unless_forced);
        }
        return Decision::Refuse { reasons: all.join("; "), always: !always.is_empty() };
    }
    Decision::Write { overridden: if force { unless_forced } else { Vec::new() } }
}

/// Writes the findings as `\n  found: …` lines, each with its verdict, or `\n  found: nothing
/// (<nothing>)` — the listing `pack --out raw:|nvme:` prints before writing. `force` is how the
/// caller names the override of [`Inspection::permit`] in the verdicts (`` `force` `` here; the
/// binary's flag, `--force`, in its plan).
///
/// # Errors
/// The formatter's.
pub fn write_findings(f: &mut fmt::Formatter<'_>, findings: &[Finding], nothing: &str, force: &str) -> fmt::Result {
    if findings.is_empty() {
        return write!(f, "\n  found: nothing ({nothing})");
    }
    for finding in findings {
        match finding.verdict() {
            Verdict::Note => write!(f, "\n  found: {finding}")?,
            Verdict::Refuse => write!(f, "\n  found: {finding} [refused without {force}]")?,
            Verdict::RefuseAlways => write!(f, "\n  found: {finding} [refused, even with {force}]")?,
        }
    }
    Ok(())
}

impl Finding {
    /// What this finding means for writing; see [`Inspection::permit`].
    pub fn verdict(&self) -> Verdict {
        match self {
            Finding::Signature { signature, .. } if signature.kind == SignatureKind::Picchioflat => Verdict::Note,
            Finding::BacksRoot { .. } => Verdict::RefuseAlways,
            _ => Verdict::Refuse,
        }
    }
}

impl Finding {
    /// The finding as a reason to refuse, for [`Error::Refused`].
    pub fn reason(&self) -> String {
        match self {
            Finding::Signature { signature, .. } => format!("{signature} found on it"),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::InUse(u) => write!(f, "{u}"),
            Finding::Signature { signature, overwritten } => {
                let fate = match (signature.kind == SignatureKind::Picchioflat, overwritten) {
                    (true, true) => "an earlier image, overwritten (not a reason to refuse)",
                    (true, false) => "an earlier image outside the new one, left in place (not a reason to refuse)",
                    (false, true) => "overwritten",
                    (false, false) => "outside the image: left in place, but what it describes is damaged",
                };
                write!(f, "{signature}: {fate}")
            }
            Finding::Blkid { probe } => write!(f, "blkid -p reports {probe}"),
            Finding::BacksRoot { device, root } => write!(f, "{device} backs the root file system ({root})"),
        }
    }
}

/// What writing an image to a [`RawTarget`] would overwrite: the plan `picchio pack` prints.
#[derive(Clone, Debug)]
pub struct Inspection {
    target: RawTarget,
    image_len: u64,
    findings: Vec<Finding>,
}

impl Inspection {
    /// The target inspected.
    pub fn target(&self) -> &RawTarget {
        &self.target
    }

    /// Bytes the image needs.
    pub fn image_len(&self) -> u64 {
        self.image_len
    }

    /// Everything found, in the order: uses (mounts, swap, holders), root, signatures.
    pub fn findings(&self) -> &[Finding] {
        &self.findings
    }

    /// Clears the target for writing, or refuses.
    ///
    /// Refused: an image that does not fit; and unless `force`, a device that is mounted, an active
    /// swap area or held (itself or any partition of it), or carries a partition table or a
    /// file-system, volume or RAID signature. An earlier `.picchioflat` image is no reason to refuse.
    ///
    /// The device backing the root file system is refused **even with `force`**: unlike every other
    /// check, this one is not a heuristic that can be stale (a leftover signature on a device the
    /// user has since emptied, a mount the user is about to undo); it is a fact about the running
    /// system, and writing that device destroys the system the command runs on — including the
    /// model it is packing — with no outcome anyone could have meant. A spare partition on the same
    /// disk is not refused by this rule (only the device `/` is on, the disk holding it, and what it
    /// is built from, e.g. the members of its LVM or RAID volume).
    ///
    /// `force` cannot override the kernel either: [`DeviceSink::open`](super::DeviceSink::open) claims the device with
    /// `O_EXCL`, which fails (`EBUSY`) while a file system, swap area or holder uses it.
    ///
    /// # Errors
    /// [`Error::ImageTooLarge`] naming both sizes; [`Error::Refused`] listing every reason.
    pub fn permit(self, force: bool) -> Result<WritePermit> {
        let dev = &self.target.device;
        if self.image_len > self.target.capacity() {
            return Err(Error::ImageTooLarge {
                path: dev.path.clone(),
                offset: self.target.base().0,
                image_len: self.image_len,
                capacity: self.target.capacity(),
                size: dev.size,
            });
        }
        match decide(&self.findings, force) {
            Decision::Refuse { reasons, always } => Err(Error::Refused {
                path: dev.path.clone(),
                reasons,
                hint: if always {
                    "the device backing / is never written, not even with `force`"
                } else {
                    "if this is the device you mean, unmount or release it and wipe it (wipefs -a), or write with `force`"
                },
            }),
            Decision::Write { overridden } => {
                if !overridden.is_empty() {
                    tracing::warn!("{}: force: overwriting although {}", dev.path.display(), overridden.join("; "));
                }
                Ok(WritePermit { target: self.target, image_len: self.image_len })
            }
        }
    }
}

impl Inspection {
    /// The plan (target, byte and LBA range, findings with their verdicts) with the override of
    /// [`Inspection::permit`] named `force` in the verdicts, as the caller's users know it (the
    /// binary passes `--force`). `Display` names it `` `force` ``.
    pub fn plan<'a>(&'a self, force: &'a str) -> impl fmt::Display + 'a {
        PlanDisplay { inspection: self, force }
    }
}

impl fmt::Display for Inspection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.plan("`force`"))
    }
}

/// [`Inspection::plan`].
struct PlanDisplay<'a> {
    inspection: &'a Inspection,
    force: &'a str,
}

impl fmt::Display for PlanDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let this = self.inspection;
        let t = &this.target;
        let lbs = t.device.logical_block;
        let base = t.base().0;
        let end = base.saturating_add(this.image_len);
        writeln!(f, "{}: {}", t.uri(), t.device)?;
        write!(
            f,
            "  writes {} bytes ({}): device bytes {base:#x}..{end:#x}, LBA {}..{} of {} × {lbs} B",
            this.image_len,
            human(this.image_len),
            t.start.0,
            end.div_ceil(u64::from(lbs)),
            t.device.lbas(),
        )?;
        write_findings(f, &this.findings, "no mount, swap, holder, partition table or known signature", self.force)
    }
}

/// A [`RawTarget`] cleared for writing an image of a given length: the only way to a
/// [`DeviceSink`](super::DeviceSink).
#[derive(Debug)]
pub struct WritePermit {
    target: RawTarget,
    image_len: u64,
}

impl WritePermit {
    /// The cleared target.
    pub fn target(&self) -> &RawTarget {
        &self.target
    }

    /// Bytes the image may take.
    pub fn image_len(&self) -> u64 {
        self.image_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::parse_blkid_export;
    use crate::raw::tests::fake_target;
    use picchio_core::ByteOffset;

    #[test]
    fn uses_become_refused_findings() {
        let uses = [
            Use::Swap { device: "sda".into() },
            Use::Held { device: "sda1".into(), holder: "dm-0".into() },
            Use::Mounted { device: "sda2".into(), mount_point: "/srv".into(), fs_type: "xfs".into() },
        ];
        let found: Vec<Finding> = uses.into_iter().map(Finding::from).collect();
        assert_eq!(
            found,
            [
                Finding::InUse(Use::Swap { device: "sda".into() }),
                Finding::InUse(Use::Held { device: "sda1".into(), holder: "dm-0".into() }),
                Finding::InUse(Use::Mounted {
                    device: "sda2".into(),
                    mount_point: "/srv".into(),
                    fs_type: "xfs".into()
                }),
            ]
        );
        assert!(found.iter().all(|f| f.verdict() == Verdict::Refuse));
    }

    #[test]
    fn blkid_findings_add_what_our_scan_missed_and_are_refused() {
        let ext = Signature { kind: SignatureKind::Ext, offset: 1080, detail: "magic 0xEF53 at byte 1080".into() };
        let ext4 = parse_blkid_export("TYPE=ext4\nUSAGE=filesystem\n", 0);
        assert!(!blkid_adds_to(&ext4, std::slice::from_ref(&ext)), "the same kind: no second finding");
        assert!(blkid_adds_to(&ext4, &[]), "our scan missed it");
        let unknown = parse_blkid_export("TYPE=vdo\nUSAGE=other\n", 0);
        assert!(blkid_adds_to(&unknown, std::slice::from_ref(&ext)), "a kind we do not know");
        let both = parse_blkid_export("TYPE=ext4\nPTTYPE=dos\n", 0);
        assert!(blkid_adds_to(&both, std::slice::from_ref(&ext)), "the partition table we missed");
        assert!(!blkid_adds_to(&parse_blkid_export("", 0), &[]), "nothing found");
        let f = Finding::Blkid { probe: unknown };
        assert_eq!(f.verdict(), Verdict::Refuse);
        assert_eq!(f.to_string(), "blkid -p reports vdo (USAGE=other, at byte 0)");
        assert_eq!(decide(std::slice::from_ref(&f), false), Decision::Refuse { reasons: f.reason(), always: false });
    }

    #[test]
    fn decide_refuses_always_before_force_and_reports_what_force_overrode() {
        let swap = Finding::InUse(Use::Swap { device: "sdb1".into() });
        let root = Finding::BacksRoot { device: "vda".into(), root: "/ is on vda".into() };
        assert_eq!(decide(&[], false), Decision::Write { overridden: vec![] });
        assert_eq!(
            decide(std::slice::from_ref(&swap), false),
            Decision::Refuse { reasons: swap.reason(), always: false }
        );
        assert_eq!(decide(std::slice::from_ref(&swap), true), Decision::Write { overridden: vec![swap.reason()] });
        for force in [false, true] {
            let Decision::Refuse { reasons, always } = decide(&[swap.clone(), root.clone()], force) else {
                panic!("the root device is refused even with --force={force}")
            };
            assert!(always && reasons.starts_with(&root.reason()), "{reasons}");
            assert_eq!(reasons.contains(&swap.reason()), !force, "{reasons}");
        }
    }
    #[test]
    fn permit_refuses_unless_forced_but_root_always() {
        let t = fake_target(1 << 20, 512, 0).unwrap();
        let ext = Signature { kind: SignatureKind::Ext, offset: 1080, detail: "magic 0xEF53 at byte 1080".into() };
        let sig = Finding::Signature { signature: ext, overwritten: true };
        let insp = |findings: Vec<Finding>, len| Inspection { target: t.clone(), image_len: len, findings };
        let e = insp(vec![sig.clone()], 4096).permit(false).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("ext2/3/4 file system (magic 0xEF53 at byte 1080)") && s.contains("`force`"), "{s}");
        let p = insp(vec![sig.clone()], 4096).permit(true).unwrap();
        assert_eq!((p.image_len(), p.target().base()), (4096, ByteOffset(0)));
        let root = Finding::BacksRoot { device: "loop9".into(), root: "/ is on loop9".into() };
        for force in [false, true] {
            let e = insp(vec![sig.clone(), root.clone()], 4096).permit(force).unwrap_err();
            assert!(e.to_string().contains("backs the root file system"), "{e}");
            assert!(e.to_string().contains("never written, not even with `force`"), "{e}");
        }
        let e = insp(vec![], (1 << 20) + 4096).permit(true).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("1052672 bytes") && s.contains("1048576 bytes"), "{s}");
        // The plan names the device, the byte and LBA range, and each finding with its verdict.
        let plan = insp(vec![sig.clone(), root], 8192).to_string();
        for want in [
            "raw:/dev/fake: /dev/fake (loop9, 7:9), loop device over /x.img",
            "writes 8192 bytes",
            "LBA 0..16 of 2048 × 512 B",
            "[refused without `force`]",
            "[refused, even with `force`]",
        ] {
            assert!(plan.contains(want), "{want:?} in {plan}");
        }
        // The binary's plan names its flag.
        let plan = insp(vec![sig.clone()], 8192);
        assert!(plan.plan("--force").to_string().contains("[refused without --force]"), "{}", plan.plan("--force"));
        assert!(insp(vec![], 4096).to_string().contains("found: nothing"));
    }
}
