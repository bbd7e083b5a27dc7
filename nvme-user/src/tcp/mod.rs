//! The S6 tier: a user-space NVMe/TCP initiator (NVM Express TCP Transport Specification 1.0 and
//! the NVMe over Fabrics parts of the NVMe base specification 2.0) reading and writing a namespace
//! of a remote subsystem, served by a standard target (Linux nvmet-tcp, SPDK nvmf_tgt).
//!
//! - [`pdu`]: the PDUs (ICReq/ICResp, CapsuleCmd/CapsuleResp, C2HData, H2CData, R2T,
//!   C2HTermReq/H2CTermReq), CRC32C digests and SGL descriptors.
//! - [`fabrics`]: Connect, Property Get/Set, Keep Alive, Get Log Page, the Discovery Log Page.
//! - `conn`: one connection (one queue): ICReq/ICResp, sending capsules and H2CData, receiving
//!   and checking every PDU.
//! - `assoc`: an association: admin Connect, CC.EN/CSTS.RDY through properties, Identify, Keep
//!   Alive, I/O queue Connects, CC.SHN/CSTS.SHST on drop; [`discover`].
//! - [`NvmeTcpQueue`]: the [`picchio_core::IoQueue`] engine over several I/O queues (one TCP
//!   connection each), with timeouts, reconnect and resubmission of reads.
//! - [`model`]: an in-process NVMe/TCP target model over a loopback socket, with fault injection,
//!   for tests.
//! - [`replay`]: a loopback target that plays recorded (or fuzzed) controller-to-host bytes back,
//!   a recording proxy, and the fixed scenario the `nvme_tcp` fuzz target drives.
//!
//! # Example: the initiator against the model target
//! ```
//! use picchio_core::{io::read_blocking, IoQueue};
//! use picchio_nvme::tcp::{model::{ModelConfig, TargetModel}, NvmeTcpQueue, TcpOptions};
//!
//! let model = TargetModel::start(ModelConfig::memory(vec![5u8; 1 << 20], 512))?;
//! let mut q = NvmeTcpQueue::connect(model.target(1), TcpOptions::default())?;
//! let buf = read_blocking(&mut q, 4096, 8192)?;
//! assert!(buf.as_slice()[..8192].iter().all(|&b| b == 5));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod assoc;
mod conn;
pub mod error;
pub mod fabrics;
pub mod model;
pub mod pdu;
mod queue;
pub mod replay;

pub use assoc::{default_host_identity, discover, ControllerInfo, TcpOptions};
pub use error::{TcpError, TcpResult};
pub use queue::{NvmeTcpQueue, TcpQueueStats, TcpTarget};
