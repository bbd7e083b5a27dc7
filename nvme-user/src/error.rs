//! The crate's error type: one variant per failing operation.

use crate::ctrlr::InitState;
use crate::prp::PrpError;
use crate::spec::Status;

/// Errors of the NVMe driver, the DMA allocators and the sim.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A controller init state did not finish before its CAP.TO deadline.
    #[error("NVMe init timed out in state {state:?} after {waited_ms} ms (CAP.TO deadline)")]
    InitTimeout {
        /// The state that timed out.
        state: InitState,
        /// How long it waited.
        waited_ms: u64,
    },
    /// At shutdown, CSTS.RDY did not clear within CAP.TO after CC.EN was set to 0 (NVMe base spec
    /// 2.0, §3.5.2): the controller has not confirmed it stopped, so it may still DMA into host memory.
    #[error(
        "NVMe controller did not stop: CSTS.RDY still 1 {waited_ms} ms after CC.EN = 0 (CSTS = {csts:#x}, \
         CAP.TO deadline); it may still DMA"
    )]
    NotStopped {
        /// The last CSTS value read.
        csts: u32,
        /// How long it waited.
        waited_ms: u64,
    },
    /// The controller reported Controller Fatal Status (CSTS.CFS = 1).
    #[error("NVMe controller fatal status (CSTS.CFS = 1, CSTS = {csts:#x}) during {during}")]
    ControllerFatal {
        /// What the driver was doing.
        during: String,
        /// The CSTS value read.
        csts: u32,
    },
    /// An admin command completed with an error status.
    #[error("NVMe admin command {what} failed: {status}")]
    AdminCommand {
        /// The command (e.g. `Identify Controller`).
        what: String,
        /// The completion status.
        status: Status,
    },
    /// An admin command got no completion in time.
    #[error("NVMe admin command {what} (CID {cid}) timed out after {waited_ms} ms")]
    AdminTimeout {
        /// The command.
        what: String,
        /// Its command identifier.
        cid: u16,
        /// How long it waited.
        waited_ms: u64,
    },
    /// A completion named a command identifier with no outstanding command.
    #[error("NVMe queue {qid}: completion for unknown CID {cid} (sqhd {sqhd}, status {status})")]
    UnknownCid {
        /// Queue id.
        qid: u16,
        /// The CID in the completion.
        cid: u16,
        /// SQHD in the completion.
        sqhd: u16,
        /// Its status.
        status: Status,
    },
    /// No free command identifier or submission slot.
    #[error("NVMe queue {qid} is full ({depth} entries)")]
    QueueFull {
        /// Queue id.
        qid: u16,
        /// Ring entries.
        depth: u16,
    },
    /// Building the PRP entries of a transfer failed. The [`PrpError`] is part of the message (it
    /// names the entry), so it is not repeated as `source()`.
    #[error("PRP list: {0}")]
    Prp(PrpError),
    /// The controller cannot work with this host (page size, entry sizes, queue sizes, command set).
    #[error("NVMe controller unsupported: {what}")]
    Unsupported {
        /// What is missing, with expected vs found values.
        what: String,
    },
    /// The namespace asked for is not active on the controller.
    #[error("NVMe namespace {nsid} not found (controller has {available:?})")]
    NoNamespace {
        /// The NSID asked for.
        nsid: u32,
        /// Active NSIDs.
        available: Vec<u32>,
    },
    /// DMA memory could not be allocated or mapped.
    #[error("DMA allocation of {len} bytes failed{}", if *.hugepages { " (hugepages)" } else { "" })]
    DmaAlloc {
        /// Bytes requested.
        len: usize,
        /// Whether hugepages were required.
        hugepages: bool,
        /// The OS error, if any.
        #[source]
        cause: Option<std::io::Error>,
    },
    /// Host memory lent to the device is not in a DMA-mappable region.
    #[error("DMA map of {len} bytes at {addr:#x} failed: {why}")]
    DmaMap {
        /// Host address.
        addr: usize,
        /// Length.
        len: usize,
        /// Why.
        why: String,
    },
    /// Opening a sim namespace backing file failed, or it is not a namespace image (shorter than
    /// one LBA). The cause is part of the message (it says what is wrong with the file), so it is
    /// not repeated as `source()`.
    #[error("sim namespace {nsid} backing file {path}: {cause}")]
    SimBacking {
        /// The namespace.
        nsid: u32,
        /// The file.
        path: std::path::PathBuf,
        /// What failed: the OS error, or why the file is refused.
        cause: std::io::Error,
    },
    /// No PCI function of that address exists (`/sys/bus/pci/devices/BDF` is absent): a typo or a
    /// device that is gone, rather than a VFIO step that failed.
    #[error("no PCI device {bdf} (/sys/bus/pci/devices/{bdf} does not exist; see `picchio nvme list`)")]
    NoPciDevice {
        /// The address asked for, e.g. `0000:01:00.0`.
        bdf: String,
    },
    /// A VFIO operation failed (the OS error is the `source()`).
    #[error("VFIO {op} on {what}")]
    Vfio {
        /// The operation (ioctl or file).
        op: &'static str,
        /// The device, group or path.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl From<PrpError> for Error {
    fn from(e: PrpError) -> Error {
        Error::Prp(e)
    }
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;
    use picchio_core::error::chain;
    use std::error::Error as _;

    #[test]
    fn display_and_source() {
        let e = Error::InitTimeout { state: InitState::WaitReady1, waited_ms: 500 };
        assert_eq!(e.to_string(), "NVMe init timed out in state WaitReady1 after 500 ms (CAP.TO deadline)");
        let e = Error::AdminCommand { what: "Identify Controller".into(), status: Status::INVALID_FIELD };
        assert_eq!(
            e.to_string(),
            "NVMe admin command Identify Controller failed: Invalid Field in Command (SCT 0x0 generic, SC 0x02)"
        );
        let e = Error::DmaAlloc { len: 4096, hugepages: true, cause: Some(std::io::Error::from_raw_os_error(12)) };
        assert!(e.to_string().ends_with("(hugepages)"));
        assert!(e.source().is_some());
        let e = Error::Prp(PrpError::NotDwordAligned { index: 0, addr: 0x1001 });
        assert!(e.to_string().contains("entry 0"), "{e}");
    }

    /// Each cause is printed once: in the message or as `source()`, never both (like vfio-ioctls'
    /// `test_vfio_error_fmt`), and [`picchio_core::error::chain`] joins them.
    #[test]
    fn a_cause_is_in_the_message_or_the_source_not_both() {
        let os = || std::io::Error::from_raw_os_error(libc::EBUSY);
        let busy = os().to_string();
        let e = Error::Vfio { op: "VFIO_GROUP_SET_CONTAINER", what: "/dev/vfio/7".into(), source: os() };
        assert_eq!(e.to_string(), "VFIO VFIO_GROUP_SET_CONTAINER on /dev/vfio/7");
        assert_eq!(e.source().map(|s| s.to_string()), Some(busy.clone()));
        assert_eq!(chain(&e).to_string(), format!("VFIO VFIO_GROUP_SET_CONTAINER on /dev/vfio/7: {busy}"));

        let e = Error::SimBacking { nsid: 2, path: "/tmp/ns2".into(), cause: os() };
        assert_eq!(e.to_string(), format!("sim namespace 2 backing file /tmp/ns2: {busy}"));
        assert!(e.source().is_none(), "the cause is in the message");
        assert_eq!(chain(&e).to_string(), e.to_string());

        let e = Error::DmaAlloc { len: 8192, hugepages: false, cause: Some(os()) };
        assert_eq!(e.to_string(), "DMA allocation of 8192 bytes failed");
        assert_eq!(chain(&e).to_string(), format!("DMA allocation of 8192 bytes failed: {busy}"));
        let e = Error::DmaAlloc { len: 8192, hugepages: false, cause: None };
        assert!(e.source().is_none());

        let e: Error = PrpError::OutOfEntries { index: 513, capacity: 512 }.into();
        assert_eq!(
            e.to_string(),
            "PRP list: entry 513: out of PRP list entries (the list pages hold 512 data entries)"
        );
        assert!(e.source().is_none(), "the PRP error is in the message");
        assert_eq!(chain(&e).to_string(), e.to_string());

        let e = Error::QueueFull { qid: 1, depth: 32 };
        assert_eq!(e.to_string(), "NVMe queue 1 is full (32 entries)");
        assert!(e.source().is_none());
    }
}
