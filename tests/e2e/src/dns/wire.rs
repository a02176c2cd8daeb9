//! The DNS wire format (RFC 1035 §4), the part a stub resolver's queries need.
//!
//! Message layout (all integers big-endian):
//! ```text
//! header    12 bytes: id u16 | flags u16 (QR, opcode 4 bits, AA, TC, RD, RA, Z 3 bits,
//!                     rcode 4 bits) | qdcount u16 | ancount u16 | nscount u16 | arcount u16
//! question  qname (labels: length byte 1..=63 then the bytes; a zero byte ends the name;
//!           at most 255 bytes) | qtype u16 | qclass u16
//! answer    name (here always the pointer 0xC00C to the question's name) | type u16 |
//!           class u16 | ttl u32 | rdlength u16 | rdata (A: 4 bytes)
//! ```
//! Queries carry exactly one question and no compression; anything else is answered with
//! FORMERR (malformed) or NOTIMP (another opcode), and a packet too short to hold a
//! header is dropped.

use std::net::Ipv4Addr;

pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;
pub const CLASS_IN: u16 = 1;

pub const RCODE_NOERROR: u8 = 0;
pub const RCODE_FORMERR: u8 = 1;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_NOTIMP: u8 = 4;

const HEADER: usize = 12;
/// Largest UDP answer without EDNS (RFC 1035 §4.2.1).
pub const MAX_UDP: usize = 512;

/// A parsed query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    /// Recursion desired: echoed in the answer.
    pub rd: bool,
    /// Lower-case name without the trailing dot.
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
    /// The question section exactly as received (echoed in the answer).
    question: Vec<u8>,
}

/// Why a packet is not a query we answer normally.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reject {
    /// Too short to carry a header: no answer is possible.
    Drop,
    /// Answer with this rcode and no question section.
    Error { id: u16, rd: bool, rcode: u8 },
}

/// Parse a query packet.
pub fn parse_query(packet: &[u8]) -> Result<Query, Reject> {
    if packet.len() < HEADER {
        return Err(Reject::Drop);
    }
    let id = u16::from_be_bytes([packet[0], packet[1]]);
    let flags = u16::from_be_bytes([packet[2], packet[3]]);
    let rd = flags & 0x0100 != 0;
    let formerr = Reject::Error {
        id,
        rd,
        rcode: RCODE_FORMERR,
    };
    if flags & 0x8000 != 0 {
        // A response sent to us: never answer it (no reflection loops).
        return Err(Reject::Drop);
    }
    let opcode = (flags >> 11) & 0xf;
    if opcode != 0 {
        return Err(Reject::Error {
            id,
            rd,
            rcode: RCODE_NOTIMP,
        });
    }
    let qdcount = u16::from_be_bytes([packet[4], packet[5]]);
    if qdcount != 1 {
        return Err(formerr);
    }
    let mut pos = HEADER;
    let mut labels: Vec<String> = Vec::new();
    let mut name_len = 0usize;
    loop {
        let Some(&len) = packet.get(pos) else {
            return Err(formerr);
        };
        pos += 1;
        if len == 0 {
            break;
        }
        if len & 0xc0 != 0 || len > 63 {
            // Compression pointers and extended label types have no place in a question.
            return Err(formerr);
        }
        let len = usize::from(len);
        let Some(label) = packet.get(pos..pos + len) else {
            return Err(formerr);
        };
        name_len += len + 1;
        if name_len > 255 {
            return Err(formerr);
        }
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        pos += len;
    }
    let Some(tail) = packet.get(pos..pos + 4) else {
        return Err(formerr);
    };
    let qtype = u16::from_be_bytes([tail[0], tail[1]]);
    let qclass = u16::from_be_bytes([tail[2], tail[3]]);
    pos += 4;
    Ok(Query {
        id,
        rd,
        name: labels.join("."),
        qtype,
        qclass,
        question: packet[HEADER..pos].to_vec(),
    })
}

fn header(id: u16, rd: bool, rcode: u8, qd: u16, an: u16, truncated: bool) -> Vec<u8> {
    // QR=1, opcode 0, AA=1 (we are the authority for the cluster domain), RA=0.
    let mut flags: u16 = 0x8000 | 0x0400 | u16::from(rcode & 0xf);
    if rd {
        flags |= 0x0100;
    }
    if truncated {
        flags |= 0x0200;
    }
    let mut h = Vec::with_capacity(MAX_UDP);
    h.extend_from_slice(&id.to_be_bytes());
    h.extend_from_slice(&flags.to_be_bytes());
    h.extend_from_slice(&qd.to_be_bytes());
    h.extend_from_slice(&an.to_be_bytes());
    h.extend_from_slice(&0u16.to_be_bytes());
    h.extend_from_slice(&0u16.to_be_bytes());
    h
}

/// The answer to `q`: `rcode`, and for NOERROR the A records `addrs` (none is NODATA).
/// Records that would push the message past 512 bytes are left out and TC is set.
pub fn answer(q: &Query, rcode: u8, addrs: &[Ipv4Addr], ttl: u32) -> Vec<u8> {
    const RECORD: usize = 2 + 2 + 2 + 4 + 2 + 4;
    let room = MAX_UDP.saturating_sub(HEADER + q.question.len()) / RECORD;
    let fit = addrs.len().min(room);
    let mut out = header(q.id, q.rd, rcode, 1, fit as u16, fit < addrs.len());
    out.extend_from_slice(&q.question);
    for a in &addrs[..fit] {
        out.extend_from_slice(&0xc00cu16.to_be_bytes());
        out.extend_from_slice(&TYPE_A.to_be_bytes());
        out.extend_from_slice(&CLASS_IN.to_be_bytes());
        out.extend_from_slice(&ttl.to_be_bytes());
        out.extend_from_slice(&4u16.to_be_bytes());
        out.extend_from_slice(&a.octets());
    }
    out
}

/// The answer to a rejected packet (`None`: send nothing).
pub fn error_answer(r: &Reject) -> Option<Vec<u8>> {
    match *r {
        Reject::Drop => None,
        Reject::Error { id, rd, rcode } => Some(header(id, rd, rcode, 0, 0, false)),
    }
}

/// Build a query (tests, and the harness's own checks).
pub fn build_query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&0x0100u16.to_be_bytes());
    out.extend_from_slice(&1u16.to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        out.push(label.len() as u8);
        out.extend_from_slice(label.as_bytes());
    }
    out.push(0);
    out.extend_from_slice(&qtype.to_be_bytes());
    out.extend_from_slice(&CLASS_IN.to_be_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_round_trips_into_an_answer() {
        let packet = build_query(
            0xbeef,
            "Prefill-0.Demo-g0-bootstrap.ns.svc.cluster.local.",
            TYPE_A,
        );
        let q = parse_query(&packet).unwrap();
        assert_eq!(q.id, 0xbeef);
        assert!(q.rd);
        assert_eq!(q.name, "prefill-0.demo-g0-bootstrap.ns.svc.cluster.local");
        assert_eq!((q.qtype, q.qclass), (TYPE_A, CLASS_IN));

        let a = answer(&q, RCODE_NOERROR, &[Ipv4Addr::new(10, 213, 0, 11)], 5);
        assert_eq!(&a[0..2], &[0xbe, 0xef]);
        assert_eq!(a[2] & 0x80, 0x80, "QR set");
        assert_eq!(a[2] & 0x04, 0x04, "AA set");
        assert_eq!(a[3] & 0x0f, RCODE_NOERROR);
        assert_eq!(u16::from_be_bytes([a[6], a[7]]), 1, "one answer");
        assert_eq!(&a[12..packet.len()], &packet[12..], "question echoed");
        let rr = &a[packet.len()..];
        assert_eq!(&rr[0..2], &[0xc0, 0x0c]);
        assert_eq!(u32::from_be_bytes([rr[6], rr[7], rr[8], rr[9]]), 5);
        assert_eq!(&rr[12..16], &[10, 213, 0, 11]);
    }

    #[test]
    fn nxdomain_and_nodata_carry_no_records() {
        let q = parse_query(&build_query(1, "nope.ns.svc.cluster.local", TYPE_AAAA)).unwrap();
        let a = answer(&q, RCODE_NXDOMAIN, &[], 5);
        assert_eq!(a[3] & 0x0f, RCODE_NXDOMAIN);
        assert_eq!(u16::from_be_bytes([a[6], a[7]]), 0);
    }

    #[test]
    fn malformed_packets_get_formerr_or_nothing() {
        assert_eq!(parse_query(&[1, 2, 3]), Err(Reject::Drop));
        let mut p = build_query(7, "a.b", TYPE_A);
        p.truncate(p.len() - 3);
        let r = parse_query(&p).unwrap_err();
        assert_eq!(
            r,
            Reject::Error {
                id: 7,
                rd: true,
                rcode: RCODE_FORMERR
            }
        );
        let e = error_answer(&r).unwrap();
        assert_eq!(e.len(), 12);
        assert_eq!(e[3] & 0x0f, RCODE_FORMERR);

        // A compression pointer inside the question.
        let mut p = build_query(8, "a", TYPE_A);
        p[12] = 0xc0;
        assert!(matches!(
            parse_query(&p),
            Err(Reject::Error {
                rcode: RCODE_FORMERR,
                ..
            })
        ));
        // Two questions.
        let mut p = build_query(9, "a", TYPE_A);
        p[5] = 2;
        assert!(matches!(
            parse_query(&p),
            Err(Reject::Error {
                rcode: RCODE_FORMERR,
                ..
            })
        ));
        // A response is never answered.
        let mut p = build_query(10, "a", TYPE_A);
        p[2] |= 0x80;
        assert_eq!(parse_query(&p), Err(Reject::Drop));
        // Another opcode.
        let mut p = build_query(11, "a", TYPE_A);
        p[2] |= 0x10;
        assert!(matches!(
            parse_query(&p),
            Err(Reject::Error {
                rcode: RCODE_NOTIMP,
                ..
            })
        ));
        // A label longer than 63 bytes.
        let long = "x".repeat(64);
        assert!(parse_query(&build_query(12, &long, TYPE_A)).is_err());
    }

    #[test]
    fn too_many_records_are_truncated_with_tc() {
        let q = parse_query(&build_query(1, "many.ns.svc.cluster.local", TYPE_A)).unwrap();
        let addrs: Vec<Ipv4Addr> = (0..200).map(|i| Ipv4Addr::new(10, 0, 0, i as u8)).collect();
        let a = answer(&q, RCODE_NOERROR, &addrs, 5);
        assert!(a.len() <= MAX_UDP);
        assert_eq!(a[2] & 0x02, 0x02, "TC set");
        let n = u16::from_be_bytes([a[6], a[7]]) as usize;
        assert!(n > 0 && n < 200);
    }
}
