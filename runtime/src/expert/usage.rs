//! Expert-usage profiles (Picchio (C)'s `.picchio_usage`, in a format of our own): how many tokens
//! each (layer, expert) was routed to over one or more runs. `picchio run --usage-out FILE` saves
//! one after a run (adding to FILE when it already holds a profile of the same shape), and
//! `--warm-from FILE` loads the most used experts into the expert cache before the first token, so
//! a run starts warm instead of cold ([`crate::run::Session::warm_from`]). The profile only picks
//! what is read first: the cache stays an LRU, nothing is pinned.
//!
//! # Format `picchio-usage/1` (UTF-8 text, one record per line)
//! ```text
//! picchio-usage/1
//! layers 48
//! experts 128
//! # layer expert count
//! 0 17 42
//! 0 93 7
//! ```
//! The first line is the magic; `layers N` and `experts E` give the shape (the model's
//! `num_hidden_layers` and `num_experts`); lines starting with `#` are comments; every other line
//! is `layer expert count` in decimal, `layer < N`, `expert < E`, each (layer, expert) at most once.
//! Experts never routed to are left out. Written sorted by (layer, expert).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use picchio_core::ExpertKey;

use crate::error::{Error, Result};
use crate::model::config::Config;

/// The magic first line.
pub const MAGIC: &str = "picchio-usage/1";

/// Routing counts per (layer, expert): `counts[layer * experts + expert]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageProfile {
    /// Decoder layers.
    pub layers: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Tokens routed to each expert, `[layers * experts]` row-major.
    pub counts: Vec<u64>,
}

impl UsageProfile {
    /// A profile of `counts` `[layers * experts]`.
    ///
    /// # Panics
    /// When `counts.len() != layers * experts`.
    pub fn new(layers: usize, experts: usize, counts: Vec<u64>) -> Self {
        assert_eq!(counts.len(), layers * experts, "usage counts are [layers * experts]");
        UsageProfile { layers, experts, counts }
    }

    /// Parses a `picchio-usage/1` text; `name` is the file in messages.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the file, the line and what was expected.
    pub fn parse(text: &str, name: &str) -> Result<Self> {
        let bad = |line: usize, what: String| Error::Invalid(format!("{name}:{line}: {what}"));
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l.trim()));
        match lines.next() {
            Some((_, MAGIC)) => {}
            Some((n, l)) => {
                return Err(bad(n, format!("expected `{MAGIC}`, found `{}`", l.chars().take(40).collect::<String>())))
            }
            None => return Err(bad(1, format!("empty file: expected `{MAGIC}`"))),
        }
        // `layers` is on line 2, `experts` on line 3: a file that ends before names the missing line.
        let mut dim = |key: &str, line: usize| -> Result<usize> {
            let (n, l) = lines.next().ok_or_else(|| bad(line, format!("ends before `{key} N`")))?;
            let v =
                l.strip_prefix(key).map(str::trim).ok_or_else(|| bad(n, format!("expected `{key} N`, found `{l}`")))?;
            match v.parse::<usize>() {
                Ok(v) if (1..=1 << 20).contains(&v) => Ok(v),
                _ => Err(bad(n, format!("`{key}` must be a number from 1 to 2^20, found `{v}`"))),
            }
        };
        let (layers, experts) = (dim("layers", 2)?, dim("experts", 3)?);
        if layers * experts > 1 << 24 {
            return Err(bad(3, format!("{layers} layers × {experts} experts is beyond 2^24 entries")));
        }
        let mut counts = vec![0u64; layers * experts];
        let mut seen = vec![false; layers * experts];
        for (n, l) in lines {
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let f: Vec<&str> = l.split_whitespace().collect();
            let nums: Option<Vec<u64>> = f.iter().map(|x| x.parse().ok()).collect();
            let (layer, expert, count) = match nums.as_deref() {
                Some(&[a, b, c]) => (a, b, c),
                _ => return Err(bad(n, format!("expected `layer expert count` (three numbers), found `{l}`"))),
            };
            if layer >= layers as u64 || expert >= experts as u64 {
                return Err(bad(
                    n,
                    format!("(layer {layer}, expert {expert}) is outside {layers} layers × {experts} experts"),
                ));
            }
            let i = layer as usize * experts + expert as usize;
            if std::mem::replace(&mut seen[i], true) {
                return Err(bad(n, format!("(layer {layer}, expert {expert}) appears twice")));
            }
            counts[i] = count;
        }
        Ok(UsageProfile { layers, experts, counts })
    }

    /// The profile as `picchio-usage/1` text.
    pub fn to_text(&self) -> String {
        let mut s = format!("{MAGIC}\nlayers {}\nexperts {}\n# layer expert count\n", self.layers, self.experts);
        for (i, &c) in self.counts.iter().enumerate().filter(|(_, &c)| c > 0) {
            let _ = writeln!(s, "{} {} {c}", i / self.experts, i % self.experts);
        }
        s
    }

    /// Reads a profile file.
    ///
    /// # Errors
    /// [`Error::Io`] naming the path; as [`UsageProfile::parse`].
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(Error::io(path, "read the usage profile"))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Whether the profile's shape is `layers × experts`, else the error naming `name`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the shapes differ.
    pub fn check_shape(&self, layers: usize, experts: usize, name: &str) -> Result<()> {
        if (self.layers, self.experts) != (layers, experts) {
            return Err(Error::Invalid(format!(
                "{name}: a usage profile of {} layers × {} experts; this model has {layers} × {experts}",
                self.layers, self.experts
            )));
        }
        Ok(())
    }

    /// Writes the profile to `path` atomically (a temporary sibling renamed over it), adding the
    /// counts already in `path` when it holds a profile of the same shape (`merged` = true): a
    /// [`UsageOut`] claimed and saved at once.
    ///
    /// # Errors
    /// As [`UsageOut::create`] and [`UsageOut::save`].
    pub fn save_adding(&self, path: &Path) -> Result<bool> {
        UsageOut::claim(path, self.layers, self.experts)?.save(self)
    }

    /// The `n` most used experts (count > 0), most used first; ties by (layer, expert).
    pub fn top(&self, n: usize) -> Vec<ExpertKey> {
        let mut used: Vec<(u64, usize)> =
            self.counts.iter().enumerate().filter(|(_, &c)| c > 0).map(|(i, &c)| (c, i)).collect();
        used.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        used.truncate(n);
        let e = self.experts;
        used.into_iter().map(|(_, i)| ExpertKey { layer: (i / e) as u32, expert: (i % e) as u32 }).collect()
    }
}

/// A `--usage-out` destination claimed before the run it records: [`UsageOut::create`] checks
/// what `path` holds and creates the temporary file the profile is written to beside it, so a path
/// that cannot take a profile (a missing or read-only directory, a file that is not a profile of this
/// model's shape) is refused before a model loads, not after its output. [`UsageOut::save`] writes
/// the temporary file and renames it over `path`; dropped unsaved, it removes the temporary file.
#[derive(Debug)]
pub struct UsageOut {
    path: PathBuf,
    tmp: PathBuf,
    file: Option<std::fs::File>,
    layers: usize,
    experts: usize,
}

impl UsageOut {
    /// Claims `path` for a profile of the model of `cfg` (`num_hidden_layers × num_experts`, the
    /// config the command read once): an existing `path` must hold a profile of that shape (its
    /// counts are added on [`UsageOut::save`]); leftovers of earlier writers that are gone are
    /// removed; `path.tmp-PID` is created (exclusively) beside it.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `path` exists and is not a usage profile of this shape (it will not
    /// be replaced); [`Error::Io`] naming the path when it cannot be read or the temporary file
    /// cannot be created.
    pub fn create(path: &Path, cfg: &Config) -> Result<UsageOut> {
        Self::claim(path, cfg.num_hidden_layers, cfg.num_experts)
    }

    /// [`UsageOut::create`] for a profile of `layers × experts`.
    fn claim(path: &Path, layers: usize, experts: usize) -> Result<UsageOut> {
        Self::check_existing(path, layers, experts)?;
        crate::image::guard::sweep_leftovers(path, "run --usage-out")?;
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(format!(".tmp-{}", std::process::id()));
        let tmp = path.with_file_name(name);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(Error::io(path, "create the usage profile (a temporary file beside it)"))?;
        Ok(UsageOut { path: path.to_path_buf(), tmp, file: Some(file), layers, experts })
    }

    /// The profile in `path`, when there is one, checked to be of shape `layers × experts`.
    fn check_existing(path: &Path, layers: usize, experts: usize) -> Result<Option<UsageProfile>> {
        match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(path, "stat the usage profile")(e)),
            Ok(m) if m.is_dir() => Err(Error::Invalid(format!(
                "{}: is a directory: --usage-out takes a file path (e.g. {}/usage.json)",
                path.display(),
                path.display()
            ))),
            Ok(_) => {
                let old = UsageProfile::read(path).map_err(|e| {
                    Error::Invalid(format!("{e}: --usage-out will not replace it: remove it or choose another path"))
                })?;
                old.check_shape(layers, experts, &path.display().to_string())?;
                Ok(Some(old))
            }
        }
    }

    /// The destination.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `profile`, plus the counts `path` holds now when it holds a profile, into the
    /// temporary file, syncs it and renames it over `path`. Returns whether counts were added.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `profile` is not of the claimed shape, or `path` was replaced
    /// meanwhile by something that is not such a profile; [`Error::Io`] naming the path.
    pub fn save(mut self, profile: &UsageProfile) -> Result<bool> {
        profile.check_shape(self.layers, self.experts, &self.path.display().to_string())?;
        let mut out = profile.clone();
        let old = Self::check_existing(&self.path, self.layers, self.experts)?;
        if let Some(old) = &old {
            for (o, c) in out.counts.iter_mut().zip(&old.counts) {
                *o = o.saturating_add(*c);
            }
        }
        let mut file = self.file.take().expect("a UsageOut is saved once");
        std::io::Write::write_all(&mut file, out.to_text().as_bytes())
            .and_then(|()| file.sync_all())
            .map_err(Error::io(&self.path, "write the usage profile (to a temporary file beside it)"))?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path).map_err(Error::io(&self.path, "rename the usage profile into place"))?;
        self.tmp = PathBuf::new();
        Ok(old.is_some())
    }
}

impl Drop for UsageOut {
    fn drop(&mut self) {
        // Unsaved (or a failed save): the temporary file goes; `path` is as it was.
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_top_and_errors() {
        let p = UsageProfile::new(2, 3, vec![0, 5, 1, 7, 0, 5]);
        let text = p.to_text();
        assert_eq!(text, "picchio-usage/1\nlayers 2\nexperts 3\n# layer expert count\n0 1 5\n0 2 1\n1 0 7\n1 2 5\n");
        assert_eq!(UsageProfile::parse(&text, "f").unwrap(), p);
        let keys: Vec<(u32, u32)> = p.top(3).iter().map(|k| (k.layer, k.expert)).collect();
        assert_eq!(keys, [(1, 0), (0, 1), (1, 2)]);
        assert_eq!(p.top(99).len(), 4, "never-used experts are not picked");
        for (bad, want) in [
            ("nope\n", "f:1: expected `picchio-usage/1`"),
            ("picchio-usage/1\nlayers 2\n", "ends before `experts N`"),
            ("picchio-usage/1\nlayers x\nexperts 3\n", "f:2: `layers` must be a number"),
            (
                "picchio-usage/1\nlayers 2\nexperts 3\n0 3 1\n",
                "f:4: (layer 0, expert 3) is outside 2 layers × 3 experts",
            ),
            ("picchio-usage/1\nlayers 2\nexperts 3\n0 1 1\n0 1 2\n", "f:5: (layer 0, expert 1) appears twice"),
            ("picchio-usage/1\nlayers 2\nexperts 3\n0 1\n", "f:4: expected `layer expert count`"),
        ] {
            let e = UsageProfile::parse(bad, "f").unwrap_err().to_string();
            assert!(e.contains(want), "{e} (wanted {want})");
        }
        assert!(p.check_shape(2, 4, "f").unwrap_err().to_string().contains("2 layers × 3 experts"));
    }

    #[test]
    fn save_adds_to_an_existing_profile_and_refuses_other_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("u.picchio_usage");
        let p = UsageProfile::new(1, 2, vec![1, 2]);
        assert!(!p.save_adding(&path).unwrap());
        assert!(p.save_adding(&path).unwrap());
        assert_eq!(UsageProfile::read(&path).unwrap().counts, [2, 4]);
        let other = dir.path().join("config.json");
        std::fs::write(&other, "{}").unwrap();
        let e = p.save_adding(&other).unwrap_err().to_string();
        assert!(e.contains("will not replace it"), "{e}");
        assert_eq!(std::fs::read_to_string(&other).unwrap(), "{}");
        let e = UsageProfile::new(2, 2, vec![0; 4]).save_adding(&path).unwrap_err().to_string();
        assert!(e.contains("1 layers × 2 experts"), "{e}");
    }

    #[test]
    fn usage_out_is_claimed_before_the_run_and_leaves_nothing_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        // A directory that does not exist: refused at create, naming the path.
        let missing = dir.path().join("no-such-dir").join("u.txt");
        let e = UsageOut::claim(&missing, 1, 2).unwrap_err().to_string();
        assert!(e.contains(&missing.display().to_string()), "{e}");
        // A directory: named as one (not "read the usage profile").
        let e = UsageOut::claim(dir.path(), 1, 2).unwrap_err().to_string();
        assert!(e.contains("is a directory: --usage-out takes a file path"), "{e}");
        // Another shape, or not a profile: refused at create; the file is unchanged.
        let path = dir.path().join("u.txt");
        UsageProfile::new(1, 2, vec![1, 2]).save_adding(&path).unwrap();
        let e = UsageOut::claim(&path, 3, 2).unwrap_err().to_string();
        assert!(e.contains("1 layers × 2 experts; this model has 3 × 2"), "{e}");
        // Claimed, then dropped unsaved (a run that failed): no temporary file is left.
        let out = UsageOut::claim(&path, 1, 2).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2, "the temporary file beside it");
        drop(out);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // Claimed, saved: the counts are added.
        let out = UsageOut::claim(&path, 1, 2).unwrap();
        assert!(out.save(&UsageProfile::new(1, 2, vec![1, 1])).unwrap());
        assert_eq!(UsageProfile::read(&path).unwrap().counts, [2, 3]);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        // `create` takes the shape from the model's config: the 1 × 2 profile is not this model's.
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/picchio_c/qwen3_moe");
        let cfg = Config::from_dir(&fixture).unwrap();
        let e = UsageOut::create(&path, &cfg).unwrap_err().to_string();
        let shape = format!("this model has {} × {}", cfg.num_hidden_layers, cfg.num_experts);
        assert!(e.contains(&shape), "{e}");
        let fresh = dir.path().join("fresh.txt");
        let out = UsageOut::create(&fresh, &cfg).unwrap();
        let counts = vec![1; cfg.num_hidden_layers * cfg.num_experts];
        assert!(!out.save(&UsageProfile::new(cfg.num_hidden_layers, cfg.num_experts, counts)).unwrap());
    }
}
