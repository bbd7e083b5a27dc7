//! Identify data structures (§5.17.2): the fields of the Identify Controller (CNS 01h) and Identify
//! Namespace (CNS 00h, NVM command set spec §4.1.5.1) pages this driver uses, parsed from 4096 bytes.

/// Byte offsets in the Identify Controller data structure.
pub mod ctrl_off {
    /// VID, PCI Vendor ID, bytes 01:00.
    pub const VID: usize = 0;
    /// SSVID, PCI Subsystem Vendor ID, bytes 03:02.
    pub const SSVID: usize = 2;
    /// SN, Serial Number, bytes 23:04 (ASCII, space padded).
    pub const SN: usize = 4;
    /// MN, Model Number, bytes 63:24.
    pub const MN: usize = 24;
    /// FR, Firmware Revision, bytes 71:64.
    pub const FR: usize = 64;
    /// MDTS, Maximum Data Transfer Size, byte 77 (power of two in units of CAP.MPSMIN; 0 = no limit).
    pub const MDTS: usize = 77;
    /// CNTLID, Controller ID, bytes 79:78.
    pub const CNTLID: usize = 78;
    /// VER, Version, bytes 83:80.
    pub const VER: usize = 80;
    /// SQES, Submission Queue Entry Size, byte 512.
    pub const SQES: usize = 512;
    /// CQES, Completion Queue Entry Size, byte 513.
    pub const CQES: usize = 513;
    /// NN, Number of Namespaces, bytes 519:516.
    pub const NN: usize = 516;
}

/// Byte offsets in the Identify Namespace data structure.
pub mod ns_off {
    /// NSZE, Namespace Size in logical blocks, bytes 07:00.
    pub const NSZE: usize = 0;
    /// NCAP, Namespace Capacity, bytes 15:08.
    pub const NCAP: usize = 8;
    /// NUSE, Namespace Utilization, bytes 23:16.
    pub const NUSE: usize = 16;
    /// NLBAF, Number of LBA Formats (0-based), byte 25.
    pub const NLBAF: usize = 25;
    /// FLBAS, Formatted LBA Size, byte 26 (bits 3:0 index, bit 4 extended metadata, bits 6:5 index MSBs).
    pub const FLBAS: usize = 26;
    /// LBAF0, the first LBA Format descriptor, bytes 131:128; LBAF n at 128 + 4n.
    pub const LBAF0: usize = 128;
}

fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn le64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}
fn ascii(b: &[u8]) -> String {
    String::from_utf8_lossy(b).trim_end_matches([' ', '\0']).to_string()
}

/// The Identify Controller fields the driver uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentifyController {
    /// VID, PCI Vendor ID.
    pub vid: u16,
    /// SN, serial number (trailing spaces trimmed).
    pub sn: String,
    /// MN, model number.
    pub mn: String,
    /// FR, firmware revision.
    pub fr: String,
    /// MDTS, log2 of the maximum transfer in units of the minimum page size (0 = unlimited).
    pub mdts: u8,
    /// CNTLID.
    pub cntlid: u16,
    /// SQES (bits 3:0 required, 7:4 maximum, log2 bytes).
    pub sqes: u8,
    /// CQES.
    pub cqes: u8,
    /// NN, number of namespaces (the largest valid NSID).
    pub nn: u32,
}

impl IdentifyController {
    /// Parses a 4096-byte Identify Controller page.
    pub fn parse(b: &[u8]) -> IdentifyController {
        use ctrl_off::*;
        IdentifyController {
            vid: le16(b, VID),
            sn: ascii(&b[SN..SN + 20]),
            mn: ascii(&b[MN..MN + 40]),
            fr: ascii(&b[FR..FR + 8]),
            mdts: b[MDTS],
            cntlid: le16(b, CNTLID),
            sqes: b[SQES],
            cqes: b[CQES],
            nn: le32(b, NN),
        }
    }
    /// Maximum transfer in bytes given CAP.MPSMIN's page size (`None` when MDTS is 0, no limit).
    ///
    /// A limit of `2^MDTS` pages that does not fit a `usize` (MDTS is a whole byte: up to 255) is no
    /// limit either: `None`, never a shift that overflows or wraps to 0 (found while writing the fuzz
    /// target `nvme_identify`, docs/fuzzing.md).
    pub fn max_transfer(&self, min_page: usize) -> Option<usize> {
        if self.mdts == 0 {
            return None;
        }
        1usize.checked_shl(self.mdts.into()).and_then(|pages| min_page.checked_mul(pages))
    }
}

/// One LBA Format descriptor (§ NVM 4.1.5.1, "LBA Format Data Structure").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LbaFormat {
    /// MS, metadata bytes per LBA.
    pub ms: u16,
    /// LBADS, log2 of the LBA data size.
    pub lbads: u8,
    /// RP, relative performance.
    pub rp: u8,
}

impl LbaFormat {
    /// Decodes a 32-bit descriptor: MS bits 15:0, LBADS 23:16, RP 25:24.
    pub const fn from_raw(v: u32) -> LbaFormat {
        LbaFormat { ms: v as u16, lbads: (v >> 16) as u8, rp: ((v >> 24) & 3) as u8 }
    }
    /// Encodes the descriptor.
    pub const fn raw(self) -> u32 {
        self.ms as u32 | ((self.lbads as u32) << 16) | (((self.rp & 3) as u32) << 24)
    }
}

/// The Identify Namespace fields the driver uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentifyNamespace {
    /// NSZE, size in logical blocks.
    pub nsze: u64,
    /// NCAP, capacity in logical blocks.
    pub ncap: u64,
    /// NUSE, utilization in logical blocks.
    pub nuse: u64,
    /// NLBAF (0-based count of the formats).
    pub nlbaf: u8,
    /// FLBAS raw byte.
    pub flbas: u8,
    /// LBAF[0..=NLBAF].
    pub lbaf: Vec<LbaFormat>,
}

impl IdentifyNamespace {
    /// Parses a 4096-byte Identify Namespace page.
    pub fn parse(b: &[u8]) -> IdentifyNamespace {
        use ns_off::*;
        let nlbaf = b[NLBAF];
        let lbaf = (0..=usize::from(nlbaf).min(63)).map(|i| LbaFormat::from_raw(le32(b, LBAF0 + 4 * i))).collect();
        IdentifyNamespace {
            nsze: le64(b, NSZE),
            ncap: le64(b, NCAP),
            nuse: le64(b, NUSE),
            nlbaf,
            flbas: b[FLBAS],
            lbaf,
        }
    }
    /// The index of the format in use: FLBAS bits 3:0, with bits 6:5 as the high bits when NLBAF > 16.
    pub fn format_index(&self) -> usize {
        let lo = usize::from(self.flbas & 0xF);
        if self.nlbaf >= 16 {
            lo | (usize::from((self.flbas >> 5) & 3) << 4)
        } else {
            lo
        }
    }
    /// The format in use, if FLBAS names one that exists.
    pub fn format(&self) -> Option<LbaFormat> {
        self.lbaf.get(self.format_index()).copied()
    }
    /// LBA data size in bytes (`2^LBADS`), if the format is valid (LBADS >= 9).
    pub fn lba_size(&self) -> Option<u32> {
        self.format().filter(|f| (9..32).contains(&f.lbads)).map(|f| 1u32 << f.lbads)
    }
    /// Metadata bytes per LBA of the format in use.
    pub fn metadata_size(&self) -> u16 {
        self.format().map_or(0, |f| f.ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_fields_at_spec_offsets() {
        let mut b = vec![0u8; 4096];
        b[0..2].copy_from_slice(&0x1b36u16.to_le_bytes());
        b[4..24].copy_from_slice(b"deadbeef            ");
        b[24..64].copy_from_slice(format!("{:<40}", "QEMU NVMe Ctrl").as_bytes());
        b[64..72].copy_from_slice(b"7.2.0   ");
        b[77] = 7;
        b[512] = 0x66;
        b[513] = 0x44;
        b[516..520].copy_from_slice(&3u32.to_le_bytes());
        let c = IdentifyController::parse(&b);
        assert_eq!(c.vid, 0x1b36);
        assert_eq!(c.sn, "deadbeef");
        assert_eq!(c.mn, "QEMU NVMe Ctrl");
        assert_eq!(c.fr, "7.2.0");
        assert_eq!((c.mdts, c.sqes, c.cqes, c.nn), (7, 0x66, 0x44, 3));
        assert_eq!(c.max_transfer(4096), Some(512 * 1024));
    }

    #[test]
    fn an_mdts_past_the_address_space_is_no_limit_not_an_overflow() {
        // Regression (found writing the fuzz target nvme_identify): MDTS 52 gave 4096 << 52 = 0
        // bytes (then a zero-sized MDTS split), MDTS 64 and above a shift overflow panic.
        let mut b = vec![0u8; 4096];
        for (mdts, want) in [(51, Some(1usize << 63)), (52, None), (64, None), (255, None)] {
            b[ctrl_off::MDTS] = mdts;
            assert_eq!(IdentifyController::parse(&b).max_transfer(4096), want, "MDTS {mdts}");
        }
        b[ctrl_off::MDTS] = 1;
        assert_eq!(IdentifyController::parse(&b).max_transfer(4096 << 15), Some(1 << 28));
    }

    #[test]
    fn namespace_fields_at_spec_offsets() {
        let mut b = vec![0u8; 4096];
        b[0..8].copy_from_slice(&1000u64.to_le_bytes());
        b[8..16].copy_from_slice(&999u64.to_le_bytes());
        b[25] = 1; // two formats
        b[26] = 1; // use LBAF1
        b[128..132].copy_from_slice(&LbaFormat { ms: 0, lbads: 9, rp: 0 }.raw().to_le_bytes());
        b[132..136].copy_from_slice(&LbaFormat { ms: 8, lbads: 12, rp: 2 }.raw().to_le_bytes());
        let n = IdentifyNamespace::parse(&b);
        assert_eq!((n.nsze, n.ncap, n.nlbaf, n.lbaf.len()), (1000, 999, 1, 2));
        assert_eq!(n.lba_size(), Some(4096));
        assert_eq!(n.metadata_size(), 8);
        assert_eq!(LbaFormat::from_raw(0x0209_0008), LbaFormat { ms: 8, lbads: 9, rp: 2 });
    }
}
