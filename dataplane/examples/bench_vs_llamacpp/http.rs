//! HTTP/1.1 and SSE, by hand: the timing of the first event is the figure we want.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

pub(crate) fn get_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A `Transfer-Encoding: chunked` body as a plain byte stream.
struct Chunked<R> {
    inner: R,
    left: usize,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            if self.inner.read_line(&mut line)? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            let size = line.trim().split(';').next().unwrap_or("");
            let size = usize::from_str_radix(size, 16).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidData, format!("chunk size {line:?}"))
            })?;
            if size == 0 {
                self.done = true;
                return Ok(0);
            }
            self.left = size;
        }
        let want = buf.len().min(self.left);
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.left -= n;
        if self.left == 0 {
            let mut crlf = String::new();
            self.inner.read_line(&mut crlf)?;
        }
        Ok(n)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Reply {
    pub(crate) ttft: Duration,
    pub(crate) completion_tokens: u64,
    pub(crate) prompt_tokens: u64,
}

pub(crate) fn stream_chat(addr: SocketAddr, body: &str) -> Result<Reply> {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\
         Content-Type: application/json\r\nAccept: text/event-stream\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("bad status line {line:?}"))?;
    let mut chunked = false;
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 || line.trim().is_empty() {
            break;
        }
        let l = line.to_ascii_lowercase();
        if l.starts_with("transfer-encoding:") && l.contains("chunked") {
            chunked = true;
        }
    }
    let body_reader: Box<dyn BufRead> = if chunked {
        Box::new(BufReader::new(Chunked {
            inner: r,
            left: 0,
            done: false,
        }))
    } else {
        Box::new(r)
    };
    if status != 200 {
        let mut text = String::new();
        let _ = { body_reader }.read_to_string(&mut text);
        bail!("HTTP {status}: {}", text.trim());
    }
    let mut tally = SseTally::default();
    for l in body_reader.lines() {
        if tally.line(&l?, t0.elapsed())? {
            break;
        }
    }
    tally.finish()
}

/// What the events of one streamed chat completion told us, fed line by line (pure, so the
/// timing rules are unit-tested). Both servers send `data: {json}` lines, a role-only first
/// delta (empty or absent `content`), one delta per token or piece of text, `usage` in a
/// final chunk (`stream_options.include_usage`; Tandem also puts it in the finishing
/// chunk), and `data: [DONE]`.
#[derive(Debug, Default)]
struct SseTally {
    ttft: Option<Duration>,
    usage: Option<Value>,
}

impl SseTally {
    /// One line of the event stream, `now` = time since the request was sent. Returns
    /// true at `[DONE]`.
    fn line(&mut self, line: &str, now: Duration) -> Result<bool> {
        // Blank separators, comments (`: ping`), `event:` / `id:` fields carry no data.
        let Some(data) = line.strip_prefix("data:") else {
            return Ok(false);
        };
        let data = data.trim();
        if data == "[DONE]" {
            return Ok(true);
        }
        let v: Value =
            serde_json::from_str(data).with_context(|| format!("SSE data is not JSON: {data}"))?;
        if let Some(e) = v.get("error") {
            bail!("error event: {e}");
        }
        let content = v["choices"][0]["delta"]["content"].as_str().unwrap_or("");
        if !content.is_empty() {
            self.ttft.get_or_insert(now);
        }
        if v["usage"].is_object() {
            self.usage = Some(v["usage"].clone());
        }
        Ok(false)
    }

    fn finish(self) -> Result<Reply> {
        let ttft = self.ttft.context("the stream ended without any content")?;
        let usage = self
            .usage
            .context("the stream carried no usage (stream_options.include_usage)")?;
        let count = |k: &str| {
            usage[k]
                .as_u64()
                .with_context(|| format!("usage without an integer {k}: {usage}"))
        };
        Ok(Reply {
            ttft,
            completion_tokens: count("completion_tokens")?,
            prompt_tokens: count("prompt_tokens")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Feeds `lines` with line i at i×10 ms; returns the tally's reply.
    fn tally(lines: &[&str]) -> Result<Reply> {
        let mut t = SseTally::default();
        for (i, l) in lines.iter().enumerate() {
            if t.line(l, ms(10 * i as u64))? {
                break;
            }
        }
        t.finish()
    }

    #[test]
    fn tandem_stream_ttft_is_the_first_nonempty_content() {
        let r = tally(&[
            r#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
            "",
            r#"data: {"choices":[{"index":0,"delta":{"content":"Once"},"finish_reason":null}]}"#,
            "",
            r#"data: {"choices":[{"index":0,"delta":{"content":" upon"},"finish_reason":null}]}"#,
            r#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}],"usage":{"prompt_tokens":31,"completion_tokens":2,"total_tokens":33}}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":31,"completion_tokens":2,"total_tokens":33}}"#,
            "data: [DONE]",
        ])
        .unwrap();
        assert_eq!(r.ttft, ms(20));
        assert_eq!((r.prompt_tokens, r.completion_tokens), (31, 2));
    }

    #[test]
    fn llama_stream_with_null_content_and_comments() {
        let r = tally(&[
            ": keep-alive",
            r#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}"#,
            "event: message",
            r#"data:{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#,
            r#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":128}}"#,
            "data: [DONE]",
            // Nothing after [DONE] counts.
            r#"data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
        ])
        .unwrap();
        assert_eq!(r.ttft, ms(30));
        assert_eq!((r.prompt_tokens, r.completion_tokens), (7, 128));
    }

    #[test]
    fn failures_are_named() {
        let err = |lines: &[&str]| format!("{:#}", tally(lines).unwrap_err());
        let e = err(&[r#"data: {"error":{"message":"queue full","code":503}}"#]);
        assert!(e.contains("error event") && e.contains("queue full"), "{e}");
        let e = err(&["data: {not json"]);
        assert!(e.contains("not JSON"), "{e}");
        let e = err(&[r#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":0}}"#]);
        assert!(e.contains("without any content"), "{e}");
        let e = err(&[
            r#"data: {"choices":[{"delta":{"content":"x"}}]}"#,
            "data: [DONE]",
        ]);
        assert!(e.contains("no usage"), "{e}");
        let e = err(&[
            r#"data: {"choices":[{"delta":{"content":"x"}}]}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":3}}"#,
        ]);
        assert!(e.contains("completion_tokens"), "{e}");
    }

    fn dechunk(wire: &[u8]) -> io::Result<String> {
        let mut out = String::new();
        Chunked {
            inner: io::Cursor::new(wire),
            left: 0,
            done: false,
        }
        .read_to_string(&mut out)?;
        Ok(out)
    }

    #[test]
    fn chunked_bodies_decode_and_bad_ones_fail() {
        let wire = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n";
        assert_eq!(dechunk(wire).unwrap(), "hello world");
        let e = dechunk(b"zz\r\nhello\r\n").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        let e = dechunk(b"a\r\nhel").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        let e = dechunk(b"3\r\nabc\r\n").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
