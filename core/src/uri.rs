//! Store URIs: where the runtime gets its routed experts from.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// A parsed `--store` value.
///
/// | text | meaning |
/// | --- | --- |
/// | `auto` | `<model>/experts.picchioflat` when present and valid, else `safetensors` |
/// | `safetensors` | the converted model's own expert tensors (always correct, never fast) |
/// | `file:PATH` or a bare path | a `.picchioflat` image in a file |
/// | `raw:/dev/X[@BYTES]` | an image on a block device, starting at byte offset `BYTES` (default 0) |
/// | `nvme:DDDD:BB:DD.F[/NSID]` | an image on an NVMe namespace (default 1) through the user-space driver |
/// | `nvme-sim:PATH` | an image file served as namespace 1 of picchio-nvme's software controller model, read by our NVMe driver (`picchio bench`) |
/// | `nvme-tcp://HOST:PORT/NQN[/NSID]` | an image on namespace `NSID` (default 1) of the NVMe-oF subsystem `NQN` served over NVMe/TCP at `HOST:PORT`, through our user-space initiator |
///
/// Which of these a command accepts is its own decision (a run reads `auto`, `safetensors`,
/// `file:`, `raw:`, `nvme:` and `nvme-tcp:`; bench reads the last five and `nvme-sim:`; pack and
/// synth write `file:`, `raw:`, `nvme:` and `nvme-tcp:`): each checks the variant it is given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreUri {
    /// Choose the flat store when it is there and valid, else safetensors.
    Auto,
    /// The converted safetensors experts.
    Safetensors,
    /// A `.picchioflat` file.
    File(PathBuf),
    /// A block device and the byte offset of the image on it.
    Raw {
        /// The device node.
        device: PathBuf,
        /// Byte offset of the superblock (a multiple of the logical block size).
        offset: u64,
    },
    /// An NVMe controller by PCI address and a namespace id.
    Nvme {
        /// PCI bus/device/function, `DDDD:BB:DD.F`.
        bdf: String,
        /// Namespace id (1-based).
        nsid: u32,
    },
    /// An image file served as namespace 1 of picchio-nvme's software controller model and read by
    /// our NVMe driver: the driver's and the model's cost, not a drive's.
    NvmeSim(PathBuf),
    /// A namespace of a remote NVMe-oF subsystem over NVMe/TCP (the S6 tier).
    NvmeTcp {
        /// `HOST:PORT` (an IPv6 host in brackets: `[::1]:4420`).
        addr: String,
        /// The subsystem's NQN (`nqn.…`).
        subnqn: String,
        /// Namespace id (1-based).
        nsid: u32,
    },
}

impl StoreUri {
    /// The file or device node this store reads on this machine (`file:`, `raw:` and the backing
    /// file of `nvme-sim:`), or `None` (`auto`, `safetensors`, `nvme:`, `nvme-tcp:`).
    pub fn local_path(&self) -> Option<&std::path::Path> {
        match self {
            StoreUri::File(p) | StoreUri::NvmeSim(p) => Some(p),
            StoreUri::Raw { device, .. } => Some(device),
            StoreUri::Auto | StoreUri::Safetensors | StoreUri::Nvme { .. } | StoreUri::NvmeTcp { .. } => None,
        }
    }
}

impl std::str::FromStr for StoreUri {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = |message: String| Error::BadUri { uri: s.into(), message };
        // The part after a scheme that names a file or device: refused when empty, saying what it needs.
        let named = |p: &str, needs: &str| if p.is_empty() { Err(bad(needs.into())) } else { Ok(PathBuf::from(p)) };
        if s == "auto" {
            return Ok(StoreUri::Auto);
        }
        if s == "safetensors" {
            return Ok(StoreUri::Safetensors);
        }
        if let Some(p) = s.strip_prefix("file:") {
            return Ok(StoreUri::File(named(p, "file: needs a path, e.g. file:model/experts.picchioflat")?));
        }
        if let Some(rest) = s.strip_prefix("raw:") {
            let (dev, offset) = match rest.rsplit_once('@') {
                Some((d, o)) => {
                    (d, o.parse::<u64>().map_err(|_| bad(format!("offset {o:?} after '@' is not a byte count")))?)
                }
                None => (rest, 0),
            };
            return Ok(StoreUri::Raw { device: named(dev, "raw: needs a device, e.g. raw:/dev/nvme1n1p2")?, offset });
        }
        if let Some(rest) = s.strip_prefix("nvme-tcp:") {
            return parse_nvme_tcp(rest).map_err(bad);
        }
        if let Some(p) = s.strip_prefix("nvme-sim:") {
            return Ok(StoreUri::NvmeSim(named(p, "nvme-sim: needs the image file, e.g. nvme-sim:e.picchioflat")?));
        }
        if let Some(rest) = s.strip_prefix("nvme:") {
            let (bdf, nsid) = match rest.split_once('/') {
                Some((b, n)) => (
                    b,
                    n.parse::<u32>()
                        .ok()
                        .filter(|&n| n >= 1)
                        .ok_or_else(|| bad(format!("namespace id {n:?} is not a number >= 1")))?,
                ),
                None => (rest, 1),
            };
            if !is_bdf(bdf) {
                return Err(bad(format!("{bdf:?} is not a PCI address DDDD:BB:DD.F, e.g. 0000:03:00.0")));
            }
            return Ok(StoreUri::Nvme { bdf: bdf.into(), nsid });
        }
        if let Some((scheme, _)) = s.split_once(':').filter(|_| !s.starts_with('/') && !s.starts_with('.')) {
            return Err(Error::UnknownScheme {
                uri: s.into(),
                scheme: scheme.into(),
                message: format!(
                    "unknown scheme \"{scheme}:\": use auto, safetensors, file:PATH, raw:/dev/X[@BYTES], \
                     nvme:BDF[/NSID], nvme-tcp://HOST:PORT/NQN[/NSID] or nvme-sim:PATH; a file name containing ':' is \
                     written file:PATH or ./PATH"
                ),
            });
        }
        if s.is_empty() {
            return Err(bad("empty store".into()));
        }
        Ok(StoreUri::File(s.into()))
    }
}

/// The NQN limit (NVMe base spec 2.0 §4.5: at most 223 bytes, UTF-8).
const NQN_MAX: usize = 223;

/// Parses what follows `nvme-tcp:`: `//HOST:PORT/NQN[/NSID]`.
fn parse_nvme_tcp(rest: &str) -> std::result::Result<StoreUri, String> {
    const EXAMPLE: &str = "e.g. nvme-tcp://192.0.2.7:4420/nqn.2026-01.io.example:experts/1";
    let Some(rest) = rest.strip_prefix("//") else {
        return Err(format!("nvme-tcp: is written nvme-tcp://HOST:PORT/NQN[/NSID], {EXAMPLE}"));
    };
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => match v6.split_once(']') {
            Some((h, p)) => (h, p.strip_prefix(':')),
            None => return Err(format!("{authority:?}: an IPv6 address is written in brackets, [::1]:4420")),
        },
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    if host.is_empty() {
        return Err(format!("nvme-tcp: needs a host, {EXAMPLE}"));
    }
    let port = match port {
        None | Some("") => {
            return Err(format!(
                "nvme-tcp://{authority}: needs a port (NVMe/TCP I/O controllers usually listen on 4420, discovery on \
                 8009), {EXAMPLE}"
            ))
        }
        Some(p) => {
            p.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| format!("port {p:?} is not a number 1..=65535"))?
        }
    };
    let (nqn, nsid) = match path.rsplit_once('/') {
        Some((n, id)) if !id.is_empty() && id.chars().all(|c| c.is_ascii_digit()) => (
            n,
            id.parse::<u32>()
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| format!("namespace id {id:?} is not a number >= 1"))?,
        ),
        _ => (path.trim_end_matches('/'), 1),
    };
    if nqn.is_empty() {
        return Err(format!(
            "nvme-tcp://{authority}: needs the subsystem NQN after the port (`picchio nvme discover {authority}` lists \
             them), {EXAMPLE}"
        ));
    }
    if !nqn.starts_with("nqn.") || nqn.len() > NQN_MAX {
        return Err(format!("{nqn:?} is not an NQN (nqn.yyyy-mm.reverse.domain:name, at most {NQN_MAX} bytes)"));
    }
    let addr = if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
    Ok(StoreUri::NvmeTcp { addr, subnqn: nqn.into(), nsid })
}

fn is_bdf(s: &str) -> bool {
    let parts: Vec<&str> = s.split([':', '.']).collect();
    let hex = |p: &str, n: usize| p.len() == n && p.chars().all(|c| c.is_ascii_hexdigit());
    parts.len() == 4 && hex(parts[0], 4) && hex(parts[1], 2) && hex(parts[2], 2) && hex(parts[3], 1)
}

impl std::fmt::Display for StoreUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreUri::Auto => write!(f, "auto"),
            StoreUri::Safetensors => write!(f, "safetensors"),
            StoreUri::File(p) => write!(f, "file:{}", p.display()),
            StoreUri::Raw { device, offset: 0 } => write!(f, "raw:{}", device.display()),
            StoreUri::Raw { device, offset } => write!(f, "raw:{}@{offset}", device.display()),
            StoreUri::Nvme { bdf, nsid } => write!(f, "nvme:{bdf}/{nsid}"),
            StoreUri::NvmeSim(p) => write!(f, "nvme-sim:{}", p.display()),
            StoreUri::NvmeTcp { addr, subnqn, nsid } => write!(f, "nvme-tcp://{addr}/{subnqn}/{nsid}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nvme_tcp_and_refuses_a_uri_without_port_or_nqn() {
        let p = |s: &str| s.parse::<StoreUri>();
        let t = |addr: &str, nqn: &str, nsid| StoreUri::NvmeTcp { addr: addr.into(), subnqn: nqn.into(), nsid };
        assert_eq!(
            p("nvme-tcp://10.0.0.2:4420/nqn.2026-01.io.x:experts").unwrap(),
            t("10.0.0.2:4420", "nqn.2026-01.io.x:experts", 1)
        );
        assert_eq!(
            p("nvme-tcp://host.lan:4420/nqn.2026-01.io.x:e/3").unwrap(),
            t("host.lan:4420", "nqn.2026-01.io.x:e", 3)
        );
        assert_eq!(p("nvme-tcp://[::1]:4420/nqn.a:b/2").unwrap(), t("[::1]:4420", "nqn.a:b", 2));
        assert_eq!(p("nvme-tcp://h:1/nqn.a:b/").unwrap(), t("h:1", "nqn.a:b", 1));
        for s in ["nvme-tcp://h:4420/nqn.a:b/2", "nvme-tcp://[::1]:4420/nqn.a:b/1"] {
            assert_eq!(p(s).unwrap().to_string(), s);
        }
        for (s, want) in [
            ("nvme-tcp://10.0.0.2/nqn.a:b", "needs a port"),
            ("nvme-tcp://10.0.0.2:/nqn.a:b", "needs a port"),
            ("nvme-tcp://[::1]/nqn.a:b", "needs a port"),
            ("nvme-tcp://10.0.0.2:4420", "needs the subsystem NQN"),
            ("nvme-tcp://10.0.0.2:4420/", "needs the subsystem NQN"),
            ("nvme-tcp://10.0.0.2:4420/7", "\"7\" is not an NQN"),
            ("nvme-tcp://10.0.0.2:4420/experts", "is not an NQN"),
            ("nvme-tcp://10.0.0.2:4420/nqn.a:b/0", "namespace id \"0\""),
            ("nvme-tcp://10.0.0.2:x/nqn.a:b", "port \"x\""),
            ("nvme-tcp://:4420/nqn.a:b", "needs a host"),
            ("nvme-tcp:10.0.0.2:4420/nqn.a:b", "nvme-tcp://HOST:PORT/NQN[/NSID]"),
        ] {
            let e = p(s).unwrap_err();
            assert!(matches!(e, Error::BadUri { .. }), "{s}: {e}");
            let e = e.to_string();
            assert!(e.contains("bad store URI") && e.contains(want), "{s}: {e}");
        }
        assert!(p("s3:x").unwrap_err().to_string().contains("nvme-tcp://HOST:PORT/NQN[/NSID]"));
    }

    #[test]
    fn parses_every_form() {
        let p = |s: &str| s.parse::<StoreUri>();
        assert_eq!(p("auto").unwrap(), StoreUri::Auto);
        assert_eq!(p("safetensors").unwrap(), StoreUri::Safetensors);
        assert_eq!(p("file:/a/b").unwrap(), StoreUri::File("/a/b".into()));
        assert_eq!(p("./x.picchioflat").unwrap(), StoreUri::File("./x.picchioflat".into()));
        assert_eq!(p("raw:/dev/sdb").unwrap(), StoreUri::Raw { device: "/dev/sdb".into(), offset: 0 });
        assert_eq!(p("raw:/dev/sdb@1048576").unwrap(), StoreUri::Raw { device: "/dev/sdb".into(), offset: 1 << 20 });
        assert_eq!(p("nvme:0000:03:00.0").unwrap(), StoreUri::Nvme { bdf: "0000:03:00.0".into(), nsid: 1 });
        assert_eq!(p("nvme:0000:03:00.0/2").unwrap(), StoreUri::Nvme { bdf: "0000:03:00.0".into(), nsid: 2 });
        // `nvme-sim:` is a store URI now (issue 9: one store-URI type for run, bench, pack and synth),
        // no longer an unknown scheme; which commands accept it is theirs to say.
        assert_eq!(p("nvme-sim:x.pf").unwrap(), StoreUri::NvmeSim("x.pf".into()));
        for s in
            ["raw:", "raw:/dev/x@abc", "nvme:03:00.0", "nvme:0000:03:00.0/0", "s3:bucket", "file:", "", "nvme-sim:"]
        {
            let e = p(s).unwrap_err().to_string();
            assert!(e.contains("bad store URI"), "{s}: {e}");
        }
        let e = p("s3:x.pf").unwrap_err().to_string();
        assert!(e.contains("unknown scheme \"s3:\"") && e.contains("file:PATH or ./PATH"), "{e}");
        assert_eq!(p("./a:b").unwrap(), StoreUri::File("./a:b".into()));
        for s in ["auto", "safetensors", "file:/a", "raw:/dev/sdb@4096", "nvme:0000:03:00.0/2", "nvme-sim:/a/e"] {
            assert_eq!(p(s).unwrap().to_string(), s);
        }
    }
}
