//! The `--store` of a bench run: which image, on what, and how each engine opens it.

use std::path::PathBuf;

use picchio_core::StoreUri;

use super::env::TargetSpec;
use picchio_runtime::error::{Error, Result};

/// A store a bench experiment reads.
///
/// | `--store` | meaning |
/// | --- | --- |
/// | `file:PATH` or a path | a `.picchioflat` file (psync buffered/direct, uring) |
/// | `raw:/dev/X[@BYTES]` | an image on a block device at byte `BYTES` (psync direct, uring) |
/// | `nvme-sim:PATH` | the image file served as namespace 1 of picchio-nvme's software controller model, read by our NVMe driver (engine `nvme-sim`) |
/// | `nvme:BDF[/NSID]` | an image at LBA 0 of a real NVMe namespace through our VFIO driver (engine `nvme`) |
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BenchStore {
    /// A file.
    File(PathBuf),
    /// A block device and the byte offset of the image on it.
    Raw {
        /// The device node.
        device: PathBuf,
        /// Byte offset of the image (a whole number of logical blocks).
        offset: u64,
    },
    /// The controller model over an image file.
    NvmeSim(PathBuf),
    /// A real controller through VFIO.
    Nvme {
        /// PCI address.
        bdf: String,
        /// Namespace id.
        nsid: u32,
    },
}

impl std::str::FromStr for BenchStore {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        if let Some(p) = s.strip_prefix("nvme-sim:") {
            if p.is_empty() {
                return Err(Error::Invalid(
                    "--store nvme-sim: needs the image file, e.g. nvme-sim:e.picchioflat".into(),
                ));
            }
            return Ok(BenchStore::NvmeSim(p.into()));
        }
        let forms = "give file:PATH (or a path), raw:/dev/X[@BYTES], nvme-sim:PATH or nvme:BDF[/NSID] \
                     (a .picchioflat image: `picchio synth` or `picchio pack` writes one)";
        let uri = s.parse::<StoreUri>().map_err(|e| match e {
            // StoreUri's list of schemes names `auto` and `safetensors`, which bench does not read,
            // and not `nvme-sim:`, which only bench reads.
            picchio_core::Error::BadUri { message, .. }
                if message.starts_with("unknown scheme") || message.starts_with("empty store") =>
            {
                Error::Invalid(format!("--store {s:?}: {message_ours}", message_ours = forms))
            }
            other => Error::from(other),
        })?;
        match uri {
            StoreUri::File(p) => Ok(BenchStore::File(p)),
            StoreUri::Raw { device, offset } => Ok(BenchStore::Raw { device, offset }),
            StoreUri::Nvme { bdf, nsid } => Ok(BenchStore::Nvme { bdf, nsid }),
            StoreUri::Auto | StoreUri::Safetensors => {
                Err(Error::Invalid(format!("--store {s}: bench reads a .picchioflat image: {forms}")))
            }
        }
    }
}

impl std::fmt::Display for BenchStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BenchStore::File(p) => write!(f, "file:{}", p.display()),
            BenchStore::Raw { device, offset } => {
                write!(f, "{}", StoreUri::Raw { device: device.clone(), offset: *offset })
            }
            BenchStore::NvmeSim(p) => write!(f, "nvme-sim:{}", p.display()),
            BenchStore::Nvme { bdf, nsid } => write!(f, "nvme:{bdf}/{nsid}"),
        }
    }
}

impl BenchStore {
    /// What the environment record describes.
    pub fn target_spec(&self) -> TargetSpec {
        let uri = self.to_string();
        match self {
            BenchStore::File(path) => TargetSpec::File { uri, path: path.clone() },
            BenchStore::Raw { device, .. } => TargetSpec::BlockDevice { uri, path: device.clone() },
            BenchStore::NvmeSim(backing) => TargetSpec::NvmeSim { uri, backing: backing.clone() },
            BenchStore::Nvme { bdf, .. } => TargetSpec::Nvme { uri, bdf: bdf.clone() },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_every_form() {
        for s in ["file:/a/e.picchioflat", "raw:/dev/loop3@4096", "nvme-sim:/a/e", "nvme:0000:03:00.0/1"] {
            assert_eq!(s.parse::<BenchStore>().unwrap().to_string(), s);
        }
        assert_eq!("x.picchioflat".parse::<BenchStore>().unwrap(), BenchStore::File("x.picchioflat".into()));
        for s in ["auto", "safetensors", "nvme-sim:", "s3:x"] {
            let e = s.parse::<BenchStore>().unwrap_err().to_string();
            if s != "nvme-sim:" {
                assert!(e.contains("nvme-sim:PATH") && !e.contains("safetensors,") && !e.contains("auto,"), "{s}: {e}");
            }
        }
    }
}
