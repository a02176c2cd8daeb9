//! Bounds-checked little-endian reading and writing of payload fields, and the typed
//! decode errors the transport counts by kind.

use thiserror::Error;

/// Why a message was not decoded. `kind()` is the metrics label.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("expected 2 frames, got {0}")]
    FrameCount(usize),
    #[error("bad magic")]
    BadMagic,
    #[error("protocol version {got} (type {msg_type}), this process speaks {want}")]
    WrongVersion { got: u16, want: u16, msg_type: u8 },
    #[error("unknown message type {0}")]
    UnknownType(u8),
    #[error("truncated: needed {needed} more bytes")]
    Truncated { needed: usize },
    #[error("{0} bytes exceed the payload limit")]
    Oversized(usize),
    #[error("bad length: {0}")]
    BadLength(String),
    #[error("bad value: {0}")]
    BadValue(String),
    #[error("room id {room} is not allowed on this message type")]
    BadRoom { room: u64 },
}

impl DecodeError {
    pub fn kind(&self) -> &'static str {
        match self {
            Self::FrameCount(_) => "frame_count",
            Self::BadMagic => "bad_magic",
            Self::WrongVersion { .. } => "wrong_version",
            Self::UnknownType(_) => "unknown_type",
            Self::Truncated { .. } => "truncated",
            Self::Oversized(_) => "oversized",
            Self::BadLength(_) => "bad_length",
            Self::BadValue(_) => "bad_value",
            Self::BadRoom { .. } => "bad_room",
        }
    }
}

pub(super) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.buf.len() {
            return Err(DecodeError::Truncated {
                needed: n - self.buf.len(),
            });
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    pub(super) fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub(super) fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }
    pub(super) fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub(super) fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(super) fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub(super) fn f32(&mut self) -> Result<f32, DecodeError> {
        Ok(f32::from_le_bytes(self.array()?))
    }

    pub(super) fn flag(&mut self) -> Result<bool, DecodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(DecodeError::BadValue(format!("flag byte {v}"))),
        }
    }

    /// A u16-length-prefixed UTF-8 string of at most `max` bytes.
    pub(super) fn str16(&mut self, max: usize) -> Result<String, DecodeError> {
        let n = self.u16()? as usize;
        if n > max {
            return Err(DecodeError::BadLength(format!(
                "string of {n} bytes (limit {max})"
            )));
        }
        let b = self.take(n)?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| DecodeError::BadValue("string is not UTF-8".into()))
    }

    /// `n` elements of `size` bytes each must be present before anything is allocated.
    pub(super) fn check_count(&self, n: usize, size: usize) -> Result<(), DecodeError> {
        let need = n
            .checked_mul(size)
            .ok_or(DecodeError::Oversized(usize::MAX))?;
        if need > self.buf.len() {
            return Err(DecodeError::Truncated {
                needed: need - self.buf.len(),
            });
        }
        Ok(())
    }

    pub(super) fn finish(self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::BadLength(format!(
                "{} trailing bytes",
                self.buf.len()
            )))
        }
    }
}

#[derive(Default)]
pub(super) struct Writer {
    pub(super) buf: Vec<u8>,
}

impl Writer {
    pub(super) fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub(super) fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn f32(&mut self, v: f32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub(super) fn bytes(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }
    /// Strings longer than the limit are cut at a char boundary: the sender never emits
    /// something its peer would reject.
    pub(super) fn str16(&mut self, s: &str, max: usize) {
        let mut end = s.len().min(max).min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.bytes(&s.as_bytes()[..end]);
    }
}
