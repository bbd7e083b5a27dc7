//! NVMe over Fabrics commands (NVMe base specification 2.0, §6 "Fabrics Command Set"): Connect,
//! Property Get and Property Set as [`Command`]s (opcode 7Fh, FCTYPE in byte 4), the Connect data,
//! the statuses Connect defines, Keep Alive, Get Log Page and the Discovery Log Page (LID 70h).

use crate::spec::{Command, Status, StatusCodeType};

use super::pdu::{le16, le32, le64};

/// Opcode of every Fabrics command.
pub const FABRICS_OPCODE: u8 = 0x7F;
/// FCTYPE 00h: Property Set.
pub const FCTYPE_PROPERTY_SET: u8 = 0x00;
/// FCTYPE 01h: Connect.
pub const FCTYPE_CONNECT: u8 = 0x01;
/// FCTYPE 04h: Property Get.
pub const FCTYPE_PROPERTY_GET: u8 = 0x04;
/// Admin opcode 02h: Get Log Page.
pub const GET_LOG_PAGE: u8 = 0x02;
/// Admin opcode 18h: Keep Alive.
pub const KEEP_ALIVE: u8 = 0x18;
/// Log page 70h: Discovery.
pub const LID_DISCOVERY: u8 = 0x70;
/// The well-known NQN of a discovery controller.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Bytes of the Connect command's data.
pub const CONNECT_DATA_LEN: usize = 1024;
/// The CNTLID asking a dynamic controller model to allocate any controller (§6.3).
pub const CNTLID_DYNAMIC: u16 = 0xFFFF;

/// A Fabrics command of type `fctype` (FCTYPE is byte 4 of the SQE, where NSID is elsewhere).
fn fabrics(fctype: u8, cid: u16) -> Command {
    let mut c = Command::new(FABRICS_OPCODE, cid);
    c.nsid = u32::from(fctype);
    c
}

/// The FCTYPE of a Fabrics command (byte 4).
pub fn fctype(c: &Command) -> u8 {
    c.nsid as u8
}

/// Connect (§6.3, Figure "Connect Command - Submission Queue Entry"): RECFMT 0 (bytes 41:40), QID
/// (43:42), SQSIZE 0-based (45:44), CATTR (46), KATO in ms (51:48, admin queue only). The 1024-byte
/// [`ConnectData`] goes in the capsule.
pub fn connect(cid: u16, qid: u16, sqsize: u16, kato_ms: u32) -> Command {
    let mut c = fabrics(FCTYPE_CONNECT, cid);
    c.cdw10 = u32::from(qid) << 16;
    c.cdw11 = u32::from(sqsize.saturating_sub(1));
    c.cdw12 = kato_ms;
    c
}

/// Property Get (§6.5): ATTRIB byte 40 bit 0..2 (0: 4 bytes, 1: 8 bytes), OFST bytes 47:44. The
/// value comes back in completion dwords 0-1.
pub fn property_get(cid: u16, offset: u32, eight_bytes: bool) -> Command {
    let mut c = fabrics(FCTYPE_PROPERTY_GET, cid);
    c.cdw10 = u32::from(eight_bytes);
    c.cdw11 = offset;
    c
}

/// Property Set (§6.6): ATTRIB byte 40, OFST bytes 47:44, VALUE bytes 55:48.
pub fn property_set(cid: u16, offset: u32, value: u64, eight_bytes: bool) -> Command {
    let mut c = fabrics(FCTYPE_PROPERTY_SET, cid);
    c.cdw10 = u32::from(eight_bytes);
    c.cdw11 = offset;
    c.cdw12 = value as u32;
    c.cdw13 = (value >> 32) as u32;
    c
}

/// Keep Alive (§5.25): no fields.
pub fn keep_alive(cid: u16) -> Command {
    Command::new(KEEP_ALIVE, cid)
}

/// Get Log Page (§5.16): CDW10 LID 7:0, NUMDL 31:16; CDW11 NUMDU 15:0 (dwords, 0-based); CDW12-13
/// the byte offset.
pub fn get_log_page(cid: u16, lid: u8, bytes: u32, offset: u64) -> Command {
    let numd = bytes / 4 - 1;
    let mut c = Command::new(GET_LOG_PAGE, cid);
    c.cdw10 = u32::from(lid) | ((numd & 0xFFFF) << 16);
    c.cdw11 = numd >> 16;
    c.cdw12 = offset as u32;
    c.cdw13 = (offset >> 32) as u32;
    c
}

/// The Connect command's data (§6.3, Figure "Connect Command - Data"): HOSTID (bytes 15:00),
/// CNTLID (17:16), SUBNQN (511:256), HOSTNQN (767:512), NQNs NUL-terminated UTF-8.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectData {
    /// HOSTID, the host identifier (128 bits).
    pub hostid: [u8; 16],
    /// CNTLID: [`CNTLID_DYNAMIC`] on the admin queue, the admin Connect's controller on I/O queues.
    pub cntlid: u16,
    /// SUBNQN.
    pub subnqn: String,
    /// HOSTNQN.
    pub hostnqn: String,
}

impl ConnectData {
    /// The 1024 bytes. NQNs longer than 223 bytes (the NQN limit) are cut there.
    pub fn encode(&self) -> [u8; CONNECT_DATA_LEN] {
        let mut b = [0u8; CONNECT_DATA_LEN];
        b[0..16].copy_from_slice(&self.hostid);
        b[16..18].copy_from_slice(&self.cntlid.to_le_bytes());
        let s = self.subnqn.as_bytes();
        b[256..256 + s.len().min(223)].copy_from_slice(&s[..s.len().min(223)]);
        let h = self.hostnqn.as_bytes();
        b[512..512 + h.len().min(223)].copy_from_slice(&h[..h.len().min(223)]);
        b
    }
    /// Decodes 1024 bytes (the model target's side).
    pub fn parse(b: &[u8]) -> ConnectData {
        ConnectData {
            hostid: b[0..16].try_into().expect("16 bytes"),
            cntlid: le16(b, 16),
            subnqn: nul_str(&b[256..512]),
            hostnqn: nul_str(&b[512..768]),
        }
    }
}

fn nul_str(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).trim_end().to_string()
}

/// Connect's command-specific statuses (§6.3, Figure "Connect Command Specific Status Values").
pub mod connect_status {
    /// 80h Connect Incompatible Format (RECFMT not supported).
    pub const INCOMPATIBLE_FORMAT: u8 = 0x80;
    /// 81h Connect Controller Busy.
    pub const CONTROLLER_BUSY: u8 = 0x81;
    /// 82h Connect Invalid Parameters (IATTR/IPO in completion dword 0 say which).
    pub const INVALID_PARAMETERS: u8 = 0x82;
    /// 83h Connect Restart Discovery.
    pub const RESTART_DISCOVERY: u8 = 0x83;
    /// 84h Connect Invalid Host.
    pub const INVALID_HOST: u8 = 0x84;
    /// 85h Invalid Queue Type.
    pub const INVALID_QUEUE_TYPE: u8 = 0x85;
    /// Every command-specific status Connect defines.
    pub const ALL: [u8; 6] =
        [INCOMPATIBLE_FORMAT, CONTROLLER_BUSY, INVALID_PARAMETERS, RESTART_DISCOVERY, INVALID_HOST, INVALID_QUEUE_TYPE];
}

/// The spec's name of a status of a Fabrics command or of Connect: Connect's command-specific
/// codes, else the generic names of [`Status`].
pub fn status_name(s: Status) -> String {
    if s.sct == StatusCodeType::CommandSpecific {
        let name = match s.sc {
            0x80 => Some("Connect Incompatible Format"),
            0x81 => Some("Connect Controller Busy"),
            0x82 => Some("Connect Invalid Parameters"),
            0x83 => Some("Connect Restart Discovery"),
            0x84 => Some("Connect Invalid Host"),
            0x85 => Some("Invalid Queue Type"),
            0x91 => Some("Authentication Required"),
            _ => None,
        };
        if let Some(n) = name {
            return format!("{n} (SCT 0x1 command specific, SC {:#04x}){}", s.sc, if s.dnr { ", DNR" } else { "" });
        }
    }
    s.to_string()
}

/// Identify Controller fields NVMe over Fabrics adds (§5.17.2.1): MAXCMD (bytes 515:514), IOCCSZ
/// (1795:1792, in 16-byte units, the SQE included), IORCSZ (1799:1796), ICDOFF (1801:1800), KAS
/// (321:320, 100 ms units), SUBNQN (1023:768).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricsIdentify {
    /// MAXCMD: commands outstanding per I/O queue (0: not reported).
    pub maxcmd: u16,
    /// IOCCSZ: I/O queue command capsule size, 16-byte units.
    pub ioccsz: u32,
    /// IORCSZ.
    pub iorcsz: u32,
    /// ICDOFF: in-capsule data offset, 16-byte units (0 on NVMe/TCP).
    pub icdoff: u16,
    /// KAS: keep alive granularity, 100 ms units.
    pub kas: u16,
    /// SUBNQN.
    pub subnqn: String,
}

impl FabricsIdentify {
    /// Decodes a 4096-byte Identify Controller page.
    pub fn parse(b: &[u8]) -> FabricsIdentify {
        FabricsIdentify {
            maxcmd: le16(b, 514),
            ioccsz: le32(b, 1792),
            iorcsz: le32(b, 1796),
            icdoff: le16(b, 1800),
            kas: le16(b, 320),
            subnqn: nul_str(&b[768..1024]),
        }
    }
    /// Bytes of data a command capsule may carry on an I/O queue (IOCCSZ × 16 − 64).
    pub fn in_capsule_bytes(&self) -> u32 {
        self.ioccsz.saturating_mul(16).saturating_sub(64)
    }
}

/// One Discovery Log Page entry (§5.16.1.23, Figure "Discovery Log Page Entry", 1024 bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryEntry {
    /// TRTYPE (byte 0): 1 RDMA, 2 Fibre Channel, 3 TCP, FEh intra-host.
    pub trtype: u8,
    /// ADRFAM (byte 1): 1 IPv4, 2 IPv6, 3 InfiniBand, 4 Fibre Channel, FEh intra-host.
    pub adrfam: u8,
    /// SUBTYPE (byte 2): 1 referral to a discovery subsystem, 2 NVM subsystem, 3 current discovery subsystem.
    pub subtype: u8,
    /// PORTID (bytes 5:4).
    pub portid: u16,
    /// CNTLID (bytes 7:6).
    pub cntlid: u16,
    /// TRSVCID (bytes 63:32): the port, as text.
    pub trsvcid: String,
    /// SUBNQN (bytes 511:256).
    pub subnqn: String,
    /// TRADDR (bytes 767:512): the address, as text.
    pub traddr: String,
}

impl DiscoveryEntry {
    /// Bytes of one entry.
    pub const LEN: usize = 1024;

    /// The entry of an NVM subsystem `subnqn` reached over TCP on IPv4 at `traddr`:`trsvcid`
    /// (TRTYPE 3, ADRFAM 1, SUBTYPE 2), port 1, any controller (CNTLID FFFFh: dynamic).
    pub fn tcp_ipv4_nvm(traddr: &str, trsvcid: &str, subnqn: &str) -> DiscoveryEntry {
        DiscoveryEntry {
            trtype: 3,
            adrfam: 1,
            subtype: 2,
            portid: 1,
            cntlid: 0xFFFF,
            trsvcid: trsvcid.into(),
            subnqn: subnqn.into(),
            traddr: traddr.into(),
        }
    }

    /// Decodes one 1024-byte entry.
    pub fn parse(b: &[u8]) -> DiscoveryEntry {
        DiscoveryEntry {
            trtype: b[0],
            adrfam: b[1],
            subtype: b[2],
            portid: le16(b, 4),
            cntlid: le16(b, 6),
            trsvcid: nul_str(&b[32..64]),
            subnqn: nul_str(&b[256..512]),
            traddr: nul_str(&b[512..768]),
        }
    }
    /// Encodes (the model target's side).
    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0] = self.trtype;
        b[1] = self.adrfam;
        b[2] = self.subtype;
        b[4..6].copy_from_slice(&self.portid.to_le_bytes());
        b[6..8].copy_from_slice(&self.cntlid.to_le_bytes());
        let put = |b: &mut [u8], s: &str| {
            let n = s.len().min(b.len() - 1);
            b[..n].copy_from_slice(&s.as_bytes()[..n]);
        };
        put(&mut b[32..64], &self.trsvcid);
        put(&mut b[256..512], &self.subnqn);
        put(&mut b[512..768], &self.traddr);
        b
    }
    /// TRTYPE as text (`tcp`, `rdma`, `fc`, `loop`).
    pub fn trtype_name(&self) -> String {
        match self.trtype {
            1 => "rdma".into(),
            2 => "fc".into(),
            3 => "tcp".into(),
            0xFE => "loop".into(),
            t => format!("trtype {t}"),
        }
    }
    /// SUBTYPE as text.
    pub fn subtype_name(&self) -> &'static str {
        match self.subtype {
            1 => "discovery referral",
            2 => "nvme subsystem",
            3 => "current discovery subsystem",
            _ => "unknown subtype",
        }
    }
}

/// The Discovery Log Page header (bytes 1023:0): GENCTR (7:0), NUMREC (15:8), RECFMT (17:16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiscoveryHeader {
    /// GENCTR, generation counter.
    pub genctr: u64,
    /// NUMREC, number of records.
    pub numrec: u64,
    /// RECFMT, record format.
    pub recfmt: u16,
}

impl DiscoveryHeader {
    /// Decodes the first 18 bytes.
    pub fn parse(b: &[u8]) -> DiscoveryHeader {
        DiscoveryHeader { genctr: le64(b, 0), numrec: le64(b, 8), recfmt: le16(b, 16) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::pdu::sqe_bytes;

    #[test]
    fn connect_and_property_commands_at_spec_offsets() {
        let b = sqe_bytes(&connect(9, 3, 128, 10_000));
        assert_eq!((b[0], b[4]), (0x7F, 0x01), "opcode 7Fh, FCTYPE 01h at byte 4");
        assert_eq!(le16(&b, 2), 9, "CID");
        assert_eq!((le16(&b, 40), le16(&b, 42), le16(&b, 44)), (0, 3, 127), "RECFMT, QID, SQSIZE 0-based");
        assert_eq!(le32(&b, 48), 10_000, "KATO at bytes 51:48");
        let b = sqe_bytes(&property_get(1, 0x1C, false));
        assert_eq!((b[4], b[40], le32(&b, 44)), (0x04, 0, 0x1C));
        let b = sqe_bytes(&property_set(1, 0x14, 0x0046_0001, false));
        assert_eq!((b[4], b[40], le32(&b, 44), le64(&b, 48)), (0x00, 0, 0x14, 0x0046_0001));
        let b = sqe_bytes(&get_log_page(1, LID_DISCOVERY, 4096, 1024));
        assert_eq!((b[0], b[40], le16(&b, 42), le64(&b, 48)), (0x02, 0x70, 1023, 1024));
    }

    #[test]
    fn connect_data_and_discovery_entries_round_trip() {
        let d = ConnectData {
            hostid: [7; 16],
            cntlid: CNTLID_DYNAMIC,
            subnqn: "nqn.2026-01.io.picchio:experts".into(),
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:x".into(),
        };
        let b = d.encode();
        assert_eq!((&b[256..262], le16(&b, 16)), (&b"nqn.20"[..], 0xFFFF));
        assert_eq!(ConnectData::parse(&b), d);
        let e = DiscoveryEntry::tcp_ipv4_nvm("127.0.0.1", "4420", "nqn.x");
        let b = e.encode();
        assert_eq!((&b[32..36], &b[512..521]), (&b"4420"[..], &b"127.0.0.1"[..]));
        assert_eq!(DiscoveryEntry::parse(&b), e);
        assert_eq!((e.trtype_name(), e.subtype_name()), ("tcp".to_string(), "nvme subsystem"));
    }

    #[test]
    fn connect_statuses_have_spec_names() {
        let s = Status { dnr: true, ..Status::new(StatusCodeType::CommandSpecific, 0x84) };
        assert_eq!(status_name(s), "Connect Invalid Host (SCT 0x1 command specific, SC 0x84), DNR");
        for sc in connect_status::ALL {
            assert!(!status_name(Status::new(StatusCodeType::CommandSpecific, sc)).starts_with("unknown"));
        }
        assert!(status_name(Status::INVALID_FIELD).starts_with("Invalid Field in Command"));
    }
}
