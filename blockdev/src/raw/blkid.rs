//! A second opinion on a device's signatures: util-linux's `blkid -p -o export DEVICE` (the
//! low-level probe: reads the device, never writes it, and ignores the blkid cache), where `blkid`
//! is installed. libblkid knows many more file systems, volumes and partition tables than
//! [`super::scan_signatures`]; what it finds becomes a [`super::Finding::Blkid`] beside our own
//! findings, so the stricter verdict wins. A missing `blkid` is not an error (one debug line).
//!
//! Output format (blkid(8), `-o export`): `KEY=value` lines, e.g. `TYPE=ext4`, `USAGE=filesystem`,
//! `PTTYPE=gpt`. Exit status 0 when something was found, 2 when nothing was, 8 when the low-level
//! probe found more than one signature and cannot decide ("ambivalent").

use std::fmt;
use std::path::Path;
use std::process::Command;

/// What `blkid -p` reported for a device (at a byte offset).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkidProbe {
    /// The byte offset probed (`blkid -p -O OFFSET`; 0 for the whole device).
    pub offset: u64,
    /// Every `KEY=value` pair, in output order (`DEVNAME` left out).
    pub fields: Vec<(String, String)>,
    /// Exit status 8: more than one signature, libblkid cannot tell which is live.
    pub ambivalent: bool,
}

impl BlkidProbe {
    /// The value of `key` (`TYPE`, `PTTYPE`, `USAGE`, `VERSION`, `UUID`, `LABEL`, ...).
    pub fn get(&self, key: &str) -> Option<&str> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// Whether it found anything worth a finding: a `TYPE` (file system, RAID member, crypto
    /// volume, ...), a `PTTYPE` (partition table), or an ambivalent result.
    pub fn found_something(&self) -> bool {
        self.ambivalent || self.get("TYPE").is_some() || self.get("PTTYPE").is_some()
    }

    /// Probes `device` at byte `offset` with `blkid -p -o export [-O OFFSET] DEVICE`.
    ///
    /// Returns `None` when `blkid` is not installed or cannot be run (logged at debug level), or
    /// when it fails other than by finding nothing or being ambivalent (logged at debug level: our
    /// own scan still stands); `Some` with no fields when it found nothing.
    pub fn run(device: &Path, offset: u64) -> Option<BlkidProbe> {
        let mut cmd = Command::new("blkid");
        cmd.args(["-p", "-o", "export"]);
        if offset != 0 {
            cmd.args(["-O", &offset.to_string()]);
        }
        cmd.arg(device);
        let out = match cmd.output() {
            Ok(out) => out,
            Err(e) => {
                tracing::debug!("blkid not run on {} ({e}); relying on our own signature scan", device.display());
                return None;
            }
        };
        match out.status.code() {
            Some(0) | Some(2) | Some(8) => {}
            code => {
                tracing::debug!(
                    "blkid -p {} exited with {code:?}: {}; relying on our own signature scan",
                    device.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                return None;
            }
        }
        let mut probe = parse_blkid_export(&String::from_utf8_lossy(&out.stdout), offset);
        probe.ambivalent = out.status.code() == Some(8);
        Some(probe)
    }
}

/// Parses the output of `blkid -p -o export` (`KEY=value` lines; blank and malformed lines and
/// `DEVNAME` are skipped) for a probe at byte `offset`.
pub fn parse_blkid_export(text: &str, offset: u64) -> BlkidProbe {
    let fields = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .filter(|(k, _)| !k.is_empty() && k != "DEVNAME")
        .collect();
    BlkidProbe { offset, fields, ambivalent: false }
}

impl fmt::Display for BlkidProbe {
    /// `ext4 (USAGE=filesystem, VERSION=1.0, UUID=..., at byte 0)`, `gpt partition table (...)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.get("TYPE"), self.get("PTTYPE")) {
            (Some(t), Some(pt)) => write!(f, "{t} with a {pt} partition table")?,
            (Some(t), None) => match self.get("USAGE") {
                Some("filesystem") => write!(f, "{t} file system")?,
                Some("raid") => write!(f, "{t} RAID member")?,
                Some("crypto") => write!(f, "{t} encrypted volume")?,
                _ => write!(f, "{t}")?,
            },
            (None, Some(pt)) => write!(f, "{pt} partition table")?,
            (None, None) if self.ambivalent => write!(f, "more than one signature (ambivalent result)")?,
            (None, None) => write!(f, "nothing")?,
        }
        let shown: Vec<String> = self
            .fields
            .iter()
            .filter(|(k, _)| matches!(k.as_str(), "USAGE" | "VERSION" | "UUID" | "LABEL" | "PTUUID"))
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        write!(f, " (")?;
        for s in &shown {
            write!(f, "{s}, ")?;
        }
        write!(f, "at byte {})", self.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_captured_outputs() {
        // `blkid -p -o export` of an 8 MiB image after `mkfs.ext4 -q`.
        let ext4 = "DEVNAME=t.img\nUUID=7cf1d4eb-3a90-4b60-be89-58baa1c546ab\nVERSION=1.0\nBLOCK_SIZE=1024\nTYPE=ext4\nUSAGE=filesystem\n";
        let p = parse_blkid_export(ext4, 0);
        assert_eq!((p.get("TYPE"), p.get("USAGE"), p.get("DEVNAME")), (Some("ext4"), Some("filesystem"), None));
        assert!(p.found_something());
        assert_eq!(
            p.to_string(),
            "ext4 file system (UUID=7cf1d4eb-3a90-4b60-be89-58baa1c546ab, VERSION=1.0, USAGE=filesystem, at byte 0)"
        );
        // A GPT disk with no file system on the whole device.
        let gpt = "DEVNAME=/dev/loop0\nPTUUID=0f7a6c8e-52d1-4b41-9a0e-5d1e9f8c2b1a\nPTTYPE=gpt\n";
        let p = parse_blkid_export(gpt, 1 << 20);
        assert_eq!(p.get("PTTYPE"), Some("gpt"));
        assert!(p.to_string().starts_with("gpt partition table (PTUUID="), "{p}");
        assert!(p.to_string().ends_with("at byte 1048576)"), "{p}");
        // An md member and a LUKS volume name their usage.
        let md = parse_blkid_export("TYPE=linux_raid_member\nUSAGE=raid\nVERSION=1.2\n", 0);
        assert!(md.to_string().starts_with("linux_raid_member RAID member"), "{md}");
        let luks = parse_blkid_export("TYPE=crypto_LUKS\nUSAGE=crypto\n", 0);
        assert!(luks.to_string().starts_with("crypto_LUKS encrypted volume"), "{luks}");
        // Nothing found (exit 2, empty output), and garbage lines.
        let none = parse_blkid_export("", 0);
        assert!(!none.found_something() && none.fields.is_empty());
        let junk = parse_blkid_export("no equals sign\n=empty key\n\n", 0);
        assert!(!junk.found_something() && junk.fields.is_empty(), "{junk:?}");
        let amb = BlkidProbe { ambivalent: true, ..none };
        assert!(amb.found_something());
        assert!(amb.to_string().starts_with("more than one signature"), "{amb}");
    }

    #[test]
    fn a_missing_blkid_is_none_not_an_error() {
        // A device path that does not exist: blkid (if installed) exits 2 (nothing found); without
        // blkid the probe is None. Either way: no finding, no error.
        let p = BlkidProbe::run(Path::new("/nonexistent/picchio-blkid-test"), 0);
        assert!(p.as_ref().is_none_or(|p| !p.found_something()), "{p:?}");
    }
}
