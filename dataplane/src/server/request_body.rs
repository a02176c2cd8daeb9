//! Reading a request body within the size limit: a declared length over it is refused
//! before a byte is read (413 `body_too_large`), and so is a body that grows past it. A
//! leaf, used by the route table and by the handlers that read their own bodies.

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use super::ApiError;

pub(super) async fn body(req: Request<Incoming>, max: usize) -> Result<Bytes, ApiError> {
    let too_large = || ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        ..ApiError::invalid(None, format!("the request body exceeds {max} bytes"))
            .with_code("body_too_large")
    };
    // A declared length beyond the limit is refused before reading a byte of it.
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    match Limited::new(req.into_body(), max).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large()),
        Err(e) => Err(
            ApiError::invalid(None, format!("could not read the request body: {e}"))
                .with_code("body_read_error"),
        ),
    }
}
