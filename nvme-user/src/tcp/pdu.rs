//! NVMe/TCP PDUs (NVM Express TCP Transport Specification 1.0, §3.6 "PDU Formats"): the common
//! header, and the header fields of every PDU the host sends or receives, encoded and decoded with
//! their byte offsets pinned by tests. Integers are little-endian.
//!
//! | PDU | type | HLEN | direction |
//! | --- | --- | --- | --- |
//! | ICReq | 00h | 128 | host → controller |
//! | ICResp | 01h | 128 | controller → host |
//! | H2CTermReq | 02h | 24 | host → controller |
//! | C2HTermReq | 03h | 24 | controller → host |
//! | CapsuleCmd | 04h | 72 | host → controller |
//! | CapsuleResp | 05h | 24 | controller → host |
//! | H2CData | 06h | 24 | host → controller |
//! | C2HData | 07h | 24 | controller → host |
//! | R2T | 09h | 24 | controller → host |
//!
//! A PDU is: the header (HLEN bytes, starting with the 8-byte common header), the header digest
//! (4 bytes, CRC32C of the header, when negotiated and the PDU type carries one), padding up to
//! PDO, the data, and the data digest (4 bytes, CRC32C of the data). PLEN counts all of it.

use crate::spec::{Command, Completion};

/// PDU types (§3.6.1, Figure "PDU Type").
pub mod pdu_type {
    /// Initialize Connection Request.
    pub const IC_REQ: u8 = 0x00;
    /// Initialize Connection Response.
    pub const IC_RESP: u8 = 0x01;
    /// Host to Controller Terminate Connection Request.
    pub const H2C_TERM_REQ: u8 = 0x02;
    /// Controller to Host Terminate Connection Request.
    pub const C2H_TERM_REQ: u8 = 0x03;
    /// Command Capsule.
    pub const CAPSULE_CMD: u8 = 0x04;
    /// Response Capsule.
    pub const CAPSULE_RESP: u8 = 0x05;
    /// Host to Controller Data.
    pub const H2C_DATA: u8 = 0x06;
    /// Controller to Host Data.
    pub const C2H_DATA: u8 = 0x07;
    /// Ready to Transfer.
    pub const R2T: u8 = 0x09;
}

/// The spec's name of a PDU type, for messages.
pub fn type_name(t: u8) -> &'static str {
    match t {
        pdu_type::IC_REQ => "ICReq",
        pdu_type::IC_RESP => "ICResp",
        pdu_type::H2C_TERM_REQ => "H2CTermReq",
        pdu_type::C2H_TERM_REQ => "C2HTermReq",
        pdu_type::CAPSULE_CMD => "CapsuleCmd",
        pdu_type::CAPSULE_RESP => "CapsuleResp",
        pdu_type::H2C_DATA => "H2CData",
        pdu_type::C2H_DATA => "C2HData",
        pdu_type::R2T => "R2T",
        _ => "unknown PDU type",
    }
}

/// Common header FLAGS bits (§3.6.1).
pub mod flags {
    /// HDGSTF: a header digest follows the header.
    pub const HDGSTF: u8 = 1 << 0;
    /// DDGSTF: a data digest follows the data.
    pub const DDGSTF: u8 = 1 << 1;
    /// LAST_PDU (H2CData, C2HData): the last data PDU of the transfer (of the R2T for H2CData).
    pub const LAST_PDU: u8 = 1 << 2;
    /// SUCCESS (C2HData, with LAST_PDU): the command completed successfully, no CapsuleResp follows.
    pub const SUCCESS: u8 = 1 << 3;
}

/// Bytes of the common header (CH).
pub const CH_LEN: usize = 8;
/// Bytes of a digest (CRC32C).
pub const DIGEST_LEN: usize = 4;
/// HLEN of ICReq and ICResp.
pub const IC_HLEN: usize = 128;
/// HLEN of CapsuleCmd: CH + the 64-byte SQE.
pub const CMD_HLEN: usize = CH_LEN + 64;
/// HLEN of CapsuleResp, C2HData, H2CData, R2T, C2HTermReq, H2CTermReq.
pub const HLEN_24: usize = 24;
/// Smallest MAXH2CDATA a controller may advertise (§3.6.2.3).
pub const MIN_MAXH2CDATA: u32 = 4096;
/// Largest PLEN of a termination request: its header and up to 128 bytes of the PDU in error.
pub const MAX_TERM_PLEN: u32 = 152;
/// The PDU Format Version this host speaks (PFV 0h, NVMe/TCP 1.0).
pub const PFV_1_0: u16 = 0;

/// CRC32C (Castagnoli) as NVMe/TCP digests use it (§3.6.1.4: initial value and final XOR all ones,
/// stored little-endian).
pub fn crc32c(bytes: &[u8]) -> u32 {
    ::crc32c::crc32c(bytes)
}

/// The common header (CH, §3.6.1): PDU-Type, FLAGS, HLEN, PDO, PLEN.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CommonHeader {
    /// PDU-Type, byte 0.
    pub pdu_type: u8,
    /// FLAGS, byte 1.
    pub flags: u8,
    /// HLEN, byte 2: header length in bytes (without the header digest).
    pub hlen: u8,
    /// PDO, byte 3: offset of the data from the start of the PDU (0 when there is none).
    pub pdo: u8,
    /// PLEN, bytes 7:4: the whole PDU in bytes, digests and padding included.
    pub plen: u32,
}

impl CommonHeader {
    /// Decodes bytes 7:0.
    pub fn parse(b: &[u8; CH_LEN]) -> CommonHeader {
        CommonHeader { pdu_type: b[0], flags: b[1], hlen: b[2], pdo: b[3], plen: le32(b, 4) }
    }
    /// The header of a PDU of type `t` (with its type's `flags`) whose header is `hlen` bytes, with
    /// `data` bytes of data (`None`: no data part), the digests as negotiated (`(header, data)`)
    /// and the data starting at a multiple of `align` bytes (the receiver's PDA + 1 dwords): FLAGS
    /// gets HDGSTF and DDGSTF, PDO the data's offset, PLEN the whole PDU.
    pub fn framed(t: u8, flags: u8, hlen: usize, data: Option<usize>, align: usize, digests: (bool, bool)) -> Self {
        let (hdgst, ddgst) = digests;
        let hd = if hdgst { DIGEST_LEN } else { 0 };
        let (pdo, plen) = match data {
            Some(dlen) => {
                let pdo = (hlen + hd).div_ceil(align) * align;
                (pdo, pdo + dlen + if ddgst { DIGEST_LEN } else { 0 })
            }
            None => (0, hlen + hd),
        };
        let mut f = flags;
        if hdgst {
            f |= self::flags::HDGSTF;
        }
        if data.is_some() && ddgst {
            f |= self::flags::DDGSTF;
        }
        CommonHeader { pdu_type: t, flags: f, hlen: hlen as u8, pdo: pdo as u8, plen: plen as u32 }
    }
    /// Encodes into `b[..8]`.
    pub fn write(&self, b: &mut [u8]) {
        b[0] = self.pdu_type;
        b[1] = self.flags;
        b[2] = self.hlen;
        b[3] = self.pdo;
        b[4..8].copy_from_slice(&self.plen.to_le_bytes());
    }
}

pub(crate) fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}
pub(crate) fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
pub(crate) fn le64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

/// Declares ICReq or ICResp: both are 128-byte PDUs with PFV at bytes 9:8, a PDU data alignment at
/// byte 10, DGST at byte 11 (bit 0 HDGST_ENABLE, bit 1 DDGST_ENABLE) and a dword at bytes 15:12;
/// the alignment and the dword are named as the spec names them for each direction.
macro_rules! ic_pdu {
    (
        $(#[$doc:meta])* $name:ident = $pdu_type:expr;
        $(#[$pda_doc:meta])* $pda:ident;
        $(#[$dword_doc:meta])* $dword:ident;
    ) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub struct $name {
            /// PFV, bytes 9:8.
            pub pfv: u16,
            $(#[$pda_doc])*
            pub $pda: u8,
            /// DGST bit 0, HDGST_ENABLE: header digests are used on this connection.
            pub hdgst: bool,
            /// DGST bit 1, DDGST_ENABLE: data digests are used.
            pub ddgst: bool,
            $(#[$dword_doc])*
            pub $dword: u32,
        }

        impl $name {
            /// The 128-byte PDU.
            pub fn encode(&self) -> [u8; IC_HLEN] {
                let mut b = [0u8; IC_HLEN];
                CommonHeader { pdu_type: $pdu_type, flags: 0, hlen: IC_HLEN as u8, pdo: 0, plen: IC_HLEN as u32 }
                    .write(&mut b);
                b[8..10].copy_from_slice(&self.pfv.to_le_bytes());
                b[10] = self.$pda;
                b[11] = u8::from(self.hdgst) | (u8::from(self.ddgst) << 1);
                b[12..16].copy_from_slice(&self.$dword.to_le_bytes());
                b
            }
            /// Decodes the 128-byte PDU.
            pub fn parse(b: &[u8]) -> $name {
                $name { pfv: le16(b, 8), $pda: b[10], hdgst: b[11] & 1 != 0, ddgst: b[11] & 2 != 0, $dword: le32(b, 12) }
            }
        }
    };
}

ic_pdu! {
    /// ICReq (§3.6.2.2): the host's connection parameters.
    IcReq = pdu_type::IC_REQ;
    /// HPDA, byte 10: host PDU data alignment, in dwords minus one, for the data of C2H PDUs (0..=31).
    hpda;
    /// MAXR2T, bytes 15:12: outstanding R2Ts per command, 0-based.
    maxr2t;
}

ic_pdu! {
    /// ICResp (§3.6.2.3): the controller's connection parameters.
    IcResp = pdu_type::IC_RESP;
    /// CPDA, byte 10: controller PDU data alignment, in dwords minus one, for the data of H2C PDUs.
    cpda;
    /// MAXH2CDATA, bytes 15:12: the most data bytes in one H2CData PDU (at least 4096).
    maxh2cdata;
}

/// The PDU-specific header of C2HData, H2CData (§3.6.2.7/§3.6.2.8) and R2T (§3.6.2.9): CCCID,
/// TTAG, an offset and a length into the command's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataHeader {
    /// CCCID, bytes 9:8: the command's CID.
    pub cccid: u16,
    /// TTAG, bytes 11:10: transfer tag (R2T and H2CData; reserved in C2HData).
    pub ttag: u16,
    /// DATAO / R2TO, bytes 15:12: offset in the command's data.
    pub offset: u32,
    /// DATAL / R2TL, bytes 19:16: bytes.
    pub length: u32,
}

impl DataHeader {
    /// Decodes bytes 19:8 of a 24-byte header.
    pub fn parse(b: &[u8]) -> DataHeader {
        DataHeader { cccid: le16(b, 8), ttag: le16(b, 10), offset: le32(b, 12), length: le32(b, 16) }
    }
    /// Encodes into bytes 19:8 of `b`.
    pub fn write(&self, b: &mut [u8]) {
        b[8..10].copy_from_slice(&self.cccid.to_le_bytes());
        b[10..12].copy_from_slice(&self.ttag.to_le_bytes());
        b[12..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..20].copy_from_slice(&self.length.to_le_bytes());
    }
}

/// The header of C2HTermReq / H2CTermReq (§3.6.2.4/§3.6.2.5): FES and FEI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TermReq {
    /// FES, bytes 9:8: fatal error status.
    pub fes: u16,
    /// FEI, bytes 13:10: field error information (the byte offset of the bad field for
    /// Invalid PDU Header Field, the PDU's bad digest for Header Digest Error, else 0).
    pub fei: u32,
}

impl TermReq {
    /// FES 01h: Invalid PDU Header Field.
    pub const INVALID_HEADER_FIELD: u16 = 0x01;
    /// FES 02h: PDU Sequence Error.
    pub const PDU_SEQUENCE_ERROR: u16 = 0x02;
    /// FES 03h: Header Digest Error.
    pub const HEADER_DIGEST_ERROR: u16 = 0x03;
    /// FES 04h: Data Transfer Out of Range.
    pub const DATA_OUT_OF_RANGE: u16 = 0x04;
    /// FES 05h: Data Transfer Limit Exceeded (R2T Limit Exceeded).
    pub const DATA_LIMIT_EXCEEDED: u16 = 0x05;
    /// FES 06h: Unsupported Parameter.
    pub const UNSUPPORTED_PARAMETER: u16 = 0x06;

    /// The spec's name of a FES value.
    pub fn fes_name(fes: u16) -> &'static str {
        match fes {
            0x01 => "Invalid PDU Header Field",
            0x02 => "PDU Sequence Error",
            0x03 => "Header Digest Error",
            0x04 => "Data Transfer Out of Range",
            0x05 => "Data Transfer Limit Exceeded",
            0x06 => "Unsupported Parameter",
            _ => "reserved FES",
        }
    }
    /// Decodes bytes 13:8.
    pub fn parse(b: &[u8]) -> TermReq {
        TermReq { fes: le16(b, 8), fei: le32(b, 10) }
    }
    /// A termination request PDU of type `t` (02h or 03h) quoting `bad` (at most 128 bytes of the
    /// PDU in error).
    pub fn encode(&self, t: u8, bad: &[u8]) -> Vec<u8> {
        let bad = &bad[..bad.len().min(128)];
        let mut b = vec![0u8; HLEN_24 + bad.len()];
        let plen = b.len() as u32;
        CommonHeader { pdu_type: t, flags: 0, hlen: HLEN_24 as u8, pdo: 0, plen }.write(&mut b);
        b[8..10].copy_from_slice(&self.fes.to_le_bytes());
        b[10..14].copy_from_slice(&self.fei.to_le_bytes());
        b[HLEN_24..].copy_from_slice(bad);
        b
    }
}

/// The 64-byte SQE as bytes (little-endian), for CapsuleCmd.
pub fn sqe_bytes(c: &Command) -> [u8; 64] {
    c.to_le_bytes()
}

/// The SQE from 64 bytes (the model target's side).
pub fn sqe_parse(b: &[u8]) -> Command {
    Command {
        cdw0: le32(b, 0),
        nsid: le32(b, 4),
        cdw2: le32(b, 8),
        cdw3: le32(b, 12),
        mptr: le64(b, 16),
        prp1: le64(b, 24),
        prp2: le64(b, 32),
        cdw10: le32(b, 40),
        cdw11: le32(b, 44),
        cdw12: le32(b, 48),
        cdw13: le32(b, 52),
        cdw14: le32(b, 56),
        cdw15: le32(b, 60),
    }
}

/// The CQE from 16 bytes (the inverse of [`Completion::to_bytes`]).
pub fn cqe_parse(b: &[u8]) -> Completion {
    Completion {
        dw0: le32(b, 0),
        dw1: le32(b, 4),
        sqhd: le16(b, 8),
        sqid: le16(b, 10),
        cid: le16(b, 12),
        status: le16(b, 14),
    }
}

/// SGL descriptors in the SQE's DPTR (NVMe base spec 2.0 §4.1.8, "Scatter Gather List"; NVMe/TCP
/// §3.3: data is either in the capsule or moved by C2HData/H2CData PDUs).
pub mod sgl {
    use crate::spec::Command;

    /// SGL identifier (byte 15 of the descriptor): Data Block (0h) with sub type Offset (1h): data
    /// in the capsule, at ADDRESS bytes from its start.
    pub const IN_CAPSULE: u8 = 0x01;
    /// SGL identifier: Transport SGL Data Block (5h) with the transport-specific sub type Ah: data
    /// moved by data PDUs.
    pub const TRANSPORT: u8 = 0x5A;
    /// CDW0 PSDT = 01b (bits 15:14): SGLs are used for the data (required on NVMe over Fabrics).
    pub const PSDT_SGL: u32 = 1 << 14;

    /// Sets PSDT = 01b and DPTR to one descriptor: ADDRESS `addr`, LENGTH `len`, identifier `id`.
    pub fn set(c: &mut Command, id: u8, addr: u64, len: u32) {
        c.cdw0 = (c.cdw0 & !(3 << 14)) | PSDT_SGL;
        c.prp1 = addr;
        c.prp2 = u64::from(len) | (u64::from(id) << 56);
    }
    /// (identifier, address, length) of DPTR.
    pub fn get(c: &Command) -> (u8, u64, u32) {
        ((c.prp2 >> 56) as u8, c.prp1, c.prp2 as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn icreq_and_icresp_fields_at_spec_offsets() {
        let b = IcReq { pfv: 0, hpda: 3, hdgst: true, ddgst: false, maxr2t: 7 }.encode();
        assert_eq!(&b[..8], &[0x00, 0, 128, 0, 128, 0, 0, 0], "CH: type 0, HLEN 128, PDO 0, PLEN 128");
        assert_eq!((b[10], b[11], le32(&b, 12)), (3, 0b01, 7));
        assert_eq!(IcReq::parse(&b).maxr2t, 7);
        let r = IcResp { pfv: 0, cpda: 1, hdgst: false, ddgst: true, maxh2cdata: 131072 };
        let b = r.encode();
        assert_eq!((b[0], b[2], b[10], b[11], le32(&b, 12)), (0x01, 128, 1, 0b10, 131072));
        assert_eq!(IcResp::parse(&b), r);
    }

    #[test]
    fn data_header_and_term_req_at_spec_offsets() {
        let mut b = [0u8; 24];
        DataHeader { cccid: 0x1234, ttag: 0x5678, offset: 0x1000, length: 0x2000 }.write(&mut b);
        assert_eq!(&b[8..20], &[0x34, 0x12, 0x78, 0x56, 0, 0x10, 0, 0, 0, 0x20, 0, 0]);
        let t =
            TermReq { fes: TermReq::HEADER_DIGEST_ERROR, fei: 0xDEAD_BEEF }.encode(pdu_type::C2H_TERM_REQ, &[9; 200]);
        assert_eq!(t.len(), 152, "24 + at most 128 bytes of the PDU in error");
        assert_eq!((t[0], t[2], le32(&t, 4)), (0x03, 24, 152));
        assert_eq!(TermReq::parse(&t), TermReq { fes: 3, fei: 0xDEAD_BEEF });
        assert_eq!(TermReq::fes_name(5), "Data Transfer Limit Exceeded");
    }

    #[test]
    fn sgl_descriptors_and_capsule_round_trip() {
        let mut c = Command::new(0x02, 7);
        sgl::set(&mut c, sgl::TRANSPORT, 0, 8192);
        let b = sqe_bytes(&c);
        assert_eq!(b[1] >> 6, 0b01, "PSDT 01b in CDW0 bits 15:14");
        assert_eq!(le32(&b, 32), 8192, "SGL LENGTH at DPTR bytes 11:8");
        assert_eq!(b[39], 0x5A, "SGL identifier at DPTR byte 15");
        assert_eq!(sqe_parse(&b), c);
        assert_eq!(sgl::get(&c), (0x5A, 0, 8192));
        let cqe = Completion { dw0: 1, dw1: 2, sqhd: 3, sqid: 4, cid: 5, status: 6 };
        assert_eq!(cqe_parse(&cqe.to_bytes()), cqe);
    }

    #[test]
    fn crc32c_is_castagnoli() {
        // The check value of CRC-32C (iSCSI): "123456789" → 0xE3069283.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }
}
