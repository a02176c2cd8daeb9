//! OpenAI-style error responses: `{"error":{"message","type","param","code"}}`.

use http::StatusCode;
use serde_json::json;

use crate::scheduler::{FailReason, SubmitError};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// The methods a 405's path does take (its `Allow` header).
    pub allow: Option<String>,
}

impl ApiError {
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
            allow: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            code: Some("not_found"),
            ..Self::invalid(None, message)
        }
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            ..Self::invalid(None, message)
        }
    }

    /// A 405 names the methods its path takes.
    pub fn with_allow(mut self, methods: String) -> Self {
        self.allow = Some(methods);
        self
    }

    pub fn server(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some(code),
            allow: None,
        }
    }

    pub fn from_failure(reason: FailReason, message: String) -> Self {
        match reason {
            FailReason::TooLarge => {
                Self::invalid(None, message).with_code("context_length_exceeded")
            }
            FailReason::InvalidRequest => Self::invalid(None, message),
            FailReason::QueueFull
            | FailReason::QueueTimeout
            | FailReason::EngineStopped
            | FailReason::KvTransfer => {
                Self::server(StatusCode::SERVICE_UNAVAILABLE, reason.label(), message)
            }
            FailReason::StepFailed => {
                Self::server(StatusCode::INTERNAL_SERVER_ERROR, reason.label(), message)
            }
        }
    }

    pub fn from_submit(e: SubmitError) -> Self {
        let reason = match e {
            SubmitError::QueueFull => FailReason::QueueFull,
            SubmitError::EngineStopped => FailReason::EngineStopped,
        };
        Self::from_failure(reason, e.to_string())
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}
