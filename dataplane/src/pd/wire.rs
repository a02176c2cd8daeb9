//! ZeroMQ plumbing shared by both roles: socket options and bounded, non-blocking sends.

use crate::kv::{Envelope, HEADER_LEN, KvChunkRef, MAX_PAYLOAD, encode, encode_chunk};

/// Messages queued per peer before sends fail fast. KV bytes are bounded exactly by the
/// per-peer send budget (CREDIT); this bounds the small control messages around them.
const HWM: i32 = 10_000;
/// How long a closing socket may still flush what it queued (the last FAILED and GOODBYE
/// of a shutdown) before it is dropped: bounded, so closing never holds a process up.
pub(super) const CLOSE_LINGER_MS: i32 = 200;
/// How long a loop keeps its connections open after its last FAILED and GOODBYE: libzmq
/// discards what a peer has received but not yet read when the connection closes, so the
/// peer's loop (which polls every `POLL_MS`) needs a moment to read them.
pub(super) const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_millis(150);
/// Longest a loop waits in `poll` before going round (heartbeat, deadlines, commands).
pub(super) const POLL_MS: i64 = 10;
/// Most inbound messages handled per loop iteration, so timers still run under a flood.
pub(super) const RECV_BATCH: usize = 256;

/// Give a socket about to be closed a short, bounded linger (it is 0 while it runs).
pub(super) fn set_close_linger(sock: &zmq::Socket) {
    let _ = sock.set_linger(CLOSE_LINGER_MS);
}

pub(super) fn configure(sock: &zmq::Socket) -> zmq::Result<()> {
    sock.set_linger(0)?;
    sock.set_sndhwm(HWM)?;
    sock.set_rcvhwm(HWM)?;
    // libzmq drops any inbound frame above this size before we ever see it.
    sock.set_maxmsgsize((MAX_PAYLOAD + HEADER_LEN) as i64)?;
    Ok(())
}

/// Send without blocking; `route` is the ROUTER's peer id. Errors are returned (and
/// counted by the caller under `send_error_label`).
pub(super) fn send(sock: &zmq::Socket, route: Option<&[u8]>, env: &Envelope) -> zmq::Result<usize> {
    let [h, p] = encode(env);
    let n = p.len();
    match route {
        Some(r) => sock.send_multipart([r, h.as_slice(), p.as_slice()], zmq::DONTWAIT)?,
        None => sock.send_multipart([h.as_slice(), p.as_slice()], zmq::DONTWAIT)?,
    }
    Ok(n)
}

/// Send one KV chunk without blocking. Its payload frame is built once from the exported
/// KV and handed to ZeroMQ by ownership (`zmq::Message` from a `Vec` does not copy), so
/// the bytes are copied once in user space on this side.
pub(super) fn send_chunk(
    sock: &zmq::Socket,
    route: Option<&[u8]>,
    incarnation: u64,
    group: u64,
    room: u64,
    c: &KvChunkRef<'_>,
) -> zmq::Result<usize> {
    let [h, p] = encode_chunk(incarnation, group, room, c);
    let n = c.data.len();
    if let Some(r) = route {
        sock.send(r, zmq::SNDMORE | zmq::DONTWAIT)?;
    }
    sock.send(h, zmq::SNDMORE | zmq::DONTWAIT)?;
    sock.send(zmq::Message::from(p), zmq::DONTWAIT)?;
    Ok(n)
}

pub(super) fn send_error_label(e: zmq::Error) -> &'static str {
    match e {
        zmq::Error::EAGAIN => "queue_full_or_disconnected",
        zmq::Error::EHOSTUNREACH => "peer_unreachable",
        _ => "socket_error",
    }
}

/// Next inbound multipart message, if any, without blocking. The frames stay ZeroMQ
/// messages (no copy into `Vec`s); decoding reads them in place.
pub(super) fn try_recv(sock: &zmq::Socket) -> Option<Vec<zmq::Message>> {
    let mut frames = Vec::with_capacity(3);
    loop {
        let mut m = zmq::Message::new();
        sock.recv(&mut m, zmq::DONTWAIT).ok()?;
        let more = m.get_more();
        frames.push(m);
        if !more {
            return Some(frames);
        }
    }
}

/// Wait up to `POLL_MS` for input.
pub(super) fn wait_readable(sock: &zmq::Socket) {
    let _ = sock.poll(zmq::POLLIN, POLL_MS);
}

/// Wait up to `POLL_MS` for input on either socket.
pub(super) fn wait_readable2(a: &zmq::Socket, b: &zmq::Socket) {
    let mut items = [a.as_poll_item(zmq::POLLIN), b.as_poll_item(zmq::POLLIN)];
    let _ = zmq::poll(&mut items, POLL_MS);
}

/// A socket monitor reporting when `sock`'s TCP connection closes: the PAIR end of
/// `zmq_socket_monitor`, watching `ZMQ_EVENT_DISCONNECTED` only. `name` makes the inproc
/// endpoint unique within the context.
pub(super) fn disconnect_monitor(
    ctx: &zmq::Context,
    sock: &zmq::Socket,
    name: &str,
) -> zmq::Result<zmq::Socket> {
    let endpoint = format!("inproc://tandem-monitor-{name}");
    sock.monitor(&endpoint, zmq::SocketEvent::DISCONNECTED.to_raw() as i32)?;
    let mon = ctx.socket(zmq::PAIR)?;
    mon.set_linger(0)?;
    mon.connect(&endpoint)?;
    Ok(mon)
}

/// Disconnections reported by a `disconnect_monitor` since the last call, without blocking.
/// A monitor event is two frames: 2 bytes event id + 4 bytes value, then the endpoint.
pub(super) fn take_disconnects(mon: &zmq::Socket) -> Vec<String> {
    let mut seen = Vec::new();
    while let Some(frames) = try_recv(mon) {
        let is_disconnect = frames.first().is_some_and(|f| {
            f.len() >= 2
                && u16::from_le_bytes([f[0], f[1]]) == zmq::SocketEvent::DISCONNECTED.to_raw()
        });
        if is_disconnect {
            let endpoint = frames
                .get(1)
                .map(|f| String::from_utf8_lossy(f).into_owned())
                .unwrap_or_default();
            seen.push(endpoint);
        }
    }
    seen
}

pub(super) fn hex_id(id: &[u8]) -> String {
    hex::encode(id)
}
