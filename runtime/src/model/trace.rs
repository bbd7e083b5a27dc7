//! Routing traces: the file format `picchio-trace/1` and its writer, which `picchio run --trace
//! PATH` installs as the model's [`RoutingObserver`]. `picchio bench trace` reads and analyses these
//! files (picchio-bench's `trace` module).
//!
//! # File format `picchio-trace/1` (JSON lines; docs/experiments.md, "trace")
//! Line 1 is a [`TraceHeader`] (`{"format":"picchio-trace/1","num_layers":3,...}`); every further line
//! is one [`TraceRecord`], one routing decision, in the order the runtime made them (position by
//! position, MoE layer by MoE layer): `{"l":LAYER,"t":POS,"e":[EXPERTS],"w":[WEIGHTS]}`, the experts
//! in canonical order (descending weight, ties by id) and their routing weights as f32 in shortest
//! round-trip decimal form. A record costs about 10 bytes per expert (≈ 100 B at top-8).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::moe::RoutingObserver;

/// The `format` of a trace file's header line.
pub const TRACE_FORMAT: &str = "picchio-trace/1";

/// Line 1 of a trace file: the model's shape, so a trace can be analysed without the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// Always [`TRACE_FORMAT`].
    pub format: String,
    /// The model directory the trace was recorded from (as given on the command line).
    pub model: String,
    /// Decoder layers L (`num_hidden_layers`).
    pub num_layers: usize,
    /// The MoE layers, ascending (the others are dense and never appear in records).
    pub moe_layers: Vec<usize>,
    /// Routed experts per MoE layer E (`num_experts`).
    pub num_experts: usize,
    /// Experts per token k (`num_experts_per_tok`).
    pub top_k: usize,
    /// Whether the k weights were renormalised to sum to 1 (`norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Bytes one cache miss reads from a flat store: the expert payload rounded up to 4096 B (a
    /// cache slot, [`crate::expert::cache::ExpertCache::slot_len`]).
    pub expert_bytes: u64,
}

impl TraceHeader {
    /// The header for `cfg`'s model in `model_dir`, one miss reading `expert_bytes`.
    pub fn new(model_dir: &Path, cfg: &crate::model::config::Config, expert_bytes: u64) -> Self {
        TraceHeader {
            format: TRACE_FORMAT.into(),
            model: model_dir.display().to_string(),
            num_layers: cfg.num_hidden_layers,
            moe_layers: cfg.moe_layers(),
            num_experts: cfg.num_experts,
            top_k: cfg.num_experts_per_tok,
            norm_topk_prob: cfg.norm_topk_prob,
            expert_bytes,
        }
    }

    /// Keys (layer, expert) a cache could hold: MoE layers × E.
    pub fn total_experts(&self) -> usize {
        self.moe_layers.len() * self.num_experts
    }
}

/// One routing decision: layer `l` routed the token at position `t` to experts `e` with weights `w`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    /// Decoder layer.
    pub l: u32,
    /// Token position (0-based, the prompt included).
    pub t: u32,
    /// Picked experts `[k]`, canonical order.
    pub e: Vec<u32>,
    /// Their routing weights `[k]`.
    pub w: Vec<f32>,
}

/// A [`RoutingObserver`] that writes each decision as a line of a `picchio-trace/1` file.
///
/// The file is written through a buffer as the model runs, into `PATH.tmp-PID` beside the target,
/// and renamed over `PATH` by [`RoutingObserver::finish`]: a run that fails or is interrupted leaves
/// no partial trace that a later analysis would accept (the temporary file is removed on drop). The
/// first write error is kept and returned by `finish` (the forward pass does not stop for it).
pub struct TraceWriter {
    path: PathBuf,
    tmp: PathBuf,
    done: bool,
    out: BufWriter<File>,
    records: u64,
    error: Option<std::io::Error>,
    line: Vec<u8>,
}

impl TraceWriter {
    /// Creates `path` (replacing it only when it is a previous trace: any other existing file is
    /// refused) and writes `header` as its first line.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `path` exists and is not a trace; [`Error::Io`] naming the path.
    pub fn create(path: &Path, header: &TraceHeader) -> Result<Self> {
        crate::output::check_replaceable(path, "--trace", &format!("a {TRACE_FORMAT} trace"), starts_like_trace)?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp-{}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let file = File::create(&tmp).map_err(Error::io(&tmp, "create the trace file"))?;
        let mut w = TraceWriter {
            path: path.to_path_buf(),
            tmp,
            done: false,
            out: BufWriter::with_capacity(1 << 16, file),
            records: 0,
            error: None,
            line: Vec::with_capacity(256),
        };
        serde_json::to_writer(&mut w.out, header)
            .map_err(std::io::Error::other)
            .and_then(|()| w.out.write_all(b"\n"))
            .map_err(Error::io(&w.tmp, "write the trace header"))?;
        Ok(w)
    }

    /// Records written so far.
    pub fn records(&self) -> u64 {
        self.records
    }
}

/// Whether the file at `path` begins with a trace header (only the first bytes are read).
fn starts_like_trace(path: &Path) -> bool {
    use std::io::Read;
    let mut head = [0u8; 40];
    let Ok(mut f) = File::open(path) else { return false };
    let n = f.read(&mut head).unwrap_or(0);
    let want = format!("{{\"format\":\"{TRACE_FORMAT}\"");
    head[..n].starts_with(want.as_bytes())
}

impl RoutingObserver for TraceWriter {
    fn routed(&mut self, layer: usize, pos: usize, experts: &[u32], weights: &[f32]) {
        if self.error.is_some() {
            return;
        }
        self.line.clear();
        let rec = RecordRef { l: layer as u32, t: pos as u32, e: experts, w: weights };
        let r = serde_json::to_writer(&mut self.line, &rec).map_err(std::io::Error::other).and_then(|()| {
            self.line.push(b'\n');
            self.out.write_all(&self.line)
        });
        match r {
            Ok(()) => self.records += 1,
            Err(e) => self.error = Some(e),
        }
    }

    fn finish(&mut self) -> Result<()> {
        if self.done {
            return Ok(());
        }
        let r = match self.error.take() {
            Some(e) => Err(e),
            None => self.out.flush().and_then(|()| self.out.get_ref().sync_all()),
        };
        r.map_err(Error::io(&self.path, "write the trace"))?;
        std::fs::rename(&self.tmp, &self.path)
            .map_err(Error::io(&self.path, "rename the finished trace into place"))?;
        self.done = true;
        Ok(())
    }
}

impl Drop for TraceWriter {
    fn drop(&mut self) {
        if !self.done {
            // Best effort: an unfinished trace is never left where a later run would read it.
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// [`TraceRecord`] borrowing the router's buffers (no allocation per record).
#[derive(Serialize)]
struct RecordRef<'a> {
    l: u32,
    t: u32,
    e: &'a [u32],
    w: &'a [f32],
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(e: usize, k: usize, moe_layers: Vec<usize>) -> TraceHeader {
        TraceHeader {
            format: TRACE_FORMAT.into(),
            model: "m".into(),
            num_layers: moe_layers.iter().max().map_or(1, |l| l + 1),
            moe_layers,
            num_experts: e,
            top_k: k,
            norm_topk_prob: true,
            expert_bytes: 4096,
        }
    }

    /// A scratch directory, the trace path `t.jsonl` in it, and the header of 8 experts, top-2, MoE
    /// layers 0 and 2.
    fn scratch_trace() -> (tempfile::TempDir, std::path::PathBuf, TraceHeader) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        (dir, p, header(8, 2, vec![0, 2]))
    }

    #[test]
    fn an_unfinished_trace_leaves_no_file_and_keeps_the_previous_one() {
        let (dir, p, h) = scratch_trace();
        // Nothing at the path: a writer dropped before finish (a failed or interrupted run) leaves
        // neither the target nor its temporary file.
        let mut w = TraceWriter::create(&p, &h).unwrap();
        w.routed(0, 0, &[3, 1], &[0.75, 0.25]);
        drop(w);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "nothing left behind");
        // A finished trace, then an unfinished second recording over it: the first stays whole.
        let mut w = TraceWriter::create(&p, &h).unwrap();
        w.routed(0, 0, &[3, 1], &[0.75, 0.25]);
        w.finish().unwrap();
        w.finish().unwrap(); // idempotent
        let before = std::fs::read(&p).unwrap();
        let mut w = TraceWriter::create(&p, &h).unwrap();
        w.routed(2, 0, &[7, 0], &[0.5, 0.5]);
        drop(w);
        assert_eq!(std::fs::read(&p).unwrap(), before);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        assert_eq!(std::fs::read_to_string(&p).unwrap().lines().count(), 2, "the header and one record");
    }

    #[test]
    fn records_are_one_json_line_each_after_the_header() {
        let (dir, p, h) = scratch_trace();
        let mut w = TraceWriter::create(&p, &h).unwrap();
        w.routed(2, 5, &[7, 0], &[0.600_000_1, 0.399_999_9]);
        w.finish().unwrap();
        assert_eq!(w.records(), 1);
        let text = std::fs::read_to_string(&p).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("{\"format\":\"picchio-trace/1\""), "{text}");
        assert_eq!(serde_json::from_str::<TraceHeader>(lines[0]).unwrap(), h);
        assert_eq!(lines[1], "{\"l\":2,\"t\":5,\"e\":[7,0],\"w\":[0.6000001,0.3999999]}");
        // Only an earlier trace is replaced.
        let other = dir.path().join("config.json");
        std::fs::write(&other, "{}").unwrap();
        let e = TraceWriter::create(&other, &h).err().unwrap().to_string();
        assert!(e.contains("not a picchio-trace/1 trace") && e.contains("--trace will not replace it"), "{e}");
    }
}
