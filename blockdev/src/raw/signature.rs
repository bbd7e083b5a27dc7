//! Partition-table, file-system, volume and image signatures in a device's first bytes, at the
//! offsets util-linux's libblkid probers read them (`libblkid/src/superblocks/*.c`,
//! `libblkid/src/partitions/*.c`).

use std::fmt;

use picchio_core::format::Superblock;

/// Bytes read from the start of a region when looking for signatures: covers the uberblock ring of
/// the first ZFS vdev label (128..256 KiB), btrfs (64 KiB + 64), ReiserFS (64 KiB + 52), ISO 9660
/// (32 KiB + 1) and swap on 64 KiB pages. What [`scan_signatures`] needs to see everything it knows;
/// other targets (an NVMe namespace through the user-space driver) read this much too. (256 KiB
/// since ZFS was added; it was 128 KiB.)
pub const HEAD_BYTES: u64 = 256 << 10;

/// ZFS: the uberblock array of a vdev label starts 128 KiB into the label (label 0 is at byte 0),
/// 128 slots of at least 1 KiB, each starting with `ub_magic` = `0x00bab10c` in the pool's byte
/// order (libblkid `superblocks/zfs.c`: `VDEV_LABEL_UBERBLOCK`, `UBERBLOCK_SIZE`, `UBERBLOCK_MAGIC`).
const ZFS_UBERBLOCKS: usize = 128 << 10;
const ZFS_UBERBLOCK_SIZE: usize = 1024;
const ZFS_UBERBLOCK_COUNT: usize = 128;
const ZFS_UBERBLOCK_MAGIC: u64 = 0x00ba_b10c;

/// bcache: the superblock is at 4 KiB; its 16-byte magic follows `csum`, `offset` and `version`
/// (three u64s), at 4 KiB + 24 (libblkid `superblocks/bcache.c`: `BCACHE_SB_OFF`, `bcache_magic`).
const BCACHE_MAGIC: [u8; 16] =
    [0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca, 0x82, 0x65, 0xf5, 0x7f, 0x48, 0xba, 0x6d, 0x81];

/// The kind of a [`Signature`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SignatureKind {
    /// An MBR (DOS) partition table with at least one used entry.
    Mbr,
    /// A GPT header (`"EFI PART"` at LBA 1).
    Gpt,
    /// ext2/3/4.
    Ext,
    /// XFS.
    Xfs,
    /// btrfs.
    Btrfs,
    /// F2FS.
    F2fs,
    /// A swap area.
    Swap,
    /// LUKS encryption.
    Luks,
    /// FAT12/16/32.
    Vfat,
    /// exFAT.
    Exfat,
    /// NTFS.
    Ntfs,
    /// An LVM2 physical volume.
    Lvm2,
    /// An md RAID member (superblock 1.1 or 1.2).
    MdRaid,
    /// ISO 9660.
    Iso9660,
    /// squashfs.
    Squashfs,
    /// A ZFS pool member (vdev label uberblocks).
    Zfs,
    /// A bcache backing or cache device.
    Bcache,
    /// ReiserFS (3.5, 3.6 or with a journal device).
    Reiserfs,
    /// JFS.
    Jfs,
    /// NILFS2.
    Nilfs2,
    /// A BitLocker encrypted volume.
    BitLocker,
    /// A Ceph BlueStore OSD device.
    CephBluestore,
    /// A `.picchioflat` image (ours: overwriting it is not a refusal).
    Picchioflat,
}

impl SignatureKind {
    /// A human name, as messages use it.
    pub fn name(self) -> &'static str {
        match self {
            SignatureKind::Mbr => "MBR partition table",
            SignatureKind::Gpt => "GPT partition table",
            SignatureKind::Ext => "ext2/3/4 file system",
            SignatureKind::Xfs => "XFS file system",
            SignatureKind::Btrfs => "btrfs file system",
            SignatureKind::F2fs => "F2FS file system",
            SignatureKind::Swap => "swap area",
            SignatureKind::Luks => "LUKS encrypted volume",
            SignatureKind::Vfat => "FAT (vfat) file system",
            SignatureKind::Exfat => "exFAT file system",
            SignatureKind::Ntfs => "NTFS file system",
            SignatureKind::Lvm2 => "LVM2 physical volume",
            SignatureKind::MdRaid => "md RAID member",
            SignatureKind::Iso9660 => "ISO 9660 file system",
            SignatureKind::Squashfs => "squashfs file system",
            SignatureKind::Zfs => "ZFS pool member",
            SignatureKind::Bcache => "bcache device",
            SignatureKind::Reiserfs => "ReiserFS file system",
            SignatureKind::Jfs => "JFS file system",
            SignatureKind::Nilfs2 => "NILFS2 file system",
            SignatureKind::BitLocker => "BitLocker encrypted volume",
            SignatureKind::CephBluestore => "Ceph BlueStore device",
            SignatureKind::Picchioflat => ".picchioflat image",
        }
    }
}

/// A signature found on a device: what, at which byte, and the evidence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signature {
    /// What it is.
    pub kind: SignatureKind,
    /// Byte offset of the magic on the device.
    pub offset: u64,
    /// The evidence, e.g. `magic 0xEF53 at byte 1080`.
    pub detail: String,
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.kind.name(), self.detail)
    }
}

/// Looks for partition tables, file systems, volumes and images in `head`, the bytes of a device
/// from byte `start` on. Offsets in the result are device byte offsets.
///
/// Checked: MBR (`0x55AA` at 510 with a used entry) and GPT (`"EFI PART"` at 512 or 4096, LBA 1 of
/// either block size), ext2/3/4 (`0xEF53` at 1080), XFS (`"XFSB"` at 0), btrfs (`"_BHRfS_M"` at
/// 65600), F2FS (`0xF2F52010` at 1024), swap (`"SWAPSPACE2"` or `"SWAP-SPACE"` 10 bytes before the
/// end of a 4, 8, 16 or 64 KiB page), LUKS (`"LUKS\xba\xbe"` at 0, or the LUKS2 copy at 16 KiB), FAT
/// (`"FAT12   "`, `"FAT16   "` at 54 or `"FAT32   "` at 82, with `0x55AA` at 510), exFAT and NTFS
/// (OEM name at 3), LVM2 (`"LABELONE"` in one of the first four sectors), md RAID 1.1/1.2 (magic
/// `0xA92B4EFC` at 0 or 4096), ISO 9660 (`"CD001"` at 32769), squashfs (`"hsqs"` at 0), ZFS
/// (uberblock magic `0x00bab10c`, either byte order, in a 1 KiB slot of 128..256 KiB), bcache (its
/// magic at 4096 + 24), ReiserFS (`"ReIsErFs"`, `"ReIsEr2Fs"` or `"ReIsEr3Fs"` at 65536 + 52, or the
/// 3.5 layout at 8192 + 52), JFS (`"JFS1"` at 32768), NILFS2 (`0x3434` at 1024 + 6), BitLocker
/// (`"-FVE-FS-"` at 3), Ceph BlueStore (`"bluestore block device"` at 0), and `.picchioflat`
/// (`"PCHIOFL1"` at 0). Offsets follow util-linux's libblkid probers.
pub fn scan_signatures(head: &[u8], start: u64) -> Vec<Signature> {
    let at = |o: usize, magic: &[u8]| head.get(o..o + magic.len()) == Some(magic);
    let byte = |o: usize| start + o as u64;
    // (kind, offset in head, detail)
    let mut found: Vec<(SignatureKind, usize, String)> = Vec::new();
    let boot_sig = at(510, &[0x55, 0xAA]);
    let fat = boot_sig && (at(54, b"FAT12   ") || at(54, b"FAT16   ") || at(82, b"FAT32   "));
    let exfat = at(3, b"EXFAT   ");
    let ntfs = at(3, b"NTFS    ");
    // A FAT, exFAT or NTFS boot sector also ends in 0x55AA, with boot code where MBR entries would be.
    if boot_sig && !fat && !exfat && !ntfs {
        let used: Vec<u8> = (0..4).map(|i| head[446 + 16 * i + 4]).filter(|&t| t != 0).collect();
        if !used.is_empty() {
            let types = used.iter().map(|t| format!("{t:#04x}")).collect::<Vec<_>>().join(", ");
            let protective = if used.contains(&0xEE) { ", protective MBR of a GPT disk" } else { "" };
            let detail =
                format!("0x55AA at byte {}, {} used entries of type {types}{protective}", byte(510), used.len());
            found.push((SignatureKind::Mbr, 510, detail));
        }
    }
    // ext: s_magic at 1024 + 56; s_log_block_size (at 1024 + 24) is at most 6 (64 KiB blocks).
    let ext_log_bs = head.get(1048..1052).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    if at(1080, &[0x53, 0xEF]) && ext_log_bs.is_some_and(|l| l <= 6) {
        found.push((SignatureKind::Ext, 1080, format!("magic 0xEF53 at byte {}", byte(1080))));
    }
    if fat {
        let o = if at(82, b"FAT32   ") { 82 } else { 54 };
        found.push((
            SignatureKind::Vfat,
            o,
            format!("\"FAT..   \" at byte {} and 0x55AA at byte {}", byte(o), byte(510)),
        ));
    }
    let swap_pages = [4096usize, 8192, 16384, 65536];
    let plain: Vec<(SignatureKind, usize, &[u8], &str)> = [
        (SignatureKind::Gpt, 512, &b"EFI PART"[..], "\"EFI PART\""),
        (SignatureKind::Gpt, 4096, b"EFI PART", "\"EFI PART\""),
        (SignatureKind::Xfs, 0, b"XFSB", "\"XFSB\""),
        (SignatureKind::Btrfs, 65600, b"_BHRfS_M", "\"_BHRfS_M\""),
        (SignatureKind::F2fs, 1024, &[0x10, 0x20, 0xF5, 0xF2], "magic 0xF2F52010"),
        (SignatureKind::Luks, 0, b"LUKS\xba\xbe", "\"LUKS\\xba\\xbe\""),
        (SignatureKind::Luks, 16384, b"SKUL\xba\xbe", "LUKS2 secondary header \"SKUL\\xba\\xbe\""),
        (SignatureKind::Exfat, 3, b"EXFAT   ", "\"EXFAT   \""),
        (SignatureKind::Ntfs, 3, b"NTFS    ", "\"NTFS    \""),
        (SignatureKind::Lvm2, 0, b"LABELONE", "\"LABELONE\""),
        (SignatureKind::Lvm2, 512, b"LABELONE", "\"LABELONE\""),
        (SignatureKind::Lvm2, 1024, b"LABELONE", "\"LABELONE\""),
        (SignatureKind::Lvm2, 1536, b"LABELONE", "\"LABELONE\""),
        (SignatureKind::MdRaid, 0, &[0xFC, 0x4E, 0x2B, 0xA9], "magic 0xA92B4EFC"),
        (SignatureKind::MdRaid, 4096, &[0xFC, 0x4E, 0x2B, 0xA9], "magic 0xA92B4EFC"),
        (SignatureKind::Iso9660, 32769, b"CD001", "\"CD001\""),
        (SignatureKind::Squashfs, 0, b"hsqs", "\"hsqs\""),
        (SignatureKind::Bcache, 4096 + 24, &BCACHE_MAGIC, "bcache magic c68573f6-4e1a-45ca-8265-f57f48ba6d81"),
        (SignatureKind::Reiserfs, 65536 + 52, b"ReIsErFs", "\"ReIsErFs\""),
        (SignatureKind::Reiserfs, 65536 + 52, b"ReIsEr2Fs", "\"ReIsEr2Fs\""),
        (SignatureKind::Reiserfs, 65536 + 52, b"ReIsEr3Fs", "\"ReIsEr3Fs\""),
        (SignatureKind::Reiserfs, 8192 + 52, b"ReIsErFs", "\"ReIsErFs\""),
        (SignatureKind::Jfs, 32768, b"JFS1", "\"JFS1\""),
        (SignatureKind::Nilfs2, 1024 + 6, &[0x34, 0x34], "magic 0x3434"),
        (SignatureKind::BitLocker, 3, b"-FVE-FS-", "\"-FVE-FS-\""),
        (SignatureKind::CephBluestore, 0, b"bluestore block device", "\"bluestore block device\""),
    ]
    .into_iter()
    .chain(swap_pages.iter().flat_map(|&p| {
        [
            (SignatureKind::Swap, p - 10, &b"SWAPSPACE2"[..], "\"SWAPSPACE2\""),
            (SignatureKind::Swap, p - 10, b"SWAP-SPACE", "\"SWAP-SPACE\""),
        ]
    }))
    .collect();
    for (kind, o, magic, shown) in plain {
        if at(o, magic) {
            found.push((kind, o, format!("{shown} at byte {}", byte(o))));
        }
    }
    let zfs: Vec<usize> = (0..ZFS_UBERBLOCK_COUNT)
        .map(|i| ZFS_UBERBLOCKS + i * ZFS_UBERBLOCK_SIZE)
        .filter(|&o| {
            head.get(o..o + 8).is_some_and(|b| {
                let b: [u8; 8] = b.try_into().expect("8 bytes");
                u64::from_le_bytes(b) == ZFS_UBERBLOCK_MAGIC || u64::from_be_bytes(b) == ZFS_UBERBLOCK_MAGIC
            })
        })
        .collect();
    if let Some(&first) = zfs.first() {
        let detail = format!(
            "uberblock magic 0x00bab10c at byte {} ({} of {ZFS_UBERBLOCK_COUNT} slots of the first vdev label)",
            byte(first),
            zfs.len()
        );
        found.push((SignatureKind::Zfs, first, detail));
    }
    if at(0, b"PCHIOFL1") {
        let what = match Superblock::decode(head, "", u64::MAX) {
            Ok(sb) => format!(
                "version {}, {} entries, hidden {}, {} layers × {} experts",
                sb.version, sb.n_entries, sb.hidden, sb.n_layers, sb.n_experts
            ),
            Err(_) => "superblock not decodable".into(),
        };
        found.push((SignatureKind::Picchioflat, 0, format!("\"PCHIOFL1\" at byte {start}, {what}")));
    }
    found.sort_by_key(|f| (f.0, f.1));
    found.into_iter().map(|(kind, o, detail)| Signature { kind, offset: byte(o), detail }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::{Finding, Verdict};

    fn head() -> Vec<u8> {
        vec![0u8; HEAD_BYTES as usize]
    }

    fn kinds(sigs: &[Signature]) -> Vec<SignatureKind> {
        sigs.iter().map(|s| s.kind).collect()
    }

    #[test]
    fn blank_and_own_images() {
        assert!(scan_signatures(&head(), 0).is_empty());
        // A bare 0x55AA with four empty entries is not a partition table.
        let mut h = head();
        h[510..512].copy_from_slice(&[0x55, 0xAA]);
        assert!(scan_signatures(&h, 0).is_empty());
        let dims = picchio_core::loader::StoreDims { hidden: 64, n_layers: 3, n_experts: 16, topk: 4, moe_inter: 128 };
        let sb = Superblock::layout(dims, 48, [0; 32], None);
        let mut h = head();
        h[..4096].copy_from_slice(&sb.encode());
        let s = scan_signatures(&h, 1 << 20);
        assert_eq!(kinds(&s), [SignatureKind::Picchioflat]);
        assert_eq!(s[0].offset, 1 << 20);
        assert!(s[0].detail.contains("48 entries") && s[0].detail.contains("3 layers × 16 experts"), "{}", s[0]);
        let f = Finding::Signature { signature: s[0].clone(), overwritten: true };
        assert_eq!(f.verdict(), Verdict::Note);
        assert!(f.to_string().contains("not a reason to refuse"), "{f}");
    }

    #[test]
    fn every_signature_at_its_documented_offset() {
        type Put = fn(&mut [u8]);
        let cases: Vec<(SignatureKind, u64, Put)> = vec![
            (SignatureKind::Mbr, 510, |h| {
                h[446 + 4] = 0x83;
                h[510..512].copy_from_slice(&[0x55, 0xAA]);
            }),
            (SignatureKind::Gpt, 512, |h| h[512..520].copy_from_slice(b"EFI PART")),
            (SignatureKind::Gpt, 4096, |h| h[4096..4104].copy_from_slice(b"EFI PART")),
            (SignatureKind::Ext, 1080, |h| {
                h[1080..1082].copy_from_slice(&[0x53, 0xEF]);
                h[1048] = 2;
            }),
            (SignatureKind::Xfs, 0, |h| h[..4].copy_from_slice(b"XFSB")),
            (SignatureKind::Btrfs, 65600, |h| h[65600..65608].copy_from_slice(b"_BHRfS_M")),
            (SignatureKind::F2fs, 1024, |h| h[1024..1028].copy_from_slice(&[0x10, 0x20, 0xF5, 0xF2])),
            (SignatureKind::Swap, 4086, |h| h[4086..4096].copy_from_slice(b"SWAPSPACE2")),
            (SignatureKind::Swap, 65526, |h| h[65526..65536].copy_from_slice(b"SWAP-SPACE")),
            (SignatureKind::Luks, 0, |h| h[..6].copy_from_slice(b"LUKS\xba\xbe")),
            (SignatureKind::Vfat, 82, |h| {
                h[82..90].copy_from_slice(b"FAT32   ");
                h[446 + 4] = 0x33; // boot code, not a partition entry
                h[510..512].copy_from_slice(&[0x55, 0xAA]);
            }),
            (SignatureKind::Vfat, 54, |h| {
                h[54..62].copy_from_slice(b"FAT16   ");
                h[510..512].copy_from_slice(&[0x55, 0xAA]);
            }),
            (SignatureKind::Ntfs, 3, |h| {
                h[3..11].copy_from_slice(b"NTFS    ");
                h[446 + 4] = 0x07;
                h[510..512].copy_from_slice(&[0x55, 0xAA]);
            }),
            (SignatureKind::Exfat, 3, |h| h[3..11].copy_from_slice(b"EXFAT   ")),
            (SignatureKind::Lvm2, 512, |h| h[512..520].copy_from_slice(b"LABELONE")),
            (SignatureKind::MdRaid, 4096, |h| h[4096..4100].copy_from_slice(&[0xFC, 0x4E, 0x2B, 0xA9])),
            (SignatureKind::Iso9660, 32769, |h| h[32769..32774].copy_from_slice(b"CD001")),
            (SignatureKind::Squashfs, 0, |h| h[..4].copy_from_slice(b"hsqs")),
            (SignatureKind::Zfs, 128 << 10, |h| {
                h[128 << 10..(128 << 10) + 8].copy_from_slice(&0x00bab10cu64.to_le_bytes())
            }),
            (SignatureKind::Zfs, 200 << 10, |h| {
                h[200 << 10..(200 << 10) + 8].copy_from_slice(&0x00bab10cu64.to_be_bytes())
            }),
            (SignatureKind::Bcache, 4120, |h| h[4120..4136].copy_from_slice(&BCACHE_MAGIC)),
            (SignatureKind::Reiserfs, 65588, |h| h[65588..65597].copy_from_slice(b"ReIsEr2Fs")),
            (SignatureKind::Reiserfs, 8244, |h| h[8244..8252].copy_from_slice(b"ReIsErFs")),
            (SignatureKind::Jfs, 32768, |h| h[32768..32772].copy_from_slice(b"JFS1")),
            (SignatureKind::Nilfs2, 1030, |h| h[1030..1032].copy_from_slice(&0x3434u16.to_le_bytes())),
            (SignatureKind::BitLocker, 3, |h| h[3..11].copy_from_slice(b"-FVE-FS-")),
            (SignatureKind::CephBluestore, 0, |h| h[..22].copy_from_slice(b"bluestore block device")),
        ];
        for (kind, offset, put) in cases {
            let mut h = head();
            put(&mut h);
            let s = scan_signatures(&h, 0);
            assert_eq!(kinds(&s), [kind], "{kind:?}: {s:?}");
            assert_eq!(s[0].offset, offset, "{kind:?}");
            let f = Finding::Signature { signature: s[0].clone(), overwritten: false };
            assert_eq!(f.verdict(), Verdict::Refuse, "{kind:?}");
            assert!(f.to_string().starts_with(kind.name()), "{f}");
        }
        // ext magic with a nonsense block size is noise, not ext4.
        let mut h = head();
        h[1080..1082].copy_from_slice(&[0x53, 0xEF]);
        h[1048] = 40;
        assert!(scan_signatures(&h, 0).is_empty());
        // A protective MBR says so; a short head (a tiny device) is scanned as far as it goes.
        let mut h = head();
        h[446 + 4] = 0xEE;
        h[510..512].copy_from_slice(&[0x55, 0xAA]);
        h[512..520].copy_from_slice(b"EFI PART");
        let s = scan_signatures(&h[..1024], 0);
        assert_eq!(kinds(&s), [SignatureKind::Mbr, SignatureKind::Gpt]);
        assert!(s[0].detail.contains("protective MBR"), "{}", s[0]);
    }
}
