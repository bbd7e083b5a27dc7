//! Controller registers (NVMe base spec §3.1.4, "Controller Properties"), one type per register with
//! the spec's field names. Offsets are byte offsets into BAR0.

/// CAP — Controller Capabilities, offset 0x00, 64 bits (§3.1.4.1).
pub const CAP: usize = 0x00;
/// VS — Version, offset 0x08 (§3.1.4.2).
pub const VS: usize = 0x08;
/// INTMS — Interrupt Mask Set, offset 0x0C.
pub const INTMS: usize = 0x0C;
/// INTMC — Interrupt Mask Clear, offset 0x10.
pub const INTMC: usize = 0x10;
/// CC — Controller Configuration, offset 0x14 (§3.1.4.5).
pub const CC: usize = 0x14;
/// CSTS — Controller Status, offset 0x1C (§3.1.4.6).
pub const CSTS: usize = 0x1C;
/// AQA — Admin Queue Attributes, offset 0x24 (§3.1.4.8).
pub const AQA: usize = 0x24;
/// ASQ — Admin Submission Queue Base Address, offset 0x28, 64 bits (§3.1.4.9).
pub const ASQ: usize = 0x28;
/// ACQ — Admin Completion Queue Base Address, offset 0x30, 64 bits (§3.1.4.10).
pub const ACQ: usize = 0x30;
/// First doorbell register (SQ 0 Tail), offset 0x1000 (§3.1.4.21).
pub const DOORBELL_BASE: usize = 0x1000;

/// Byte offset of the Submission Queue `qid` Tail Doorbell: `0x1000 + (2 qid) × (4 << CAP.DSTRD)`.
pub const fn sq_tail_doorbell(qid: u16, dstrd: u8) -> usize {
    DOORBELL_BASE + (2 * qid as usize) * (4usize << dstrd)
}

/// Byte offset of the Completion Queue `qid` Head Doorbell: `0x1000 + (2 qid + 1) × (4 << CAP.DSTRD)`.
pub const fn cq_head_doorbell(qid: u16, dstrd: u8) -> usize {
    DOORBELL_BASE + (2 * qid as usize + 1) * (4usize << dstrd)
}

const fn bits64(v: u64, lo: u32, width: u32) -> u64 {
    (v >> lo) & ((1u64 << width) - 1)
}

const fn bits32(v: u32, lo: u32, width: u32) -> u32 {
    (v >> lo) & ((1u32 << width) - 1)
}

const fn set32(v: u32, lo: u32, width: u32, x: u32) -> u32 {
    let mask = ((1u32 << width) - 1) << lo;
    (v & !mask) | ((x << lo) & mask)
}

/// The bit fields of a register type `$reg` whose value is read with `$bits` (`bits32`, `bits64`):
/// per field, a getter of the spec's name returning bits `lo .. lo + width` (`bool` for a flag),
/// and for a field given a setter, `with_…` returning the register with the field replaced.
macro_rules! reg_fields {
    ($reg:ident, $bits:ident {
        $( $(#[$doc:meta])* $name:ident: $t:ident = $lo:literal, $width:literal $(, $setter:ident($arg:ty))?; )*
    }) => {
        impl $reg {
            $(
                $(#[$doc])*
                pub const fn $name(self) -> $t {
                    reg_fields!(@get $t, $bits(self.0, $lo, $width))
                }
                $(
                    #[doc = concat!("Sets [`", stringify!($reg), "::", stringify!($name), "`].")]
                    pub const fn $setter(self, v: $arg) -> $reg {
                        $reg(set32(self.0, $lo, $width, v as u32))
                    }
                )?
            )*
        }
    };
    (@get bool, $v:expr) => {
        $v != 0
    };
    (@get $t:ident, $v:expr) => {
        $v as $t
    };
}

/// CAP — Controller Capabilities (§3.1.4.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Cap(pub u64);

reg_fields!(Cap, bits64 {
    /// MQES, bits 15:0: Maximum Queue Entries Supported, 0-based.
    mqes: u16 = 0, 16;
    /// CQR, bit 16: Contiguous Queues Required.
    cqr: bool = 16, 1;
    /// AMS, bits 18:17: Arbitration Mechanism Supported.
    ams: u8 = 17, 2;
    /// TO, bits 31:24: worst-case time for CSTS.RDY to change after CC.EN changes, in 500 ms units.
    to: u8 = 24, 8;
    /// DSTRD, bits 35:32: Doorbell Stride, the stride is `4 << DSTRD` bytes.
    dstrd: u8 = 32, 4;
    /// NSSRS, bit 36: NVM Subsystem Reset Supported.
    nssrs: bool = 36, 1;
    /// CSS, bits 44:37: Command Sets Supported (bit 0 of the field: NVM command set).
    css: u8 = 37, 8;
    /// BPS, bit 45: Boot Partition Support.
    bps: bool = 45, 1;
    /// MPSMIN, bits 51:48: minimum memory page size is `2^(12 + MPSMIN)`.
    mpsmin: u8 = 48, 4;
    /// MPSMAX, bits 55:52: maximum memory page size is `2^(12 + MPSMAX)`.
    mpsmax: u8 = 52, 4;
});

impl Cap {
    /// TO as a duration (at least 500 ms, so a 0 field still waits).
    pub fn timeout(self) -> std::time::Duration {
        std::time::Duration::from_millis(500 * u64::from(self.to().max(1)))
    }
    /// Builds a CAP value (used by the sim model).
    pub const fn build(mqes: u16, cqr: bool, to: u8, dstrd: u8, css: u8, mpsmin: u8, mpsmax: u8) -> Cap {
        Cap((mqes as u64)
            | ((cqr as u64) << 16)
            | ((to as u64) << 24)
            | (((dstrd & 0xF) as u64) << 32)
            | ((css as u64) << 37)
            | (((mpsmin & 0xF) as u64) << 48)
            | (((mpsmax & 0xF) as u64) << 52))
    }
}

/// VS — Version (§3.1.4.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Vs(pub u32);

reg_fields!(Vs, bits32 {
    /// MJR, bits 31:16: major version.
    mjr: u16 = 16, 16;
    /// MNR, bits 15:8: minor version.
    mnr: u8 = 8, 8;
    /// TER, bits 7:0: tertiary version.
    ter: u8 = 0, 8;
});

impl std::fmt::Display for Vs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.mjr(), self.mnr(), self.ter())
    }
}

/// CC.SHN values (§3.1.4.5): shutdown notification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Shn {
    /// 00b: no notification.
    None = 0,
    /// 01b: normal shutdown.
    Normal = 1,
    /// 10b: abrupt shutdown.
    Abrupt = 2,
}

/// CC — Controller Configuration (§3.1.4.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Cc(pub u32);

reg_fields!(Cc, bits32 {
    /// EN, bit 0: Enable.
    en: bool = 0, 1, with_en(bool);
    /// CSS, bits 6:4: I/O Command Set Selected (000b: NVM).
    css: u8 = 4, 3, with_css(u8);
    /// MPS, bits 10:7: Memory Page Size is `2^(12 + MPS)`.
    mps: u8 = 7, 4, with_mps(u8);
    /// AMS, bits 13:11: Arbitration Mechanism Selected (000b: round robin).
    ams: u8 = 11, 3;
    /// SHN, bits 15:14: Shutdown Notification.
    shn: u8 = 14, 2, with_shn(Shn);
    /// IOSQES, bits 19:16: I/O Submission Queue Entry Size, `2^IOSQES` bytes (6 → 64 B).
    iosqes: u8 = 16, 4, with_iosqes(u8);
    /// IOCQES, bits 23:20: I/O Completion Queue Entry Size, `2^IOCQES` bytes (4 → 16 B).
    iocqes: u8 = 20, 4, with_iocqes(u8);
});

/// CSTS.SHST values (§3.1.4.6): shutdown status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Shst {
    /// 00b: normal operation.
    Normal = 0,
    /// 01b: shutdown processing occurring.
    Occurring = 1,
    /// 10b: shutdown processing complete.
    Complete = 2,
}

/// CSTS — Controller Status (§3.1.4.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Csts(pub u32);

reg_fields!(Csts, bits32 {
    /// RDY, bit 0: Ready.
    rdy: bool = 0, 1;
    /// CFS, bit 1: Controller Fatal Status.
    cfs: bool = 1, 1;
    /// SHST, bits 3:2: Shutdown Status (raw).
    shst: u8 = 2, 2;
    /// NSSRO, bit 4: NVM Subsystem Reset Occurred.
    nssro: bool = 4, 1;
    /// PP, bit 5: Processing Paused.
    pp: bool = 5, 1;
});

impl Csts {
    /// Builds a CSTS value (used by the sim model).
    pub const fn build(rdy: bool, cfs: bool, shst: Shst) -> Csts {
        Csts((rdy as u32) | ((cfs as u32) << 1) | ((shst as u32) << 2))
    }
}

/// AQA — Admin Queue Attributes (§3.1.4.8). Sizes are 0-based.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Aqa(pub u32);

reg_fields!(Aqa, bits32 {
    /// ASQS, bits 11:0: Admin Submission Queue Size, 0-based.
    asqs: u16 = 0, 12;
    /// ACQS, bits 27:16: Admin Completion Queue Size, 0-based.
    acqs: u16 = 16, 12;
});

impl Aqa {
    /// Builds AQA from entry counts (not 0-based; each 2..=4096).
    pub const fn from_entries(sq_entries: u16, cq_entries: u16) -> Aqa {
        Aqa(set32(set32(0, 0, 12, sq_entries as u32 - 1), 16, 12, cq_entries as u32 - 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_offsets_match_spec() {
        assert_eq!((CAP, VS, INTMS, INTMC, CC, CSTS, AQA, ASQ, ACQ), (0, 8, 0xC, 0x10, 0x14, 0x1C, 0x24, 0x28, 0x30));
        assert_eq!(sq_tail_doorbell(0, 0), 0x1000);
        assert_eq!(cq_head_doorbell(0, 0), 0x1004);
        assert_eq!(sq_tail_doorbell(1, 0), 0x1008);
        assert_eq!(cq_head_doorbell(1, 0), 0x100C);
        assert_eq!(sq_tail_doorbell(1, 2), 0x1000 + 2 * 16);
        assert_eq!(cq_head_doorbell(3, 1), 0x1000 + 7 * 8);
    }

    #[test]
    fn cap_fields() {
        // The QEMU 7.2 nvme CAP from the VFIO notes.
        let cap = Cap(0x0040_1820_0f01_07ff);
        assert_eq!(cap.mqes(), 0x7ff);
        assert!(cap.cqr());
        assert_eq!(cap.to(), 0x0f);
        assert_eq!(cap.dstrd(), 0);
        assert_eq!(cap.css(), 0xC1);
        assert_eq!(cap.mpsmin(), 0);
        assert_eq!(cap.mpsmax(), 4);
        let b = Cap::build(1023, true, 20, 2, 1, 0, 4);
        assert_eq!(
            (b.mqes(), b.cqr(), b.to(), b.dstrd(), b.css(), b.mpsmin(), b.mpsmax()),
            (1023, true, 20, 2, 1, 0, 4)
        );
        assert_eq!(b.timeout(), std::time::Duration::from_secs(10));
    }

    #[test]
    fn cc_csts_aqa_bits() {
        let cc = Cc(0).with_en(true).with_mps(0).with_iosqes(6).with_iocqes(4).with_shn(Shn::Normal);
        assert_eq!(cc.0, 1 | (6 << 16) | (4 << 20) | (1 << 14));
        assert_eq!((cc.iosqes(), cc.iocqes(), cc.shn(), cc.en()), (6, 4, 1, true));
        assert_eq!(Cc(0).with_mps(3).0, 3 << 7);
        assert_eq!(Cc(0).with_css(7).0, 7 << 4);
        let csts = Csts::build(true, true, Shst::Complete);
        assert_eq!(csts.0, 0b1011);
        assert!(csts.rdy() && csts.cfs() && csts.shst() == 2);
        assert_eq!(Aqa::from_entries(32, 64).0, 31 | (63 << 16));
        assert_eq!(Vs(0x0001_0400).to_string(), "1.4.0");
    }
}
