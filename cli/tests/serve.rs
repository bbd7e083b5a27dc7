//! `picchio serve` over plain HTTP on the vendored real-tokenizer model: the endpoints answer in
//! OpenAI's shapes, and every bad input of the issue gets OpenAI's JSON error with the right status
//! and nothing generated: an unknown role, an empty message list, a body that is not UTF-8 or too
//! large, a prompt longer than the context, `max_tokens` 0 or negative, an unknown model, a
//! missing or wrong API key, a full queue, a body whose Content-Length is too large (refused from
//! the header), a body that stalls and a connection that stays idle (closed after their timeouts);
//! each such answer is counted by status in `/metrics`. Option values that cannot work are refused
//! at start-up, a non-loopback address without a key is warned about, and SIGINT answers the queued
//! requests 503, stops the running one and exits 0 (a second SIGINT at once). (The official `openai`
//! client drives it in serve_openai.rs.)

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;

use common::serve::{packed_model, parse_response, Served, WEATHER_CALL_ANSWER};
use serde_json::{json, Value};

/// The server's hold point (`picchio serve`'s `PICCHIO_SERVE_HOLD_AFTER_DELTAS`).
const HOLD: &str = "PICCHIO_SERVE_HOLD_AFTER_DELTAS";
/// The server's hold point in the prefill (`PICCHIO_SERVE_HOLD_IN_PREFILL`).
const HOLD_PREFILL: &str = "PICCHIO_SERVE_HOLD_IN_PREFILL";

fn chat(content: &str, extra: Value) -> Value {
    let mut v = json!({"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

fn err(v: &Value) -> (&str, Option<&str>) {
    (v["error"]["message"].as_str().unwrap_or_else(|| panic!("no error message: {v}")), v["error"]["code"].as_str())
}

#[test]
fn endpoints_answer_and_bad_requests_get_openai_errors() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let s = Served::start(&model, &["--ctx", "64", "--max-body", "4096"]);

    assert_eq!(s.get("/health"), (200, r#"{"status":"ok"}"#.into()));
    let (st, body) = s.get("/v1/models");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((st, v["data"][0]["id"].as_str()), (200, Some("m")));

    // A good request: greedy, 5 tokens, usage counted.
    let (st, v) = s.post("/v1/chat/completions", &chat("Hi there", json!({"max_tokens": 5})));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    // <|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n: 10 tokens (chat/qwen3_rendering.json).
    assert_eq!(v["usage"]["prompt_tokens"], 10);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let generated = s.metric("picchio_completion_tokens_total");
    assert_eq!(generated, 5.0);

    // (what, body, status, text in the message, OpenAI code)
    type Case<'a> = (&'a str, Vec<u8>, u16, &'a str, Option<&'a str>);
    let cases: Vec<Case> = vec![
        (
            "unknown role",
            json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).to_string().into_bytes(),
            400,
            "message 0 has role `wizard`",
            None,
        ),
        ("empty message list", json!({"model": "m", "messages": []}).to_string().into_bytes(), 400, "empty", None),
        ("no messages", json!({"model": "m"}).to_string().into_bytes(), 400, "`messages` is required", None),
        (
            "not UTF-8",
            b"{\"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            400,
            "not a valid request",
            None,
        ),
        ("not JSON", b"{\"model\": ".to_vec(), 400, "not a valid request", None),
        (
            "too large",
            chat(&"x".repeat(5000), json!({})).to_string().into_bytes(),
            413,
            "--max-body",
            Some("request_too_large"),
        ),
        (
            "longer than the context",
            chat(&"word ".repeat(80), json!({"max_tokens": 4})).to_string().into_bytes(),
            400,
            "exceed",
            Some("context_length_exceeded"),
        ),
        (
            "prompt + max_tokens beyond the context",
            chat("Hi there", json!({"max_tokens": 60})).to_string().into_bytes(),
            400,
            "exceed",
            Some("context_length_exceeded"),
        ),
        ("max_tokens 0", chat("Hi", json!({"max_tokens": 0})).to_string().into_bytes(), 400, "max_tokens", None),
        ("max_tokens < 0", chat("Hi", json!({"max_tokens": -3})).to_string().into_bytes(), 400, "max_tokens", None),
        (
            "max_completion_tokens < 0",
            chat("Hi", json!({"max_completion_tokens": -1})).to_string().into_bytes(),
            400,
            "max_tokens",
            None,
        ),
        (
            "unknown model",
            json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).to_string().into_bytes(),
            404,
            "`gpt-9` does not exist",
            Some("model_not_found"),
        ),
        ("bad temperature", chat("Hi", json!({"temperature": -1})).to_string().into_bytes(), 400, "temperature", None),
        ("bad top_p", chat("Hi", json!({"top_p": 0})).to_string().into_bytes(), 400, "top_p", None),
        (
            "lone surrogate",
            br#"{"model": "m", "messages": [{"role": "user", "content": "a\ud800b"}]}"#.to_vec(),
            400,
            "messages[0].content: a \\u escape of a UTF-16 surrogate (D800-DFFF) must be one of a high-low pair",
            None,
        ),
        // Past f32's range: refused as the client wrote it, not reported as `inf`.
        (
            "temperature 1e300",
            chat("Hi", json!({"temperature": 1e300})).to_string().into_bytes(),
            400,
            "temperature must be a number of magnitude at most 3.4028235e38, got 1e300",
            None,
        ),
        (
            "presence_penalty -1e39",
            chat("Hi", json!({"presence_penalty": -1e39})).to_string().into_bytes(),
            400,
            "presence_penalty must be a number of magnitude at most 3.4028235e38, got -1e39",
            None,
        ),
        // Asked-for fields the server does not do are refused, not dropped from the answer.
        ("logprobs", chat("Hi", json!({"logprobs": true})).to_string().into_bytes(), 400, "logprobs is not", None),
        ("top_logprobs", chat("Hi", json!({"top_logprobs": 3})).to_string().into_bytes(), 400, "top_logprobs", None),
        (
            "response_format",
            chat("Hi", json!({"response_format": {"type": "json_object"}})).to_string().into_bytes(),
            400,
            "response_format",
            None,
        ),
    ];
    for (what, body, status, text, code) in cases {
        let (st, raw) = s.request("POST", "/v1/chat/completions", &[], &body);
        let v: Value = serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {raw}"));
        assert_eq!(st, status, "{what}: {v}");
        let (msg, c) = err(&v);
        assert!(msg.contains(text), "{what}: {msg}");
        assert_eq!(c, code, "{what}");
    }
    // Completions: a prompt as text, as ids, and bad prompts.
    let (st, v) = s.post(
        "/v1/completions",
        &json!({"model": "m", "prompt": "The quick brown", "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!((st, v["usage"]["completion_tokens"].as_u64()), (200, Some(3)), "{v}");
    let (st, v) = s.post("/v1/completions", &json!({"prompt": [785, 3974], "max_tokens": 2, "temperature": 0}));
    assert_eq!((st, v["usage"]["prompt_tokens"].as_u64()), (200, Some(2)), "{v}");
    let (st, v) = s.post("/v1/completions", &json!({"prompt": [999999999], "max_tokens": 2}));
    assert_eq!(st, 400, "{v}");
    assert!(err(&v).0.contains("outside the vocabulary"), "{v}");
    let (st, v) = s.post("/v1/completions", &json!({"prompt": {"a": 1}}));
    assert_eq!(st, 400, "{v}");
    for (field, value) in [
        ("echo", json!(true)),
        ("logprobs", json!(2)),
        ("best_of", json!(3)),
        ("logit_bias", json!({"15": 100})),
        ("suffix", json!(" end")),
        ("tool_choice", json!("required")),
    ] {
        let mut body = json!({"prompt": "Hi", "max_tokens": 2});
        body[field] = value;
        let (st, v) = s.post("/v1/completions", &body);
        assert_eq!(st, 400, "{field}: {v}");
        assert!(err(&v).0.starts_with(field) && err(&v).0.contains("is not supported"), "{v}");
    }
    // Their "off" values are accepted (clients send them by default).
    let off = json!({"prompt": "Hi", "max_tokens": 1, "temperature": 0, "logprobs": null, "echo": false, "best_of": 1,
                     "logit_bias": {}, "suffix": null, "tool_choice": "auto"});
    assert_eq!(s.post("/v1/completions", &off).0, 200);
    let (st, _) = s.get("/v1/nothing");
    assert_eq!(st, 404);
    // None of the refused requests generated anything.
    assert_eq!(s.metric("picchio_completion_tokens_total"), generated + 6.0);

    // Retrieving a model: the served one, and OpenAI's 404 for another.
    let (st, raw) = s.get("/v1/models/m");
    let v: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!((st, &v["id"], &v["object"], &v["owned_by"]), (200, &json!("m"), &json!("model"), &json!("picchio")));
    let (st, raw) = s.get("/v1/models/gpt-9");
    let v: Value = serde_json::from_str(&raw).unwrap();
    assert_eq!((st, err(&v).1), (404, Some("model_not_found")), "{raw}");
    // A wrong method gets OpenAI's error shape too.
    let (st, raw) = s.get("/v1/chat/completions");
    let v: Value = serde_json::from_str(&raw).unwrap_or_else(|e| panic!("405 not JSON ({e}): {raw}"));
    assert_eq!((st, err(&v).1), (405, Some("method_not_allowed")), "{raw}");
    // Every refusal above is counted by its status, whether the HTTP layer or the worker refused:
    // 15 + 8 bad requests, a body too large, an unknown model, path and model id, a wrong method.
    let failed = |status: u16| s.metric(&format!("picchio_requests_failed_total{{status=\"{status}\"}}"));
    assert_eq!([failed(400), failed(404), failed(405), failed(413)], [26.0, 3.0, 1.0, 1.0]);
    // Requests too malformed for picchio's handlers to see are answered by the HTTP/1 parser
    // (hyper) and counted all the same: a garbled request line (400), a URI past hyper's limit
    // (414), a head past its buffer (431).
    let raw = |bytes: &[u8]| {
        let mut c = TcpStream::connect(&s.addr).unwrap();
        // The server may answer and close before the client has written everything.
        let _ = c.write_all(bytes);
        let mut answer = Vec::new();
        let _ = c.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    };
    let answer = raw(b"NOT A REQUEST LINE AT ALL\r\n\r\n");
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    common::serve::wait_for(|| failed(400) == 27.0);
    let long_uri = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(70_000));
    let answer = raw(long_uri.as_bytes());
    assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 414"), "{answer}");
    common::serve::wait_for(|| failed(414) == 1.0);
    let big_head = format!("GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n", "b".repeat(600_000));
    let answer = raw(big_head.as_bytes());
    assert!(answer.is_empty() || answer.starts_with("HTTP/1.1 431"), "{answer}");
    common::serve::wait_for(|| failed(431) == 1.0);
}

/// A raw HTTP/1.1 exchange: sends `head` then `body`, and reads until the server closes the
/// connection (bounded by the hang limit: a server that never closes fails the read).
fn exchange(addr: &str, head: &str, body: &[u8]) -> Vec<u8> {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(picchio_testkit::bin::HANG_LIMIT)).unwrap();
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(body).unwrap();
    let mut raw = Vec::new();
    c.read_to_end(&mut raw).unwrap_or_else(|e| panic!("the server did not close the connection: {e}"));
    raw
}

/// A body whose Content-Length is beyond --max-body is refused 413 from the header, without a byte
/// of it sent; a body that stops half-way gets 408 after --body-timeout and the connection closes;
/// a connection that sends nothing, or nothing more after a keep-alive answer, is closed after
/// --idle-timeout. (The timeouts are 1 s; what is checked is that each connection ends with that
/// answer, not when.)
#[test]
fn oversized_stalled_and_idle_requests_are_answered_and_closed() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let s = Served::start(&model, &["--max-body", "4096", "--body-timeout", "1", "--idle-timeout", "1"]);
    let post = |len: usize| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
        )
    };
    // 1 GB announced, nothing sent: 413 at once (a server reading first would time out: 408).
    let (st, raw) = parse_response(&exchange(&s.addr, &post(1 << 30), b""));
    let v: Value = serde_json::from_str(&raw).unwrap_or_else(|e| panic!("413 not JSON ({e}): {raw}"));
    assert_eq!((st, err(&v).1), (413, Some("request_too_large")), "{raw}");
    assert!(err(&v).0.contains("--max-body"), "{raw}");
    // Without a Content-Length (chunked), the body is cut at --max-body while it is read.
    let big = chat(&"x".repeat(5000), json!({})).to_string();
    let head =
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    let chunked = format!("{:x}\r\n{big}\r\n0\r\n\r\n", big.len());
    let (st, raw) = parse_response(&exchange(&s.addr, head, chunked.as_bytes()));
    let v: Value = serde_json::from_str(&raw).unwrap_or_else(|e| panic!("413 not JSON ({e}): {raw}"));
    assert_eq!((st, err(&v).1), (413, Some("request_too_large")), "{raw}");
    assert!(err(&v).0.contains("--max-body"), "{raw}");
    // Half a body, then silence: 408, then the connection is closed.
    let body = chat("Hi", json!({"max_tokens": 2})).to_string();
    let (st, raw) = parse_response(&exchange(&s.addr, &post(body.len()), &body.as_bytes()[..body.len() / 2]));
    let v: Value = serde_json::from_str(&raw).unwrap_or_else(|e| panic!("408 not JSON ({e}): {raw}"));
    assert_eq!((st, err(&v).1), (408, Some("request_timeout")), "{raw}");
    assert!(err(&v).0.contains("--body-timeout"), "{raw}");
    // A connection that never sends a request is closed (hyper may say 408 first).
    let raw = exchange(&s.addr, "", b"");
    assert!(raw.is_empty() || raw.starts_with(b"HTTP/1.1 408"), "{}", String::from_utf8_lossy(&raw));
    // A keep-alive connection gets its answer, then is closed once idle.
    let raw = exchange(&s.addr, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"");
    assert_eq!(parse_response(&raw), (200, r#"{"status":"ok"}"#.into()));
    // Nothing of this reached the worker; the refusals are counted by status.
    assert_eq!(s.metric("picchio_requests_total"), 0.0);
    let failed = |status: u16| s.metric(&format!("picchio_requests_failed_total{{status=\"{status}\"}}"));
    assert_eq!([failed(408), failed(413)], [1.0, 2.0]);
}

/// Option values that cannot work are refused before the model is opened, naming the option.
#[test]
fn nonsensical_serve_options_are_refused_by_name() {
    for (args, text) in [
        (&["--max-body", "0"][..], "--max-body must be at least 1"),
        (&["--body-timeout", "0"], "'--body-timeout <SECONDS>': 0 is not in 1..=86400"),
        (&["--idle-timeout", "0"], "'--idle-timeout <SECONDS>': 0 is not in 1..=86400"),
        // Far past a day, a deadline overflowed the clock's arithmetic (a panic on every connection).
        (&["--idle-timeout", "18446744073709551615"], "is not in 1..=86400"),
        (&["--body-timeout", "86401"], "is not in 1..=86400"),
        (&["--host", "example"], "expected an IP address to listen on"),
        (&["--queue", "0"], "--queue must be at least 1"),
        (&["--api-key", " "], "--api-key (or $PICCHIO_API_KEY) is empty"),
    ] {
        let mut all = vec!["serve", "--model", "/nonexistent/model"];
        all.extend_from_slice(args);
        let o = common::picchio(&all);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(text), "{args:?}: {e}");
        assert!(!e.contains("nonexistent"), "{args:?}: refused before opening the model: {e}");
    }
}

/// Listening beyond loopback without an API key is warned about at start-up; with a key, or on
/// loopback, it is not.
#[test]
fn a_non_loopback_address_without_a_key_is_warned_about() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let warned = |args: &[&str]| {
        let s = Served::start(&model, args);
        s.stderr_lines().iter().any(|l| l.contains("warning") && l.contains("without an API key"))
    };
    assert!(warned(&["--host", "0.0.0.0"]), "0.0.0.0 without a key");
    assert!(!warned(&["--host", "0.0.0.0", "--api-key", "k"]), "0.0.0.0 with a key");
    assert!(!warned(&[]), "loopback");
}

/// SIGINT: the listener closes, the running (streamed) request stops at its next token and ends
/// with `finish_reason` "abort" and `[DONE]`, the queued one is answered 503
/// `server_shutting_down` without running, and the process exits 0.
#[cfg(unix)]
#[test]
fn sigint_stops_the_running_request_answers_the_queued_503_and_exits_0() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    // The long answer holds after its first delta until the shutdown stops it: it is running when
    // the signal comes, however fast or slow the machine.
    let s = Served::start_env(&model, &["--queue", "2", "--ctx", "512"], &[(HOLD, "1")]);
    let long = chat("Hi there", json!({"max_tokens": 500, "stream": true, "ignore_eos": true})).to_string();
    let mut a = s.send("POST", "/v1/chat/completions", &[], long.as_bytes());
    let mut first = [0u8; 1];
    a.read_exact(&mut first).unwrap();
    s.wait_for_line("holding the request");
    let short = chat("Hi", json!({"max_tokens": 2})).to_string();
    let b = s.send("POST", "/v1/chat/completions", &[], short.as_bytes());
    common::serve::wait_for(|| s.metric("picchio_queue_depth") == 1.0 && s.metric("picchio_requests_running") == 1.0);
    s.signal(libc::SIGINT);
    s.wait_for_line("shutting down");
    assert!(TcpStream::connect(&s.addr).is_err(), "no longer accepting");
    let mut raw = Vec::new();
    { b }.read_to_end(&mut raw).unwrap();
    let (st, body) = parse_response(&raw);
    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("503 not JSON ({e}): {body}"));
    assert_eq!((st, err(&v).1), (503, Some("server_shutting_down")), "{body}");
    let mut rest = Vec::new();
    a.read_to_end(&mut rest).unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains(r#""finish_reason":"abort""#) && rest.contains("data: [DONE]"), "{rest}");
    assert_eq!(s.wait_exit().code(), Some(0));
}

/// A second SIGINT while the shutdown waits (here for a client stuck sending its body) exits at
/// once, with status 130.
#[cfg(unix)]
#[test]
fn a_second_sigint_exits_at_once() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let s = Served::start(&model, &["--body-timeout", "3600"]);
    let mut stuck = TcpStream::connect(&s.addr).unwrap();
    stuck.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{").unwrap();
    // Its head has been read (it is in the handler, reading the body) when two requests are in
    // progress: it and the /metrics request asking.
    common::serve::wait_for(|| s.metric("picchio_http_requests_in_progress") == 2.0);
    s.signal(libc::SIGINT);
    s.wait_for_line("shutting down");
    s.signal(libc::SIGINT);
    s.wait_for_line("interrupted again");
    assert_eq!(s.wait_exit().code(), Some(130));
    drop(stuck);
}

#[test]
fn an_api_key_is_required_when_set() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let s = Served::start(&model, &["--api-key", "sekrit"]);
    let (st, raw) = s.request("GET", "/v1/models", &[], b"");
    assert_eq!(st, 401, "{raw}");
    assert!(raw.contains("invalid_api_key"), "{raw}");
    let (st, raw) = s.request("GET", "/v1/models", &[("Authorization", "Bearer wrong")], b"");
    assert_eq!(st, 401, "{raw}");
    assert!(raw.contains("incorrect API key"), "{raw}");
    let body = chat("Hi", json!({"max_tokens": 2})).to_string();
    let (st, _) = s.request("POST", "/v1/chat/completions", &[], body.as_bytes());
    assert_eq!(st, 401);
    let (st, raw) = s.request("POST", "/v1/chat/completions", &[("Authorization", "Bearer sekrit")], body.as_bytes());
    assert_eq!(st, 200, "{raw}");
    // The scheme is case-insensitive (RFC 9110 §11.1).
    let (st, raw) = s.request("POST", "/v1/chat/completions", &[("Authorization", "bearer sekrit")], body.as_bytes());
    assert_eq!(st, 200, "{raw}");
    // /health stays open (for load balancers).
    assert_eq!(s.get("/health").0, 200);
}

#[test]
fn requests_beyond_the_queue_bound_get_503() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    // A long answer keeps the worker busy: it holds after its first delta until its client leaves,
    // so it is running for as long as the test needs on any machine. (Not streamed: a client that
    // leaves a waiting handler is noticed at once.)
    let s = Served::start_env(&model, &["--queue", "1", "--ctx", "512"], &[(HOLD, "1")]);
    let long = chat("Hi there", json!({"max_tokens": 500, "ignore_eos": true})).to_string();
    let a = s.send("POST", "/v1/chat/completions", &[], long.as_bytes());
    s.wait_for_line("holding the request");
    // One request may wait...
    let short = chat("Hi", json!({"max_tokens": 2})).to_string();
    let b = s.send("POST", "/v1/chat/completions", &[], short.as_bytes());
    common::serve::wait_for(|| s.metric("picchio_queue_depth") == 1.0);
    // ...the next one is refused.
    let (st, raw) = s.request("POST", "/v1/chat/completions", &[], short.as_bytes());
    assert_eq!(st, 503, "{raw}");
    assert!(raw.contains("queue_full"), "{raw}");
    assert_eq!(s.metric("picchio_requests_rejected_total"), 1.0);
    // The waiting one is answered once the long one ends (its client leaves).
    drop(a);
    let mut raw = Vec::new();
    std::io::Read::read_to_end(&mut { b }, &mut raw).unwrap();
    let (st, body) = common::serve::parse_response(&raw);
    assert_eq!(st, 200, "{body}");
    assert_eq!(s.metric("picchio_requests_cancelled_total"), 1.0, "the long one counted as cancelled");
}

/// A client that goes away while its long prompt is being prefilled (token by token here) is
/// noticed between prefill chunks: the request ends there, with no token generated, and the next
/// request is served at once. The server holds the request before its third chunk
/// (`PICCHIO_SERVE_HOLD_IN_PREFILL`) until the client has gone, so it is mid-prefill when the client
/// leaves on any machine, however fast or loaded.
#[test]
fn a_client_leaving_during_the_prefill_stops_it_there() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let s = Served::start_env(&model, &["--ctx", "512", "--prefill-chunk", "1"], &[(HOLD_PREFILL, "3")]);
    let prompt: Vec<u32> = (0..500).map(|i| 100 + (i * 7) % 1000).collect();
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0}).to_string();
    let conn = s.send("POST", "/v1/completions", &[], body.as_bytes());
    s.wait_for_line("holding the request in its prefill");
    assert_eq!(s.metric("picchio_requests_running"), 1.0);
    drop(conn);
    common::serve::wait_for(|| s.metric("picchio_requests_total") == 1.0);
    assert_eq!(s.metric("picchio_requests_cancelled_total"), 1.0);
    assert_eq!(s.metric("picchio_requests_cancelled_in_prefill_total"), 1.0, "stopped during the prefill");
    assert_eq!(s.metric("picchio_completion_tokens_total"), 0.0, "nothing generated");
    // The two chunks that ran stay in the KV cache: the same prompt again reuses them.
    let (st, v) =
        s.post("/v1/completions", &json!({"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 2,
        "the first request's two prefilled tokens: {v}"
    );
}

/// `tools` and tool messages reach the chat template: the prompt of a request with the function
/// tools, an assistant tool call and its `tool` result is exactly the ids transformers' rendering
/// gives (the Qwen3 fixture case rendered by tests/fixtures/chat/render_qwen3.py).
#[test]
fn tools_and_tool_messages_are_rendered_as_transformers_does() {
    use picchio_runtime::chat::TemplateValue;
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let s = Served::start(&model, &["--ctx", "512"]);
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat/qwen3_rendering.json");
    // Read as template values, which keep the key order the body must have.
    let r: TemplateValue = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = r.get_attr("cases").unwrap();
    let case = cases
        .try_iter()
        .unwrap()
        .find(|c| c.get_attr("name").unwrap().as_str() == Some("tools_without_system_then_answer"))
        .expect("the fixture case");
    let j = |k: &str| serde_json::to_string(&case.get_attr(k).unwrap()).unwrap();
    let body = format!(
        r#"{{"model": "m", "messages": {}, "tools": {}, "max_tokens": 1, "temperature": 0, "return_token_ids": true}}"#,
        j("messages"),
        j("tools")
    );
    let (st, raw) = s.request("POST", "/v1/chat/completions", &[], body.as_bytes());
    assert_eq!(st, 200, "{raw}");
    let v: Value = serde_json::from_str(&raw).unwrap();
    let want: Value = serde_json::from_str(&j("ids")).unwrap();
    assert_eq!(v["prompt_token_ids"], want, "{raw}");
}

/// GPT-OSS (harmony) end to end: a random-weight gpt-oss-20b (one layer) writes tokens outside
/// every harmony channel (no `<|channel|>…<|message|>` header); the chat answer carries that text as
/// its content instead of dropping it, exactly as the harmony parser splits the generated ids.
#[test]
fn gpt_oss_text_outside_every_channel_reaches_the_chat_answer_and_a_call_is_a_tool_call() {
    use picchio_runtime::chat::harmony::split_output;
    let tmp = common::scratch();
    let model = tmp.path().join("g");
    let m = model.to_str().unwrap();
    common::ok(&["synth", "--arch", "gpt-oss-20b", "--layers", "1", "--seed", "7", "--model-out", m, "--no-progress"]);
    let s = Served::start(&model, &["--ctx", "256"]);
    let body = json!({
        "model": "g",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 12,
        "temperature": 0,
        "return_token_ids": true,
    });
    let (st, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let ids: Vec<u32> =
        v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let tok = picchio_runtime::model::tokenizer::Tokenizer::from_dir(&model).unwrap().unwrap();
    let msg = &v["choices"][0]["message"];
    let content = msg["content"].as_str().unwrap_or("");
    let reasoning = msg["reasoning_content"].as_str().unwrap_or("");
    let (want_reasoning, want_content) = split_output(&tok.decode(&ids).unwrap(), true);
    assert_eq!((reasoning, content), (want_reasoning.as_str(), want_content.as_str()), "{v}");
    let plain = tok.decode_text(&ids).unwrap();
    if !tok.decode(&ids).unwrap().contains("<|") {
        // No harmony marker at all: every generated character is the answer.
        assert_eq!(content, plain, "{v}");
    }
    assert!(!content.is_empty() || plain.is_empty(), "generated text vanished: {plain:?} in {v}");
    drop(s);

    // With tools, a message to functions.get_weather ended by <|call|> is a tool call, not
    // reasoning; the test mock makes the model write it (see a_tool_call_in_the_answer_is_returned_as_tool_calls).
    let text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary \
                to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>";
    let ids: Vec<String> = tok.encode(text).unwrap().iter().map(u32::to_string).collect();
    let s = Served::start_env(&model, &["--ctx", "256"], &[("PICCHIO_SERVE_TEST_MOCK_SAMPLED_IDS", &ids.join(","))]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let body = json!({"model": "g", "messages": [{"role": "user", "content": "Weather?"}], "tools": tools,
        "max_tokens": 64, "temperature": 0});
    let (st, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["reasoning_content"], "Need the weather.", "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(
        (&call["function"]["name"], &call["function"]["arguments"]),
        (&json!("get_weather"), &json!("{\"city\": \"Paris\"}")),
        "{v}"
    );
}

/// A tool call in the model's answer comes back as OpenAI `tool_calls` (Qwen3's Hermes
/// `<tool_call>` block), not as text: whole and streamed, with `finish_reason` "tool_calls", the
/// text before it as `content`, and an id a follow-up request answers with a `tool` message. The
/// random-weight fixture never writes a call itself, so the test mock
/// `PICCHIO_SERVE_TEST_MOCK_SAMPLED_IDS` makes it generate the call's tokens (then `<|im_end|>`);
/// detokenizing, parsing, the HTTP answer and the end-of-turn check run for real.
#[test]
fn a_tool_call_in_the_answer_is_returned_as_tool_calls() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let tok = picchio_runtime::model::tokenizer::Tokenizer::from_dir(&model).unwrap().unwrap();
    let text = WEATHER_CALL_ANSWER;
    let (s, ids) = Served::start_answering(&model, text);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let ask = |stream: bool| {
        json!({"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
            "max_tokens": 64, "temperature": 0, "stream": stream, "chat_template_kwargs": {"enable_thinking": false}})
    };
    let (st, v) = s.post("/v1/chat/completions", &ask(false));
    assert_eq!(st, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(choice["message"]["content"], "Let me look.", "{v}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("no tool_calls: {v}"));
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!((&calls[0]["type"], &calls[0]["function"]["name"]), (&json!("function"), &json!("get_weather")));
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Paris\"}");
    let id = calls[0]["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("call_"), "{id}");

    assert_eq!(v["usage"]["completion_tokens"], ids.len(), "the call's tokens are counted: {v}");

    // Streamed: the text as content deltas, the call once in a delta with its index, then the
    // finish chunk; the call's text never appears as content, and the content assembled is the
    // non-streamed one exactly.
    let mut body = ask(true);
    body["stream_options"] = json!({"include_usage": true});
    let st = streamed(&s, &body);
    assert_eq!(st.content, "Let me look.", "{}", st.raw);
    assert_eq!(st.calls.len(), 1, "{}", st.raw);
    let streamed_call = &st.calls[0];
    assert_eq!((&streamed_call["index"], &streamed_call["function"]["name"]), (&json!(0), &json!("get_weather")));
    assert_eq!(streamed_call["function"]["arguments"], "{\"city\": \"Paris\"}");
    assert_eq!(streamed_call["type"], "function");
    assert_ne!(streamed_call["id"].as_str().unwrap(), id, "ids are unique across responses");
    assert_eq!(st.finish, "tool_calls", "{}", st.raw);
    assert_eq!(st.usage["completion_tokens"], ids.len(), "{}", st.raw);

    // Cut by max_tokens inside the block: no call, its text is content, finish_reason "length",
    // streamed and not.
    let cut = ids.len() - 4;
    let cut_text = tok.decode_text(&ids[..cut]).unwrap();
    assert!(cut_text.contains("<tool_call>") && !cut_text.contains("</tool_call>"), "{cut_text:?}");
    let mut body = ask(false);
    body["max_tokens"] = json!(cut);
    let (st, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!((&choice["finish_reason"], &choice["message"]["content"]), (&json!("length"), &json!(cut_text)), "{v}");
    assert!(choice["message"].get("tool_calls").is_none(), "{v}");
    body["stream"] = json!(true);
    let st = streamed(&s, &body);
    assert_eq!(
        (st.content.as_str(), st.finish.as_str(), st.calls.len()),
        (cut_text.as_str(), "length", 0),
        "{}",
        st.raw
    );

    // tool_choice "none": the model was not to call, so what it wrote is text (as vLLM answers).
    let mut body = ask(false);
    body["tool_choice"] = json!("none");
    let (st, v) = s.post("/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!((&choice["finish_reason"], &choice["message"]["content"]), (&json!("stop"), &json!(text)), "{v}");
    assert!(choice["message"].get("tool_calls").is_none(), "{v}");

    // A text completion has no tool_calls: with tools, the call stays in its text.
    let body = json!({"model": "m", "prompt": "Weather?", "tools": tools, "max_tokens": 64, "temperature": 0});
    let (st, v) = s.post("/v1/completions", &body);
    assert_eq!(st, 200, "{v}");
    assert_eq!((&v["choices"][0]["text"], &v["choices"][0]["finish_reason"]), (&json!(text), &json!("stop")), "{v}");

    // The follow-up: the assistant's call and the tool's answer (by the call's id) render and run.
    let follow = json!({"model": "m", "max_tokens": 2, "temperature": 0, "tools": tools, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": id, "content": "18 C, sunny"}]});
    let (st, v) = s.post("/v1/chat/completions", &follow);
    assert_eq!(st, 200, "{v}");
}

/// A streamed chat answer as a client assembles it.
struct Streamed {
    content: String,
    reasoning: String,
    /// Every `delta.tool_calls` entry, in order.
    calls: Vec<Value>,
    finish: String,
    /// The `stream_options.include_usage` chunk's usage (null when not asked for).
    usage: Value,
    raw: String,
}

fn streamed(s: &Served, body: &Value) -> Streamed {
    let (st, raw) = s.request("POST", "/v1/chat/completions", &[], body.to_string().as_bytes());
    assert_eq!(st, 200, "{raw}");
    let chunks: Vec<Value> = raw
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let delta =
        |key: &str| -> String { chunks.iter().filter_map(|c| c["choices"][0]["delta"][key].as_str()).collect() };
    let (content, reasoning) = (delta("content"), delta("reasoning_content"));
    let calls =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().cloned().collect();
    let finishes: Vec<&str> = chunks.iter().filter_map(|c| c["choices"][0]["finish_reason"].as_str()).collect();
    assert_eq!(finishes.len(), 1, "one finish chunk: {raw}");
    let usage = chunks.iter().find(|c| !c["usage"].is_null()).map_or(Value::Null, |c| c["usage"].clone());
    Streamed { content, reasoning, calls, finish: finishes[0].to_string(), usage, raw }
}

/// A `<tool_call>` block whose body is not JSON stays answer text, whole and streamed, with no
/// `tool_calls` and `finish_reason` "stop" (vLLM's hermes parser does the same); two well-formed
/// blocks are two calls with indexes 0 and 1 and distinct ids. The model's output is the test
/// mock's (see a_tool_call_in_the_answer_is_returned_as_tool_calls).
#[test]
fn a_malformed_tool_call_stays_text_and_two_calls_are_two() {
    let tmp = common::scratch();
    let model = packed_model(tmp.path());
    let mock = |text: &str| Served::start_answering(&model, text).0;
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    let ask = |stream: bool| {
        json!({"model": "m", "messages": [{"role": "user", "content": "Go"}], "tools": tools,
            "max_tokens": 96, "temperature": 0, "stream": stream, "chat_template_kwargs": {"enable_thinking": false}})
    };

    let bad = "<tool_call>\n{\"name\": \"f\", \"arguments\": {city: Paris}}\n</tool_call>";
    let s = mock(bad);
    let (st, v) = s.post("/v1/chat/completions", &ask(false));
    assert_eq!(st, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!((&choice["finish_reason"], &choice["message"]["content"]), (&json!("stop"), &json!(bad)), "{v}");
    assert!(choice["message"].get("tool_calls").is_none(), "{v}");
    let st = streamed(&s, &ask(true));
    assert_eq!((st.content.as_str(), st.finish.as_str(), st.calls.len()), (bad, "stop", 0), "{}", st.raw);
    drop(s);

    let two = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 1}}\n</tool_call>\n\
               <tool_call>\n{\"name\": \"f\", \"arguments\": {\"n\": 2}}\n</tool_call>";
    let s = mock(two);
    let (st, v) = s.post("/v1/chat/completions", &ask(false));
    assert_eq!(st, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!((&choice["finish_reason"], &choice["message"]["content"]), (&json!("tool_calls"), &Value::Null), "{v}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap_or_else(|| panic!("no tool_calls: {v}"));
    let args: Vec<&str> = calls.iter().map(|c| c["function"]["arguments"].as_str().unwrap()).collect();
    assert_eq!(args, ["{\"n\": 1}", "{\"n\": 2}"], "{v}");
    assert_ne!(calls[0]["id"], calls[1]["id"], "{v}");
    let st = streamed(&s, &ask(true));
    assert_eq!((st.content.as_str(), st.reasoning.as_str(), st.finish.as_str()), ("", "", "tool_calls"), "{}", st.raw);
    let indexes: Vec<&Value> = st.calls.iter().map(|c| &c["index"]).collect();
    assert_eq!(indexes, [&json!(0), &json!(1)], "{}", st.raw);
    let args: Vec<&str> = st.calls.iter().map(|c| c["function"]["arguments"].as_str().unwrap()).collect();
    assert_eq!(args, ["{\"n\": 1}", "{\"n\": 2}"], "{}", st.raw);
}
