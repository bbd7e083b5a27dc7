//! `picchio serve`: an OpenAI-compatible HTTP server over one model. This file is its options;
//! the server is the `picchio-serve` crate ([`picchio_serve::serve`]).

use std::net::IpAddr;
use std::time::Duration;

use picchio_serve::MAX_TIMEOUT_S;

/// Options of `picchio serve`.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: super::model_args::ModelArgs,
    /// Address to listen on (loopback by default: give 0.0.0.0 to serve the network, with --api-key;
    /// without a key, a non-loopback address gets a warning at start-up).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1", value_parser = parse_host)]
    pub host: IpAddr,
    /// TCP port (0 picks a free one; the address is printed on stderr).
    #[arg(long, value_name = "PORT", default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer K` on /v1/ requests [default: $PICCHIO_API_KEY, else none].
    #[arg(long, value_name = "K", env = "PICCHIO_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Requests that may wait while one runs; more get 503.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub queue: usize,
    /// Largest request body in bytes; larger ones get 413 (from their Content-Length header, before
    /// the body is read, when they send one).
    #[arg(long, value_name = "BYTES", default_value_t = 4 << 20)]
    pub max_body: usize,
    /// Seconds a request body may stall: a client that stops sending its body for longer gets 408
    /// and its connection is closed.
    #[arg(long, value_name = "SECONDS", default_value_t = 30, value_parser = super::int_in::<u64>(1, Some(i128::from(MAX_TIMEOUT_S))))]
    pub body_timeout: u64,
    /// Seconds a connection may wait for (the headers of) its next request, idle keep-alive
    /// connections included, before it is closed.
    #[arg(long, value_name = "SECONDS", default_value_t = 60, value_parser = super::int_in::<u64>(1, Some(i128::from(MAX_TIMEOUT_S))))]
    pub idle_timeout: u64,
}

/// `--host`: an IP address (`127.0.0.1`, `0.0.0.0`, `::1`, `[::1]`) or `localhost` (127.0.0.1).
fn parse_host(s: &str) -> Result<IpAddr, String> {
    let t = s.trim();
    if t.eq_ignore_ascii_case("localhost") {
        return Ok(IpAddr::from([127, 0, 0, 1]));
    }
    let t = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')).unwrap_or(t);
    t.parse().map_err(|_| {
        format!("expected an IP address to listen on, such as 127.0.0.1 (loopback), 0.0.0.0 (every interface) or ::1, or localhost; got {s:?}")
    })
}

impl Args {
    /// Refuses option values that cannot work, naming the option.
    ///
    /// # Errors
    /// `--queue 0`, `--max-body 0`, an empty API key. (The timeouts' range, 1 to [`MAX_TIMEOUT_S`]
    /// seconds, is checked as they are parsed.)
    pub fn check(&self) -> anyhow::Result<()> {
        if self.queue == 0 {
            anyhow::bail!("--queue must be at least 1 (requests that may wait while one runs)");
        }
        if self.max_body == 0 {
            anyhow::bail!("--max-body must be at least 1 byte (every request has a JSON body); the default is 4194304");
        }
        if self.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
            anyhow::bail!(
                "--api-key (or $PICCHIO_API_KEY) is empty or blank: give a key, or leave both unset to serve without one"
            );
        }
        Ok(())
    }
}

pub fn exec(mut a: Args) -> anyhow::Result<()> {
    a.check()?;
    let engine = a.model.open()?;
    let options = picchio_serve::Options {
        host: a.host,
        port: a.port,
        api_key: a.api_key.clone(),
        queue: a.queue,
        limits: picchio_serve::Limits {
            max_body: a.max_body,
            body_timeout: Duration::from_secs(a.body_timeout),
            idle_timeout: Duration::from_secs(a.idle_timeout),
        },
    };
    Ok(picchio_serve::serve(engine, &options)?)
}
