//! [`TcpError`]: one variant per failing step of the NVMe/TCP initiator, each naming the target
//! address, the queue and the step.

use crate::spec::Status;

/// Errors of the NVMe/TCP initiator. `addr` is `HOST:PORT`; `qid` 0 is the admin queue.
#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    /// The TCP connection could not be made (refused, unreachable, no answer).
    #[error("nvme-tcp {addr}: TCP connect for queue {qid} failed")]
    Connect {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A socket read or write failed during `step`.
    #[error("nvme-tcp {addr} queue {qid}: {step}: socket error")]
    Socket {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// What was being done (e.g. `ICReq/ICResp`, `Read CID 3`).
        step: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The target closed the connection during `step`.
    #[error("nvme-tcp {addr} queue {qid}: {step}: the target closed the connection")]
    Closed {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// What was being done.
        step: String,
    },
    /// Nothing arrived within the timeout.
    #[error("nvme-tcp {addr} queue {qid}: {step}: no answer within {waited_ms} ms")]
    Timeout {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// What was being waited for.
        step: String,
        /// The timeout, ms.
        waited_ms: u64,
    },
    /// The ICResp is not one this host can use (PFV, MAXH2CDATA, CPDA, digests not as requested).
    #[error("nvme-tcp {addr} queue {qid}: ICResp refused: {what}")]
    IcResp {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// The field and its value.
        what: String,
    },
    /// A PDU from the target has a field out of range (type, HLEN, PDO, PLEN, CCCID, offsets,
    /// lengths, flags): a protocol error that ends the connection (§3.6.2.4).
    #[error("nvme-tcp {addr} queue {qid}: bad {pdu} PDU: {what}")]
    BadPdu {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// The PDU type's name.
        pdu: &'static str,
        /// The field, its value and what was expected.
        what: String,
    },
    /// A PDU header digest does not match its header.
    #[error("nvme-tcp {addr} queue {qid}: {pdu} header digest mismatch: PDU says {got:#010x}, header hashes to {want:#010x}")]
    HeaderDigest {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// The PDU type's name.
        pdu: &'static str,
        /// The digest received.
        got: u32,
        /// The CRC32C computed.
        want: u32,
    },
    /// A data digest does not match the data.
    #[error("nvme-tcp {addr} queue {qid}: {pdu} for CID {cid}: data digest mismatch: PDU says {got:#010x}, data hashes to {want:#010x}")]
    DataDigest {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// The PDU type's name.
        pdu: &'static str,
        /// The command.
        cid: u16,
        /// The digest received.
        got: u32,
        /// The CRC32C computed.
        want: u32,
    },
    /// The target ended the connection with a C2HTermReq.
    #[error("nvme-tcp {addr} queue {qid}: the target terminated the connection (C2HTermReq): {fes_name} (FES {fes:#04x}, FEI {fei:#x})")]
    Terminated {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// FES.
        fes: u16,
        /// Its spec name.
        fes_name: &'static str,
        /// FEI.
        fei: u32,
    },
    /// Connect completed with an error status.
    #[error("nvme-tcp {addr} queue {qid}: Connect to {subnqn} rejected: {status_name}{}", ipo_text(*.iattr, *.ipo))]
    ConnectRejected {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// The subsystem NQN asked for.
        subnqn: String,
        /// The status.
        status: Status,
        /// The spec's name ([`super::fabrics::status_name`]).
        status_name: String,
        /// For Connect Invalid Parameters: IATTR (0: the parameter is in the command, 1: in the data).
        iattr: Option<u8>,
        /// For Connect Invalid Parameters: IPO, the byte offset of the parameter.
        ipo: Option<u16>,
    },
    /// A command completed with an error status during `step`.
    #[error("nvme-tcp {addr} queue {qid}: {step} failed: {status}")]
    Command {
        /// Target.
        addr: String,
        /// Queue.
        qid: u16,
        /// The command (e.g. `Property Get CAP`, `Identify Controller`).
        step: String,
        /// The status.
        status: Status,
    },
    /// CSTS.RDY did not become 1 within CAP.TO after CC.EN was set to 1.
    #[error("nvme-tcp {addr}: controller not ready: CSTS.RDY still 0 {waited_ms} ms after CC.EN = 1 (CSTS = {csts:#x}, CAP.TO deadline)")]
    NotReady {
        /// Target.
        addr: String,
        /// The last CSTS read.
        csts: u32,
        /// How long it waited.
        waited_ms: u64,
    },
    /// The controller reported fatal status (CSTS.CFS = 1).
    #[error("nvme-tcp {addr}: controller fatal status (CSTS.CFS = 1, CSTS = {csts:#x}) during {step}")]
    ControllerFatal {
        /// Target.
        addr: String,
        /// What was being done.
        step: String,
        /// CSTS.
        csts: u32,
    },
    /// The namespace is not there or unusable.
    #[error("nvme-tcp {addr} {subnqn}: namespace {nsid}: {what}")]
    Namespace {
        /// Target.
        addr: String,
        /// Subsystem.
        subnqn: String,
        /// NSID.
        nsid: u32,
        /// What is wrong (inactive, LBA format, size).
        what: String,
    },
    /// The controller cannot serve this host (MAXCMD, queue sizes, a non-zero ICDOFF).
    #[error("nvme-tcp {addr}: unsupported controller: {what}")]
    Unsupported {
        /// Target.
        addr: String,
        /// What, with the values.
        what: String,
    },
    /// The connection was lost and could not be re-established: the requests in flight failed.
    #[error("nvme-tcp {addr}: connection lost ({cause}); reconnecting failed {attempts} times, last: {last}")]
    Disconnected {
        /// Target.
        addr: String,
        /// What broke the connection.
        cause: String,
        /// Attempts made.
        attempts: u32,
        /// The last attempt's error.
        last: String,
    },
    /// A request failed after it was resubmitted `retries` times over fresh connections.
    #[error("nvme-tcp {addr}: {what} at byte {byte:#x} failed after {retries} resubmissions; last: {cause}")]
    RetriesExhausted {
        /// Target.
        addr: String,
        /// Read or write.
        what: &'static str,
        /// Byte offset in the namespace.
        byte: u64,
        /// Resubmissions.
        retries: u32,
        /// The last failure.
        cause: String,
    },
    /// A write was in flight on a connection that was lost; writes are not resubmitted.
    #[error("nvme-tcp {addr}: write at byte {byte:#x} was in flight when the connection was lost ({cause}); not resubmitted")]
    WriteLost {
        /// Target.
        addr: String,
        /// Byte offset.
        byte: u64,
        /// What broke the connection.
        cause: String,
    },
}

fn ipo_text(iattr: Option<u8>, ipo: Option<u16>) -> String {
    match (iattr, ipo) {
        (Some(a), Some(o)) => {
            format!(" (invalid parameter at byte {o} of the Connect {})", if a == 0 { "command" } else { "data" })
        }
        _ => String::new(),
    }
}

impl TcpError {
    /// The `io::ErrorKind` a request failing with this error completes with.
    pub fn kind(&self) -> std::io::ErrorKind {
        use std::io::ErrorKind as K;
        match self {
            TcpError::Timeout { .. } => K::TimedOut,
            TcpError::Connect { source, .. } => source.kind(),
            TcpError::Closed { .. } | TcpError::Disconnected { .. } => K::ConnectionAborted,
            TcpError::BadPdu { .. }
            | TcpError::HeaderDigest { .. }
            | TcpError::DataDigest { .. }
            | TcpError::Terminated { .. } => K::InvalidData,
            _ => K::Other,
        }
    }
    /// As an `io::Error` of [`TcpError::kind`] carrying `self`.
    pub fn into_io(self) -> std::io::Error {
        std::io::Error::new(self.kind(), self)
    }
    /// The [`TcpError`] inside an `io::Error` of a completion, if any.
    pub fn of(e: &std::io::Error) -> Option<&TcpError> {
        e.get_ref().and_then(|i| i.downcast_ref::<TcpError>())
    }
}

/// `Result` with [`TcpError`].
pub type TcpResult<T> = std::result::Result<T, TcpError>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::StatusCodeType;
    use std::error::Error as _;

    #[test]
    fn messages_name_address_queue_step_and_status() {
        let e = TcpError::ConnectRejected {
            addr: "10.0.0.1:4420".into(),
            qid: 0,
            subnqn: "nqn.x".into(),
            status: Status::new(StatusCodeType::CommandSpecific, 0x82),
            status_name: "Connect Invalid Parameters (SCT 0x1 command specific, SC 0x82)".into(),
            iattr: Some(1),
            ipo: Some(256),
        };
        assert_eq!(
            e.to_string(),
            "nvme-tcp 10.0.0.1:4420 queue 0: Connect to nqn.x rejected: Connect Invalid Parameters (SCT 0x1 \
             command specific, SC 0x82) (invalid parameter at byte 256 of the Connect data)"
        );
        let e = TcpError::Connect {
            addr: "127.0.0.1:1".into(),
            qid: 0,
            source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
        };
        assert_eq!(e.to_string(), "nvme-tcp 127.0.0.1:1: TCP connect for queue 0 failed");
        assert!(e.source().is_some());
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused);
        let io = TcpError::Timeout { addr: "a:1".into(), qid: 1, step: "Read CID 3".into(), waited_ms: 5 }.into_io();
        assert_eq!(io.kind(), std::io::ErrorKind::TimedOut);
        assert!(matches!(TcpError::of(&io), Some(TcpError::Timeout { .. })));
    }
}
