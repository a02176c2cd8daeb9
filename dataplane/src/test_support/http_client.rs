//! A minimal blocking HTTP/1.1 client for tests (shared with the integration tests through
//! `#[path]`): one request per connection, chunked bodies decoded.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse_data(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|ev| ev.strip_prefix("data: "))
            .map(str::to_owned)
            .collect()
    }
}

/// Open a connection and send the request head and body; the caller reads the response.
pub fn send(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> TcpStream {
    send_with(addr, method, path, &[], body)
}

/// [`send`] with more headers (`name`, `value`).
pub fn send_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.unwrap_or("");
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// [`request`] with more headers (`name`, `value`).
pub fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> HttpResponse {
    read_response(BufReader::new(send_with(addr, method, path, headers, body)))
}

pub fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> HttpResponse {
    read_response(BufReader::new(send(addr, method, path, body)))
}

pub fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    (status, headers)
}

pub fn read_response(mut r: impl BufRead) -> HttpResponse {
    let (status, headers) = read_head(&mut r);
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        while let Some(chunk) = read_chunk(&mut r) {
            body.extend_from_slice(&chunk);
        }
    } else {
        r.read_to_end(&mut body).unwrap();
    }
    HttpResponse {
        status,
        headers,
        body: String::from_utf8(body).expect("UTF-8 body"),
    }
}

/// One chunk of a chunked body; None at the terminating zero-size chunk.
pub fn read_chunk(r: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let size = usize::from_str_radix(line.trim(), 16)
        .unwrap_or_else(|_| panic!("bad chunk size {line:?}"));
    let mut buf = vec![0; size + 2];
    r.read_exact(&mut buf).unwrap();
    buf.truncate(size);
    (size > 0).then_some(buf)
}
