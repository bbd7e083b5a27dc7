//! A user-space NVMe driver for Picchio's S5 tier: routed experts read straight from an NVMe
//! namespace into cache slots, with no kernel in the data path.
//!
//! The layers, bottom to top:
//! - [`spec`]: the NVMe base specification as types (registers, commands, completions, statuses,
//!   Identify pages), with layouts pinned against the spec.
//! - [`bar`]: the register window ([`Bar`]) the driver talks through, implemented by the VFIO BAR0
//!   mapping and by the software controller model [`sim`], so the driver code is identical over both.
//! - [`dma`]: memory the device reads and writes, with an [`Iova`]; never behind a Rust reference
//!   while the device may use it.
//! - [`prp`]: PRP entries and chained PRP lists for a transfer of up to MDTS.
//! - [`queue`]: a submission/completion queue pair with one tracker (and its PRP-list pages) per
//!   command identifier. Submitting a raw command is `unsafe`: its data pointers are DMA targets.
//! - [`ctrlr`]: controller bring-up as an explicit state machine, admin commands, Abort, controller
//!   reset on the same DMA memory, shutdown on drop.
//! - [`request`]: the request layer every transport shares (SPDK's `nvme_request`): a read, a
//!   [`WriteReq`] or a Flush, split at MDTS into child commands, queued while no CID is free,
//!   resubmitted when a transport lost it (reads only), completed when its last child is.
//! - [`engine`]: [`NvmeQueue`], the [`picchio_core::IoQueue`] engine over one I/O queue pair: the safe
//!   API. A timed-out command is aborted, else the controller is reset (also on CSTS.CFS); exactly
//!   the affected requests fail with a typed [`engine::ReadFailure`], within an
//!   [`engine::RecoveryPolicy`]; an interrupt flag (SIGINT) ends every wait.
//! - [`sink`]: [`NvmeSink`], the image writer beside that reader: a
//!   [`picchio_core::format::ImageSink`] writing a `.picchioflat` image with NVM Write and Flush.
//! - [`sim`]: a controller model in host memory, backed by files, with error injection (statuses,
//!   dropped completions, hung commands, CSTS.CFS) and Abort and reset handled like a controller.
//! - [`tcp`]: the S6 tier, a user-space NVMe/TCP initiator ([`tcp::NvmeTcpQueue`]) for a namespace
//!   of a remote NVMe-oF subsystem, discovery, and an in-process target model with fault injection.
//! - `vfio` (Linux): the VFIO device, BAR0 mapping and IOMMU DMA mappings for real controllers.
//!
//! # Example: the driver against the sim
//! ```
//! use picchio_core::{io::read_blocking, IoQueue};
//! use picchio_nvme::{sim::SimConfig, NvmeQueue, NvmeQueueOptions};
//!
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("ns1");
//! std::fs::write(&path, vec![7u8; 1 << 20])?;
//! let (mut q, _sim) = NvmeQueue::open_sim(SimConfig::single(&path, 512), &NvmeQueueOptions::default())?;
//! assert_eq!(q.describe(), "nvme(sim, nsid 1, qd 32)");
//! let buf = read_blocking(&mut q, 4096, 8192)?;
//! assert!(buf.as_slice()[..8192].iter().all(|&b| b == 7));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Real controllers (VFIO, Linux)
//! Bind the controller to `vfio-pci`, reserve 2 MiB hugepages, then
//! `vfio::open_controller(bdf, opts)` maps BAR0, enables bus mastering and initializes the controller
//! with [`dma::HugepageDma`] memory; wrap it with [`NvmeQueue::with_bounce_buffer`] (the VFIO data
//! path). Buffers from the queue's [`picchio_core::IoQueue::slot_allocator`] (the expert cache's
//! slots, in one hugepage [`dma::DmaRegion`] mapped once) are read with no copy; any other buffer
//! goes through bounce buffers, counted. `examples/nvme_probe.rs` opens a controller this way and
//! prints what Identify reports.
//!
//! # Cargo feature `fault-injection`
//! Only for the VM harness (tests/vm): `Controller::submit_raw_for_fault_test` submits a command
//! with unchecked data pointers (the stray-DMA check), and builds `examples/nvme_fault_probe.rs`.
//! Nothing else enables it.
#![deny(missing_docs)]
// VFIO, hugepages and the sim's positional file I/O are Linux facilities: elsewhere the crate is empty
// (the runtime's `nvme:` store then reports that it needs Linux).
#![cfg(target_os = "linux")]

pub mod bar;
pub mod ctrlr;
pub mod dma;
pub mod engine;
pub mod error;
pub mod prp;
pub mod queue;
pub mod request;
pub mod sim;
pub mod sink;
pub mod spec;
pub mod tcp;
#[cfg(target_os = "linux")]
pub mod vfio;

pub use bar::Bar;
pub use ctrlr::{Controller, CtrlrOptions, InitState, Namespace};
pub use dma::{DmaBuf, DmaPool, HeapDma, Iova};
pub use engine::{NvmeQueue, NvmeQueueOptions};
pub use error::{Error, Result};
pub use queue::{Cid, QueuePair};
pub use request::WriteReq;
pub use sink::{NvmWriteQueue, NvmeSink};
pub use tcp::{NvmeTcpQueue, TcpOptions, TcpTarget};
