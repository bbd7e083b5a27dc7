//! Error injection for the sim: each [`Fault`] fires once, on the command it names. A controller
//! reset (CC.EN 1 → 0) clears CSTS.CFS and drops held commands, as on a real controller; faults not
//! yet fired stay armed.

use crate::spec::Status;

/// Which command a fault hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultWhen {
    /// The Nth I/O command fetched from any I/O submission queue since the sim started (1-based).
    Io(u64),
    /// The next admin command with this opcode.
    AdminOpcode(u8),
    /// The `nth` I/O command with this opcode (1-based) since the sim started: the 3rd NVM Write,
    /// whatever the reads around it.
    IoOpcode {
        /// The opcode ([`crate::spec::nvm`]).
        opcode: u8,
        /// Which one of them (1-based).
        nth: u64,
    },
}

/// What happens to that command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// Complete it with this status (no data moved).
    Status(Status),
    /// Execute it but never post its completion (the driver must time out).
    DropCompletion,
    /// Set CSTS.CFS and stop processing commands until the controller is reset (CC.EN = 0).
    Fatal,
    /// Keep the command outstanding, neither executed nor completed (a hung command), until an
    /// Abort names it (it then completes with Command Abort Requested) or the controller is reset.
    Hold,
    /// Complete it with Successful Completion without executing it: a Write whose data never
    /// reaches the media (a device that loses acknowledged writes, as dm-flakey's `drop_writes`),
    /// a Read that moves no data.
    Vanish,
}

/// One injected fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// Which command.
    pub when: FaultWhen,
    /// What happens.
    pub action: FaultAction,
}

impl Fault {
    /// Completes the Nth I/O command with `status`.
    pub fn io_status(nth: u64, status: Status) -> Fault {
        Fault { when: FaultWhen::Io(nth), action: FaultAction::Status(status) }
    }
    /// Drops the completion of the Nth I/O command.
    pub fn io_drop(nth: u64) -> Fault {
        Fault { when: FaultWhen::Io(nth), action: FaultAction::DropCompletion }
    }
    /// Raises CSTS.CFS when the Nth I/O command is fetched.
    pub fn io_fatal(nth: u64) -> Fault {
        Fault { when: FaultWhen::Io(nth), action: FaultAction::Fatal }
    }
    /// Holds the Nth I/O command outstanding until it is aborted or the controller is reset.
    pub fn io_hold(nth: u64) -> Fault {
        Fault { when: FaultWhen::Io(nth), action: FaultAction::Hold }
    }
    /// Acknowledges the `nth` I/O command `opcode` without executing it ([`FaultAction::Vanish`]).
    pub fn io_vanish(opcode: u8, nth: u64) -> Fault {
        Fault { when: FaultWhen::IoOpcode { opcode, nth }, action: FaultAction::Vanish }
    }
    /// Completes the next admin command `opcode` with `status`.
    pub fn admin_status(opcode: u8, status: Status) -> Fault {
        Fault { when: FaultWhen::AdminOpcode(opcode), action: FaultAction::Status(status) }
    }
}

/// Takes the fault matching this command, if any.
/// `io_count` counts every I/O command so far (this one included), `opcode_count` those with this
/// command's opcode.
pub(crate) fn take(
    faults: &mut Vec<Fault>,
    qid: u16,
    opcode: u8,
    io_count: u64,
    opcode_count: u64,
) -> Option<FaultAction> {
    let i = faults.iter().position(|f| match f.when {
        FaultWhen::Io(n) => qid != 0 && n == io_count,
        FaultWhen::AdminOpcode(op) => qid == 0 && op == opcode,
        FaultWhen::IoOpcode { opcode: op, nth } => qid != 0 && op == opcode && nth == opcode_count,
    })?;
    Some(faults.remove(i).action)
}
