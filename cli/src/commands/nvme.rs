//! `picchio nvme`.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use picchio_runtime::nvme_admin::{self, Bdf, ControllerInfo};

const SYSFS: &str = "/sys";
/// How long a new driver binding is waited for after `drivers_probe`.
const BIND_WAIT: Duration = Duration::from_secs(5);

/// Options of `picchio nvme`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// List NVMe controllers (PCI class 0x010802): address, vendor:device, bound driver, and for
    /// kernel-bound ones their namespaces, sizes and mounts.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Hand a controller to vfio-pci for the user-space driver (needs root and the vfio-pci module).
    /// Its namespaces disappear from the kernel until `picchio nvme unbind`.
    Bind {
        /// PCI address, DOMAIN:BUS:DEVICE.FUNCTION (e.g. 0000:01:00.0), as `picchio nvme list` prints.
        #[arg(value_name = "BDF")]
        bdf: String,
        /// Detach it even when a namespace or partition is mounted (never the one holding /).
        #[arg(long)]
        force: bool,
    },
    /// Give a controller back to the kernel nvme driver (needs root).
    Unbind {
        /// PCI address, DOMAIN:BUS:DEVICE.FUNCTION.
        #[arg(value_name = "BDF")]
        bdf: String,
    },
    /// Open a vfio-pci-bound controller with the user-space driver and print its Identify data and
    /// namespaces (needs hugepages; the controller is shut down cleanly afterwards).
    Identify {
        /// PCI address, DOMAIN:BUS:DEVICE.FUNCTION.
        #[arg(value_name = "BDF")]
        bdf: String,
    },
    /// Ask the NVMe/TCP discovery controller at HOST:PORT (Connect to
    /// nqn.2014-08.org.nvmexpress.discovery, Get Log Page 70h) which subsystems it offers, and print
    /// each as trtype, traddr, trsvcid, subnqn and the matching --store nvme-tcp:// URI.
    Discover {
        /// The discovery controller, HOST:PORT (NVMe/TCP discovery usually listens on 8009; Linux
        /// nvmet answers discovery on every port).
        #[arg(value_name = "HOST:PORT")]
        addr: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn mountinfo() -> anyhow::Result<String> {
    std::fs::read_to_string("/proc/self/mountinfo").context("cannot read /proc/self/mountinfo")
}

fn print_table(list: &[ControllerInfo]) {
    println!("{:<14} {:<10} {:<10} {:<6} NAMESPACES", "BDF", "ID", "DRIVER", "GROUP");
    for c in list {
        let ns: Vec<String> = c
            .namespaces
            .iter()
            .map(|n| {
                let mut s = format!("{} {}", n.block.name, picchio_core::human_bytes(n.block.size));
                let mounts: Vec<String> = std::iter::once(&n.block)
                    .chain(&n.partitions)
                    .flat_map(|b| {
                        let on = b.mounts.iter().map(move |m| format!("{} on {m}", b.name));
                        on.chain(b.holders.iter().map(move |h| format!("{} held by {h}", b.name)))
                    })
                    .collect();
                if !mounts.is_empty() {
                    s.push_str(&format!(" (in use: {})", mounts.join(", ")));
                }
                s
            })
            .collect();
        println!(
            "{:<14} {:<10} {:<10} {:<6} {}",
            c.bdf,
            c.id,
            c.driver.as_deref().unwrap_or("none"),
            c.iommu_group.as_deref().unwrap_or("-"),
            if ns.is_empty() { "-".to_string() } else { ns.join("; ") }
        );
    }
}

pub fn exec(a: Args) -> anyhow::Result<()> {
    let sysfs = Path::new(SYSFS);
    match a.cmd {
        Cmd::List { json } => {
            let list = nvme_admin::list(sysfs, &mountinfo()?);
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else if list.is_empty() {
                println!("no NVMe controller found (no PCI device of class 0x010802 in {SYSFS}/bus/pci/devices)");
            } else {
                print_table(&list);
            }
        }
        Cmd::Bind { bdf, force } => {
            let bdf = Bdf::parse(&bdf)?;
            let r = nvme_admin::bind_vfio(sysfs, &mountinfo()?, &bdf, force, BIND_WAIT)?;
            println!("{} is on vfio-pci (was {})", r.bdf, r.previous.as_deref().unwrap_or("unbound"));
            match (&r.iommu_group, &r.group_device) {
                (Some(g), Some(d)) => println!("IOMMU group {g}: open {d}"),
                _ => println!("no IOMMU group: the VFIO device cannot be opened (enable the IOMMU or no-IOMMU mode)"),
            }
        }
        Cmd::Unbind { bdf } => {
            let bdf = Bdf::parse(&bdf)?;
            let prev = nvme_admin::unbind_vfio(sysfs, &bdf, BIND_WAIT)?;
            println!("{bdf} is on nvme (was {})", prev.as_deref().unwrap_or("unbound"));
        }
        Cmd::Identify { bdf } => identify(&Bdf::parse(&bdf)?)?,
        Cmd::Discover { addr, json } => discover(&addr, json)?,
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn identify(bdf: &Bdf) -> anyhow::Result<()> {
    let ctrlr = picchio_nvme::vfio::open_controller(bdf.as_str(), picchio_nvme::CtrlrOptions::default())
        .with_context(|| format!("cannot open {bdf} through VFIO (bind it first: `picchio nvme bind {bdf}`)"))?;
    let id = ctrlr.identify().context("the controller returned no Identify data")?;
    println!("controller {bdf}: NVMe {}", ctrlr.version());
    println!("  VID  {:#06x}", id.vid);
    println!("  SN   {}", id.sn);
    println!("  MN   {}", id.mn);
    println!("  FR   {}", id.fr);
    println!(
        "  MDTS {} ({})",
        id.mdts,
        if id.mdts == 0 { "no limit".to_string() } else { format!("max transfer {} bytes", ctrlr.max_transfer()) }
    );
    for ns in ctrlr.namespaces() {
        println!(
            "  namespace {}: LBA size {} B, {} blocks, {}",
            ns.nsid,
            ns.lba_size,
            ns.blocks,
            picchio_core::human_bytes(ns.bytes())
        );
    }
    // Dropping the controller shuts it down (CC.SHN) and releases the VFIO device.
    drop(ctrlr);
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn identify(_bdf: &Bdf) -> anyhow::Result<()> {
    anyhow::bail!("picchio nvme identify needs Linux VFIO")
}

#[cfg(target_os = "linux")]
fn discover(addr: &str, json: bool) -> anyhow::Result<()> {
    if !addr.starts_with('[') && addr.rsplit_once(':').is_none_or(|(_, p)| p.parse::<u16>().is_err()) {
        anyhow::bail!("{addr:?}: give the discovery controller as HOST:PORT, e.g. 192.0.2.7:8009");
    }
    let entries = picchio_nvme::tcp::discover(addr, &picchio_nvme::TcpOptions::default())
        .with_context(|| format!("NVMe/TCP discovery at {addr}"))?;
    let store = |e: &picchio_nvme::tcp::fabrics::DiscoveryEntry| {
        let host = if e.traddr.contains(':') { format!("[{}]", e.traddr) } else { e.traddr.clone() };
        (e.trtype == 3 && e.subtype == 2).then(|| format!("nvme-tcp://{host}:{}/{}", e.trsvcid, e.subnqn))
    };
    if json {
        let v: Vec<_> = entries
            .iter()
            .map(|e| {
                serde_json::json!({
                    "trtype": e.trtype_name(),
                    "adrfam": e.adrfam,
                    "subtype": e.subtype_name(),
                    "traddr": e.traddr,
                    "trsvcid": e.trsvcid,
                    "subnqn": e.subnqn,
                    "portid": e.portid,
                    "store": store(e),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if entries.is_empty() {
        println!("{addr}: the discovery controller lists no subsystem (Discovery Log Page 70h has no record)");
        return Ok(());
    }
    println!("{:<6} {:<24} {:<8} {:<28} SUBNQN", "TRTYPE", "TRADDR", "TRSVCID", "SUBTYPE");
    for e in &entries {
        println!("{:<6} {:<24} {:<8} {:<28} {}", e.trtype_name(), e.traddr, e.trsvcid, e.subtype_name(), e.subnqn);
        if let Some(s) = store(e) {
            println!("       --store {s}");
        }
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn discover(_addr: &str, _json: bool) -> anyhow::Result<()> {
    anyhow::bail!("picchio nvme discover needs the NVMe/TCP initiator of picchio-nvme, which is Linux-only")
}
