//! Submission Queue Entry (`Command`, 64 B, §4.2) and Completion Queue Entry (`Completion`, 16 B,
//! §4.6), with named dword setters and the opcodes this driver uses.

use super::status::Status;

/// Admin command opcodes (§5, Figure "Opcodes for Admin Commands").
pub mod admin {
    /// Delete I/O Submission Queue.
    pub const DELETE_IO_SQ: u8 = 0x00;
    /// Create I/O Submission Queue.
    pub const CREATE_IO_SQ: u8 = 0x01;
    /// Delete I/O Completion Queue.
    pub const DELETE_IO_CQ: u8 = 0x04;
    /// Create I/O Completion Queue.
    pub const CREATE_IO_CQ: u8 = 0x05;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0A;
    /// Identify CNS 00h: Identify Namespace data structure for the NSID.
    pub const CNS_NAMESPACE: u8 = 0x00;
    /// Identify CNS 01h: Identify Controller data structure.
    pub const CNS_CONTROLLER: u8 = 0x01;
    /// Identify CNS 02h: Active Namespace ID list.
    pub const CNS_ACTIVE_NS_LIST: u8 = 0x02;
    /// Feature Identifier 07h: Number of Queues.
    pub const FID_NUMBER_OF_QUEUES: u8 = 0x07;
}

/// NVM command set opcodes (NVM Command Set spec §3).
pub mod nvm {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
}

/// A logical block address in a namespace (never a byte offset).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lba(pub u64);

/// A Submission Queue Entry (§4.2, "Common Command Format"). Every field little-endian.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Command {
    /// CDW0: OPC bits 7:0, FUSE 9:8, PSDT 15:14, CID 31:16.
    pub cdw0: u32,
    /// NSID, bytes 07:04.
    pub nsid: u32,
    /// CDW2, CDW3 (bytes 15:08).
    pub cdw2: u32,
    /// CDW3.
    pub cdw3: u32,
    /// MPTR, bytes 23:16: metadata pointer.
    pub mptr: u64,
    /// DPTR PRP Entry 1, bytes 31:24.
    pub prp1: u64,
    /// DPTR PRP Entry 2, bytes 39:32.
    pub prp2: u64,
    /// CDW10, bytes 43:40.
    pub cdw10: u32,
    /// CDW11, bytes 47:44.
    pub cdw11: u32,
    /// CDW12, bytes 51:48.
    pub cdw12: u32,
    /// CDW13, bytes 55:52.
    pub cdw13: u32,
    /// CDW14, bytes 59:56.
    pub cdw14: u32,
    /// CDW15, bytes 63:60.
    pub cdw15: u32,
}

const _: () = assert!(std::mem::size_of::<Command>() == 64);
const _: () = assert!(std::mem::align_of::<Command>() == 8);
const _: () = assert!(std::mem::offset_of!(Command, nsid) == 4);
const _: () = assert!(std::mem::offset_of!(Command, mptr) == 16);
const _: () = assert!(std::mem::offset_of!(Command, prp1) == 24);
const _: () = assert!(std::mem::offset_of!(Command, prp2) == 32);
const _: () = assert!(std::mem::offset_of!(Command, cdw10) == 40);
const _: () = assert!(std::mem::offset_of!(Command, cdw15) == 60);

impl Command {
    /// The 64-byte SQE as it goes on the wire or into the SQ: 16 little-endian dwords, CDW0 at byte 0
    /// (base specification §4.2, "Submission Queue Entry"). Used for NVMe/TCP CapsuleCmd PDUs.
    pub fn to_le_bytes(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        let words = [
            self.cdw0,
            self.nsid,
            self.cdw2,
            self.cdw3,
            self.mptr as u32,
            (self.mptr >> 32) as u32,
            self.prp1 as u32,
            (self.prp1 >> 32) as u32,
            self.prp2 as u32,
            (self.prp2 >> 32) as u32,
            self.cdw10,
            self.cdw11,
            self.cdw12,
            self.cdw13,
            self.cdw14,
            self.cdw15,
        ];
        for (i, w) in words.iter().enumerate() {
            b[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    /// A zeroed command with opcode `opc` and command identifier `cid` (PSDT 00b: PRPs).
    pub const fn new(opc: u8, cid: u16) -> Command {
        Command {
            cdw0: opc as u32 | ((cid as u32) << 16),
            nsid: 0,
            cdw2: 0,
            cdw3: 0,
            mptr: 0,
            prp1: 0,
            prp2: 0,
            cdw10: 0,
            cdw11: 0,
            cdw12: 0,
            cdw13: 0,
            cdw14: 0,
            cdw15: 0,
        }
    }
    /// OPC, CDW0 bits 7:0.
    pub const fn opc(&self) -> u8 {
        self.cdw0 as u8
    }
    /// CID, CDW0 bits 31:16.
    pub const fn cid(&self) -> u16 {
        (self.cdw0 >> 16) as u16
    }
    /// PSDT, CDW0 bits 15:14 (00b: PRPs used for this transfer).
    pub const fn psdt(&self) -> u8 {
        ((self.cdw0 >> 14) & 3) as u8
    }
    /// Sets the CID.
    pub fn set_cid(&mut self, cid: u16) {
        self.cdw0 = (self.cdw0 & 0xFFFF) | (u32::from(cid) << 16);
    }

    /// Identify (§5.17): CDW10 CNS bits 7:0; data to `prp1` (one 4 KiB page).
    pub fn identify(cid: u16, cns: u8, nsid: u32, prp1: u64) -> Command {
        let mut c = Command::new(admin::IDENTIFY, cid);
        c.nsid = nsid;
        c.prp1 = prp1;
        c.cdw10 = u32::from(cns);
        c
    }
    /// Create I/O Completion Queue (§5.4): CDW10 QID 15:0, QSIZE 31:16 (0-based); CDW11 PC bit 0,
    /// IEN bit 1, IV 31:16. Physically contiguous, interrupts off (we poll).
    pub fn create_io_cq(cid: u16, qid: u16, entries: u16, prp1: u64) -> Command {
        let mut c = Command::new(admin::CREATE_IO_CQ, cid);
        c.prp1 = prp1;
        c.cdw10 = u32::from(qid) | (u32::from(entries - 1) << 16);
        c.cdw11 = 1; // PC = 1, IEN = 0
        c
    }
    /// Create I/O Submission Queue (§5.5): CDW10 QID, QSIZE; CDW11 PC bit 0, QPRIO 2:1, CQID 31:16.
    pub fn create_io_sq(cid: u16, qid: u16, entries: u16, cqid: u16, prp1: u64) -> Command {
        let mut c = Command::new(admin::CREATE_IO_SQ, cid);
        c.prp1 = prp1;
        c.cdw10 = u32::from(qid) | (u32::from(entries - 1) << 16);
        c.cdw11 = 1 | (u32::from(cqid) << 16);
        c
    }
    /// Delete I/O Submission Queue (§5.7): CDW10 QID.
    pub fn delete_io_sq(cid: u16, qid: u16) -> Command {
        let mut c = Command::new(admin::DELETE_IO_SQ, cid);
        c.cdw10 = u32::from(qid);
        c
    }
    /// Delete I/O Completion Queue (§5.6): CDW10 QID.
    pub fn delete_io_cq(cid: u16, qid: u16) -> Command {
        let mut c = Command::new(admin::DELETE_IO_CQ, cid);
        c.cdw10 = u32::from(qid);
        c
    }
    /// Set Features Number of Queues (§5.27.1.5): CDW10 FID; CDW11 NSQR 15:0, NCQR 31:16 (0-based).
    pub fn set_num_queues(cid: u16, nsq: u16, ncq: u16) -> Command {
        let mut c = Command::new(admin::SET_FEATURES, cid);
        c.cdw10 = u32::from(admin::FID_NUMBER_OF_QUEUES);
        c.cdw11 = u32::from(nsq - 1) | (u32::from(ncq - 1) << 16);
        c
    }
    /// Get Features (§5.15): CDW10 FID bits 7:0, SEL bits 10:8 (000b: current).
    pub fn get_features(cid: u16, fid: u8) -> Command {
        let mut c = Command::new(admin::GET_FEATURES, cid);
        c.cdw10 = u32::from(fid);
        c
    }
    /// Abort (§5.1): CDW10 SQID 15:0, CID 31:16 of the command to abort.
    pub fn abort(cid: u16, sqid: u16, victim: u16) -> Command {
        let mut c = Command::new(admin::ABORT, cid);
        c.cdw10 = u32::from(sqid) | (u32::from(victim) << 16);
        c
    }
    /// NVM Read or Write (NVM spec §3.2.4/§3.2.6): CDW10-11 SLBA, CDW12 NLB bits 15:0 (0-based).
    pub fn rw(opc: u8, cid: u16, nsid: u32, slba: Lba, nlb: u32) -> Command {
        let mut c = Command::new(opc, cid);
        c.nsid = nsid;
        c.set_slba(slba);
        c.set_nlb(nlb);
        c
    }
    /// CDW10-11: SLBA, starting LBA.
    pub fn set_slba(&mut self, slba: Lba) {
        self.cdw10 = slba.0 as u32;
        self.cdw11 = (slba.0 >> 32) as u32;
    }
    /// SLBA from CDW10-11.
    pub const fn slba(&self) -> Lba {
        Lba(self.cdw10 as u64 | ((self.cdw11 as u64) << 32))
    }
    /// CDW12 bits 15:0: NLB, given as a count of blocks (1..=65536), stored 0-based.
    pub fn set_nlb(&mut self, blocks: u32) {
        debug_assert!((1..=65536).contains(&blocks));
        self.cdw12 = (self.cdw12 & !0xFFFF) | (blocks - 1);
    }
    /// Number of logical blocks (CDW12 NLB + 1).
    pub const fn nlb(&self) -> u32 {
        (self.cdw12 & 0xFFFF) + 1
    }
}

/// A Completion Queue Entry (§4.6, "Common Completion Queue Entry").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Completion {
    /// DW0: command specific.
    pub dw0: u32,
    /// DW1: command specific (reserved).
    pub dw1: u32,
    /// DW2 bits 15:0: SQHD, the SQ head pointer.
    pub sqhd: u16,
    /// DW2 bits 31:16: SQID.
    pub sqid: u16,
    /// DW3 bits 15:0: CID.
    pub cid: u16,
    /// DW3 bits 31:16: the Status field, P (phase tag) in bit 0.
    pub status: u16,
}

const _: () = assert!(std::mem::size_of::<Completion>() == 16);
const _: () = assert!(std::mem::offset_of!(Completion, sqhd) == 8);
const _: () = assert!(std::mem::offset_of!(Completion, sqid) == 10);
const _: () = assert!(std::mem::offset_of!(Completion, cid) == 12);
const _: () = assert!(std::mem::offset_of!(Completion, status) == 14);

impl Completion {
    /// Byte offset of the status half-word (with the phase tag) within the entry.
    pub const STATUS_OFFSET: usize = 14;
    /// P, the phase tag.
    pub const fn phase(&self) -> bool {
        self.status & 1 != 0
    }
    /// The status field without the phase tag.
    pub const fn status(&self) -> Status {
        Status::from_field(self.status)
    }
    /// The 16-byte entry as the controller writes it (§4.6, little-endian dwords).
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        b[8..10].copy_from_slice(&self.sqhd.to_le_bytes());
        b[10..12].copy_from_slice(&self.sqid.to_le_bytes());
        b[12..14].copy_from_slice(&self.cid.to_le_bytes());
        b[14..16].copy_from_slice(&self.status.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(c: &Command) -> [u8; 64] {
        c.to_le_bytes()
    }

    #[test]
    fn read_command_encodes_at_spec_offsets() {
        let mut c = Command::rw(nvm::READ, 0x1234, 1, Lba(0x1_0000_0002), 8);
        c.prp1 = 0xAABB_0000;
        c.prp2 = 0xCCDD_1000;
        let b = bytes(&c);
        assert_eq!(b[0], 0x02, "OPC at byte 0");
        assert_eq!(u16::from_le_bytes([b[2], b[3]]), 0x1234, "CID at bytes 3:2");
        assert_eq!(u32::from_le_bytes(b[4..8].try_into().unwrap()), 1, "NSID at bytes 7:4");
        assert_eq!(u64::from_le_bytes(b[24..32].try_into().unwrap()), 0xAABB_0000, "PRP1 at bytes 31:24");
        assert_eq!(u64::from_le_bytes(b[32..40].try_into().unwrap()), 0xCCDD_1000, "PRP2 at bytes 39:32");
        assert_eq!(u64::from_le_bytes(b[40..48].try_into().unwrap()), 0x1_0000_0002, "SLBA at bytes 47:40");
        assert_eq!(u16::from_le_bytes([b[48], b[49]]), 7, "NLB 0-based at bytes 49:48");
        assert_eq!((c.opc(), c.cid(), c.psdt(), c.nlb(), c.slba()), (2, 0x1234, 0, 8, Lba(0x1_0000_0002)));
    }

    #[test]
    fn admin_commands_encode() {
        let c = Command::create_io_cq(1, 3, 256, 0x5000);
        assert_eq!((c.opc(), c.cdw10, c.cdw11, c.prp1), (0x05, 3 | (255 << 16), 1, 0x5000));
        let c = Command::create_io_sq(2, 3, 64, 3, 0x6000);
        assert_eq!((c.opc(), c.cdw10, c.cdw11), (0x01, 3 | (63 << 16), 1 | (3 << 16)));
        let c = Command::set_num_queues(3, 1, 1);
        assert_eq!((c.opc(), c.cdw10, c.cdw11), (0x09, 7, 0));
        let c = Command::identify(4, admin::CNS_CONTROLLER, 0, 0x7000);
        assert_eq!((c.opc(), c.cdw10, c.prp1), (0x06, 1, 0x7000));
        assert_eq!(Command::abort(5, 1, 9).cdw10, 1 | (9 << 16));
        assert_eq!(Command::delete_io_sq(6, 2).opc(), 0x00);
        assert_eq!(Command::delete_io_cq(6, 2).opc(), 0x04);
        assert_eq!(Command::get_features(7, 7).opc(), 0x0A);
        let mut c = Command::new(0x08, 1);
        c.set_cid(0xBEEF);
        assert_eq!(c.cdw0, 0xBEEF_0008);
    }

    #[test]
    fn completion_fields() {
        let c = Completion { dw0: 0, dw1: 0, sqhd: 5, sqid: 1, cid: 9, status: (0x80 << 1) | 1 };
        assert!(c.phase());
        assert_eq!(c.status().sc, 0x80);
        assert!(!c.status().is_success());
    }
}
