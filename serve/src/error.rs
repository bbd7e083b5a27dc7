//! [`Error`]: why the server could not start or run.

/// A failure to start or run the server (each request's own errors are answers: [`crate::ApiError`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Binding the listening address.
    #[error("binding {addr}")]
    Bind {
        /// `HOST:PORT` as given.
        addr: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Reading back the bound address (for a `--port 0` server's announcement).
    #[error("reading the listening address")]
    LocalAddr(#[source] std::io::Error),
    /// Installing a signal handler.
    #[error("installing the {signal} handler")]
    Signal {
        /// `SIGINT` or `SIGTERM`.
        signal: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Starting the generation thread.
    #[error("starting the generation thread")]
    Thread(#[source] std::io::Error),
    /// Starting the async runtime.
    #[error("starting the async runtime")]
    Runtime(#[source] std::io::Error),
}

/// This crate's results.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn errors_name_what_failed_and_keep_the_cause() {
        let e = Error::Bind { addr: "127.0.0.1:80".into(), source: std::io::ErrorKind::PermissionDenied.into() };
        assert_eq!(e.to_string(), "binding 127.0.0.1:80");
        assert_eq!(e.source().unwrap().to_string(), "permission denied");
        let e = Error::Signal { signal: "SIGTERM", source: std::io::Error::other("no") };
        assert_eq!(
            (e.to_string().as_str(), e.source().unwrap().to_string().as_str()),
            ("installing the SIGTERM handler", "no")
        );
    }
}
