//! [`ApiError`]: a request that gets an error answer, with its HTTP status and OpenAI's error body.

use crate::wire::{ErrorBody, ErrorKind, ErrorObject};

/// An error answer: the HTTP status and what goes in OpenAI's error body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status (400, 401, 404, 405, 408, 413, 500, 503).
    pub status: u16,
    /// `invalid_request_error` (the request is at fault) or `server_error`.
    pub kind: ErrorKind,
    /// OpenAI's `code` (`context_length_exceeded`, `model_not_found`, `queue_full`), when one applies.
    pub code: Option<&'static str>,
    /// The message.
    pub message: String,
}

impl ApiError {
    /// A request error (`invalid_request_error`) with `status` and `code`.
    pub fn invalid(status: u16, code: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError { status, kind: ErrorKind::InvalidRequestError, code, message: message.into() }
    }

    /// 400, no code: the body asks for something wrong.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::invalid(400, None, message)
    }

    /// A server error (`server_error`) with `status` and `code`.
    pub fn server(status: u16, code: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError { status, kind: ErrorKind::ServerError, code, message: message.into() }
    }

    /// The error body; `kind` overrides the error's own type (an error after a stream started is a
    /// `server_error` whatever caused it).
    pub fn body(&self, kind: Option<ErrorKind>) -> ErrorBody {
        ErrorBody {
            error: ErrorObject {
                message: self.message.clone(),
                kind: kind.unwrap_or(self.kind),
                param: None,
                code: self.code,
            },
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl std::error::Error for ApiError {}
