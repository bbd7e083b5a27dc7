//! A `picchio serve` process for tests (on a free port, killed when dropped), the vendored
//! real-tokenizer model converted and packed into a scratch directory, and a minimal HTTP/1.1
//! client over a TCP socket (requests with `Connection: close`; chunked bodies decoded).
#![allow(dead_code)] // each test binary uses a subset

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};

/// The vendored fixture with the real Qwen3 tokenizer and chat template.
pub fn text_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_moe_text")
}

/// The fixture converted (Q4 experts) and packed into `dir/m` (so the model is named `m`).
pub fn packed_model(dir: &Path) -> PathBuf {
    let m = dir.join("m");
    let (src, ms) = (text_fixture(), m.to_str().unwrap().to_string());
    super::ok(&["convert", src.to_str().unwrap(), &ms, "--no-progress", "-q"]);
    super::ok(&["pack", &ms, "--no-progress", "-q"]);
    m
}

/// A running `picchio serve`.
pub struct Served {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// Its stderr lines so far.
    lines: Arc<Mutex<Vec<String>>>,
}

impl Served {
    /// Starts `picchio serve --model MODEL --port 0 ARGS` and waits for its "listening on" line.
    pub fn start(model: &Path, args: &[&str]) -> Served {
        Served::start_env(model, args, &[])
    }

    /// [`Served::start`] with extra environment variables (the server's test hooks, such as
    /// `PICCHIO_SERVE_HOLD_AFTER_DELTAS`).
    pub fn start_env(model: &Path, args: &[&str], envs: &[(&str, &str)]) -> Served {
        let mut child = Command::new(env!("CARGO_BIN_EXE_picchio"))
            .args(["serve", "--model", model.to_str().unwrap(), "--port", "0", "--ecap", "4"])
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start picchio serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let seen = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[serve] {line}");
                seen.lock().unwrap().push(line.clone());
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
                }
            }
        });
        let addr = rx.recv_timeout(picchio_testkit::bin::HANG_LIMIT).expect("picchio serve did not start listening");
        Served { child, addr, lines }
    }

    /// Starts `picchio serve --model MODEL --port 0 --ctx 512` with the test mock
    /// `PICCHIO_SERVE_TEST_MOCK_SAMPLED_IDS`: the tokens the model "samples" are `text`'s (in
    /// `model`'s tokenizer), then `<|im_end|>`, as if the model wrote `text` as its whole answer;
    /// detokenizing, parsing and the HTTP answer run for real. Returns it and the mocked ids.
    pub fn start_answering(model: &Path, text: &str) -> (Served, Vec<u32>) {
        let tok = picchio_runtime::model::tokenizer::Tokenizer::from_dir(model).unwrap().unwrap();
        let mut ids = tok.encode(text).unwrap();
        ids.push(tok.token_to_id("<|im_end|>").unwrap());
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        let served =
            Served::start_env(model, &["--ctx", "512"], &[("PICCHIO_SERVE_TEST_MOCK_SAMPLED_IDS", &list.join(","))]);
        (served, ids)
    }

    /// Its stderr lines so far.
    pub fn stderr_lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// Waits (bounded by the hang limit) until a stderr line contains `text`.
    pub fn wait_for_line(&self, text: &str) {
        let found = picchio_testkit::wait_until(picchio_testkit::bin::HANG_LIMIT, || {
            self.lines.lock().unwrap().iter().any(|l| l.contains(text))
        });
        assert!(found, "no stderr line with {text:?} in {:?}", self.stderr_lines());
    }

    /// Sends `signal` (`libc::SIGINT`, ...) to the server.
    #[cfg(unix)]
    pub fn signal(&self, signal: libc::c_int) {
        // SAFETY: signals our own child, which is not reaped before `self` is dropped or waited.
        assert_eq!(unsafe { libc::kill(self.child.id() as libc::pid_t, signal) }, 0);
    }

    /// Waits (bounded by the hang limit; killed past it) for the server to exit; its status.
    pub fn wait_exit(mut self) -> std::process::ExitStatus {
        let mut status = None;
        let ended = picchio_testkit::wait_until(picchio_testkit::bin::HANG_LIMIT, || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        });
        assert!(ended, "picchio serve did not exit; its stderr: {:?}", self.stderr_lines());
        status.unwrap()
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Sends one request and returns (status, body).
    pub fn request(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String) {
        let mut s = self.send(method, path, headers, body);
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        parse_response(&raw)
    }

    /// Opens a connection and sends one request, returning the socket for reading the answer.
    pub fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> TcpStream {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(picchio_testkit::bin::HANG_LIMIT)).unwrap();
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n", self.addr);
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        if !body.is_empty() {
            head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        s
    }

    /// POSTs a JSON body.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let (status, text) = self.request("POST", path, &[], body.to_string().as_bytes());
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
    }

    /// GETs `path`.
    pub fn get(&self, path: &str) -> (u16, String) {
        self.request("GET", path, &[], b"")
    }

    /// The value of metric `name` in `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        let line = text
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Qwen3 answer with a Hermes `<tool_call>` block, for [`Served::start_answering`]: the text
/// "Let me look." then a call of `get_weather` with `{"city": "Paris"}`.
pub const WEATHER_CALL_ANSWER: &str =
    "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

/// Runs the official-`openai`-client check `cli/tests/SCRIPT` against `served` (its URL in
/// `PICCHIO_BASE_URL`) with `envs`, under the Python interpreter that `PICCHIO_TEST_PYTHON` names
/// (one with the `openai` package: .ci/run makes a venv). Echoes its stdout and stderr to the test
/// log, asserts it exited 0 and returns its output.
pub fn openai_client(script: &str, served: &Served, envs: &[(&str, &str)]) -> std::process::Output {
    let python = std::env::var("PICCHIO_TEST_PYTHON")
        .expect("set PICCHIO_TEST_PYTHON to a python interpreter with the openai package (pip install openai)");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join(script);
    let o = Command::new(&python)
        .arg(&script)
        .env("PICCHIO_BASE_URL", served.url())
        .envs(envs.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("running {python}: {e}"));
    let out = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    eprintln!("{out}");
    assert!(o.status.success(), "{python} {} failed:\n{out}", script.display());
    o
}

/// (status, body) of a raw HTTP/1.1 response, a chunked body decoded.
pub fn parse_response(raw: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no header end in {text:?}"));
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let chunked = head.lines().any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding: chunked"));
    if !chunked {
        return (status, body.to_string());
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    (status, out)
}

/// Waits until `cond` holds (bounded by the hang limit).
pub fn wait_for(mut cond: impl FnMut() -> bool) {
    assert!(picchio_testkit::wait_until(picchio_testkit::bin::HANG_LIMIT, &mut cond), "condition never held");
}
