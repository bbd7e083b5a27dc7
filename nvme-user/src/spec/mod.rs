//! The NVMe base specification (2.0, with the NVM command set) as Rust types: controller registers
//! (§3.1), submission and completion queue entries (§4.2, §4.6), status codes (§4.6.1.2) and the
//! Identify data structures (§5.17). Layouts are pinned by const asserts and unit tests.

pub mod cmd;
pub mod identify;
pub mod regs;
pub mod status;

pub use cmd::{admin, nvm, Command, Completion, Lba};
pub use identify::{IdentifyController, IdentifyNamespace, LbaFormat};
pub use regs::{Aqa, Cap, Cc, Csts, Vs};
pub use status::{Status, StatusCodeType};
