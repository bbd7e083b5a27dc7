//! The Status field of a completion (§4.6.1): Status Code Type, Status Code, More, Do Not Retry,
//! decoded with the spec's names (§4.6.1.2, Figures "Generic Command Status Values",
//! "Command Specific Status Values", "Media and Data Integrity Errors").

/// SCT — Status Code Type (bits 11:9 of the status field, without the phase tag: bits 10:8 here).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StatusCodeType {
    /// 0h: Generic Command Status.
    Generic,
    /// 1h: Command Specific Status.
    CommandSpecific,
    /// 2h: Media and Data Integrity Errors.
    MediaDataIntegrity,
    /// 3h: Path Related Status.
    PathRelated,
    /// 7h: Vendor Specific.
    VendorSpecific,
    /// Any other (reserved) value.
    Reserved(u8),
}

impl StatusCodeType {
    /// From the 3-bit SCT value.
    pub const fn from_raw(v: u8) -> Self {
        match v & 7 {
            0 => Self::Generic,
            1 => Self::CommandSpecific,
            2 => Self::MediaDataIntegrity,
            3 => Self::PathRelated,
            7 => Self::VendorSpecific,
            x => Self::Reserved(x),
        }
    }
    /// The 3-bit SCT value.
    pub const fn raw(self) -> u8 {
        match self {
            Self::Generic => 0,
            Self::CommandSpecific => 1,
            Self::MediaDataIntegrity => 2,
            Self::PathRelated => 3,
            Self::VendorSpecific => 7,
            Self::Reserved(x) => x & 7,
        }
    }
}

/// A decoded completion status (the 15 bits above the phase tag).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Status {
    /// SCT, Status Code Type.
    pub sct: StatusCodeType,
    /// SC, Status Code.
    pub sc: u8,
    /// CRD, Command Retry Delay (bits 13:12 of the field).
    pub crd: u8,
    /// M, More (bit 14).
    pub more: bool,
    /// DNR, Do Not Retry (bit 15).
    pub dnr: bool,
}

impl Status {
    /// Successful Completion.
    pub const SUCCESS: Status = Status::new(StatusCodeType::Generic, 0);

    /// A status with the given type and code, CRD/M/DNR clear.
    pub const fn new(sct: StatusCodeType, sc: u8) -> Status {
        Status { sct, sc, crd: 0, more: false, dnr: false }
    }
    /// Decodes the 16-bit status half-word of a CQE (bit 0, the phase tag, is ignored).
    pub const fn from_field(f: u16) -> Status {
        Status {
            sc: (f >> 1) as u8,
            sct: StatusCodeType::from_raw(((f >> 9) & 7) as u8),
            crd: ((f >> 12) & 3) as u8,
            more: (f >> 14) & 1 != 0,
            dnr: (f >> 15) & 1 != 0,
        }
    }
    /// Encodes to the 16-bit status half-word with phase tag `p`.
    pub const fn to_field(self, p: bool) -> u16 {
        (p as u16)
            | ((self.sc as u16) << 1)
            | ((self.sct.raw() as u16) << 9)
            | (((self.crd & 3) as u16) << 12)
            | ((self.more as u16) << 14)
            | ((self.dnr as u16) << 15)
    }
    /// SCT 0, SC 0.
    pub const fn is_success(self) -> bool {
        matches!(self.sct, StatusCodeType::Generic) && self.sc == 0
    }
    /// The spec's name for this status code, if it is one we know.
    pub fn name(self) -> Option<&'static str> {
        Some(match (self.sct, self.sc) {
            (StatusCodeType::Generic, c) => match c {
                0x00 => "Successful Completion",
                0x01 => "Invalid Command Opcode",
                0x02 => "Invalid Field in Command",
                0x03 => "Command ID Conflict",
                0x04 => "Data Transfer Error",
                0x05 => "Commands Aborted due to Power Loss Notification",
                0x06 => "Internal Error",
                0x07 => "Command Abort Requested",
                0x08 => "Command Aborted due to SQ Deletion",
                0x09 => "Command Aborted due to Failed Fused Command",
                0x0A => "Command Aborted due to Missing Fused Command",
                0x0B => "Invalid Namespace or Format",
                0x0C => "Command Sequence Error",
                0x0D => "Invalid SGL Segment Descriptor",
                0x0E => "Invalid Number of SGL Descriptors",
                0x0F => "Data SGL Length Invalid",
                0x10 => "Metadata SGL Length Invalid",
                0x11 => "SGL Descriptor Type Invalid",
                0x12 => "Invalid Use of Controller Memory Buffer",
                0x13 => "PRP Offset Invalid",
                0x14 => "Atomic Write Unit Exceeded",
                0x15 => "Operation Denied",
                0x16 => "SGL Offset Invalid",
                0x18 => "Host Identifier Inconsistent Format",
                0x19 => "Keep Alive Timer Expired",
                0x1A => "Keep Alive Timeout Invalid",
                0x1B => "Command Aborted due to Preempt and Abort",
                0x1C => "Sanitize Failed",
                0x1D => "Sanitize In Progress",
                0x1E => "SGL Data Block Granularity Invalid",
                0x1F => "Command Not Supported for Queue in CMB",
                0x20 => "Namespace is Write Protected",
                0x21 => "Command Interrupted",
                0x22 => "Transient Transport Error",
                0x80 => "LBA Out of Range",
                0x81 => "Capacity Exceeded",
                0x82 => "Namespace Not Ready",
                0x83 => "Reservation Conflict",
                0x84 => "Format In Progress",
                _ => return None,
            },
            (StatusCodeType::CommandSpecific, c) => match c {
                0x00 => "Completion Queue Invalid",
                0x01 => "Invalid Queue Identifier",
                0x02 => "Invalid Queue Size",
                0x03 => "Abort Command Limit Exceeded",
                0x05 => "Asynchronous Event Request Limit Exceeded",
                0x06 => "Invalid Firmware Slot",
                0x07 => "Invalid Firmware Image",
                0x08 => "Invalid Interrupt Vector",
                0x09 => "Invalid Log Page",
                0x0A => "Invalid Format",
                0x0B => "Firmware Activation Requires Conventional Reset",
                0x0C => "Invalid Queue Deletion",
                0x0D => "Feature Identifier Not Saveable",
                0x0E => "Feature Not Changeable",
                0x0F => "Feature Not Namespace Specific",
                0x80 => "Conflicting Attributes",
                0x81 => "Invalid Protection Information",
                0x82 => "Attempted Write to Read Only Range",
                _ => return None,
            },
            (StatusCodeType::MediaDataIntegrity, c) => match c {
                0x80 => "Write Fault",
                0x81 => "Unrecovered Read Error",
                0x82 => "End-to-end Guard Check Error",
                0x83 => "End-to-end Application Tag Check Error",
                0x84 => "End-to-end Reference Tag Check Error",
                0x85 => "Compare Failure",
                0x86 => "Access Denied",
                0x87 => "Deallocated or Unwritten Logical Block",
                _ => return None,
            },
            _ => return None,
        })
    }

    /// Generic: Invalid Command Opcode.
    pub const INVALID_OPCODE: Status = Status::new(StatusCodeType::Generic, 0x01);
    /// Generic: Invalid Field in Command.
    pub const INVALID_FIELD: Status = Status::new(StatusCodeType::Generic, 0x02);
    /// Generic: Data Transfer Error.
    pub const DATA_TRANSFER_ERROR: Status = Status::new(StatusCodeType::Generic, 0x04);
    /// Generic: Internal Error.
    pub const INTERNAL_ERROR: Status = Status::new(StatusCodeType::Generic, 0x06);
    /// Generic: Command Abort Requested (the command was aborted by an Abort command, §5.1).
    pub const ABORT_REQUESTED: Status = Status::new(StatusCodeType::Generic, 0x07);
    /// Generic: Command Aborted due to SQ Deletion.
    pub const ABORTED_SQ_DELETION: Status = Status::new(StatusCodeType::Generic, 0x08);
    /// Generic: Invalid Namespace or Format.
    pub const INVALID_NAMESPACE: Status = Status::new(StatusCodeType::Generic, 0x0B);
    /// Generic: PRP Offset Invalid.
    pub const PRP_OFFSET_INVALID: Status = Status::new(StatusCodeType::Generic, 0x13);
    /// Generic (NVM): LBA Out of Range.
    pub const LBA_OUT_OF_RANGE: Status = Status::new(StatusCodeType::Generic, 0x80);
    /// Command specific: Completion Queue Invalid.
    pub const CQ_INVALID: Status = Status::new(StatusCodeType::CommandSpecific, 0x00);
    /// Command specific: Invalid Queue Identifier.
    pub const INVALID_QID: Status = Status::new(StatusCodeType::CommandSpecific, 0x01);
    /// Command specific: Invalid Queue Size.
    pub const INVALID_QUEUE_SIZE: Status = Status::new(StatusCodeType::CommandSpecific, 0x02);
    /// Command specific: Invalid Queue Deletion.
    pub const INVALID_QUEUE_DELETION: Status = Status::new(StatusCodeType::CommandSpecific, 0x0C);
    /// Media: Unrecovered Read Error.
    pub const UNRECOVERED_READ_ERROR: Status = Status::new(StatusCodeType::MediaDataIntegrity, 0x81);
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sct = match self.sct {
            StatusCodeType::Generic => "generic",
            StatusCodeType::CommandSpecific => "command specific",
            StatusCodeType::MediaDataIntegrity => "media and data integrity",
            StatusCodeType::PathRelated => "path related",
            StatusCodeType::VendorSpecific => "vendor specific",
            StatusCodeType::Reserved(_) => "reserved",
        };
        match self.name() {
            Some(n) => write!(f, "{n} (SCT {:#x} {sct}, SC {:#04x})", self.sct.raw(), self.sc)?,
            None => write!(f, "unknown status (SCT {:#x} {sct}, SC {:#04x})", self.sct.raw(), self.sc)?,
        }
        if self.dnr {
            f.write_str(", DNR")?;
        }
        if self.more {
            f.write_str(", M")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn field_round_trip_and_bits() {
        let s = Status { sct: StatusCodeType::MediaDataIntegrity, sc: 0x81, crd: 1, more: true, dnr: true };
        let f = s.to_field(true);
        assert_eq!(f & 1, 1);
        assert_eq!((f >> 1) & 0xFF, 0x81);
        assert_eq!((f >> 9) & 7, 2);
        assert_eq!((f >> 12) & 3, 1);
        assert_eq!(f >> 14, 0b11);
        assert_eq!(Status::from_field(f), s);
        assert!(Status::from_field(1).is_success());
    }

    #[test]
    fn display_uses_spec_names() {
        assert_eq!(Status::LBA_OUT_OF_RANGE.to_string(), "LBA Out of Range (SCT 0x0 generic, SC 0x80)");
        let s = Status { dnr: true, ..Status::UNRECOVERED_READ_ERROR };
        assert_eq!(s.to_string(), "Unrecovered Read Error (SCT 0x2 media and data integrity, SC 0x81), DNR");
        assert_eq!(Status::INVALID_QID.to_string(), "Invalid Queue Identifier (SCT 0x1 command specific, SC 0x01)");
        assert!(Status::new(StatusCodeType::VendorSpecific, 0xC0).to_string().starts_with("unknown status"));
    }
}
