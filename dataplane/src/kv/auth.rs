//! Handshake: compatibility checks (version, model, KV layout, group incarnation: refused
//! with the reason) and mutual challenge-response authentication with the group key (the
//! key never crosses the wire). Pure functions over message values;
//! the transport keeps the per-peer state and does the sending.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::PROTOCOL_VERSION;
use super::message::{KvLayout, Message, RejectReason};

type HmacSha256 = Hmac<Sha256>;

/// The shared group secret. Debug output never shows it.
#[derive(Clone)]
pub struct GroupKey(Vec<u8>);

impl GroupKey {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// HMAC-SHA256 of `message` with this key (the proof of an in-place reset call).
    pub fn sign_message(&self, message: &[u8]) -> [u8; 32] {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(message);
        m.finalize().into_bytes().into()
    }

    /// Whether `mac` is the HMAC-SHA256 of `message` with this key, compared in constant
    /// time.
    pub fn verify_message(&self, message: &[u8], mac: &[u8]) -> bool {
        let mut m = HmacSha256::new_from_slice(&self.0).expect("HMAC takes any key length");
        m.update(message);
        m.verify_slice(mac).is_ok()
    }
}

impl std::fmt::Debug for GroupKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GroupKey(<{} bytes>)", self.0.len())
    }
}

/// What a process claims about itself in the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalIdentity {
    pub incarnation: u64,
    pub group_incarnation: u64,
    pub fingerprint: String,
    pub layout: KvLayout,
}

/// The facts both MACs cover: a MAC from one session never verifies in another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transcript {
    pub decode_nonce: [u8; 32],
    pub prefill_nonce: [u8; 32],
    pub decode_incarnation: u64,
    pub prefill_incarnation: u64,
    pub group_incarnation: u64,
}

const PREFILL_LABEL: &[u8] = b"tandem-kv/1 prefill";
const DECODE_LABEL: &[u8] = b"tandem-kv/1 decode";

fn mac_for(key: &GroupKey, label: &[u8], t: &Transcript) -> HmacSha256 {
    // HMAC accepts keys of any length, so `new_from_slice` cannot fail.
    let mut m = HmacSha256::new_from_slice(&key.0).expect("HMAC takes any key length");
    m.update(label);
    m.update(&t.decode_nonce);
    m.update(&t.prefill_nonce);
    m.update(&t.decode_incarnation.to_le_bytes());
    m.update(&t.prefill_incarnation.to_le_bytes());
    m.update(&t.group_incarnation.to_le_bytes());
    m
}

fn sign(key: &GroupKey, label: &[u8], t: &Transcript) -> [u8; 32] {
    mac_for(key, label, t).finalize().into_bytes().into()
}

/// Constant-time check (the `hmac` crate compares in constant time).
fn verify(key: &GroupKey, label: &[u8], t: &Transcript, mac: &[u8; 32]) -> bool {
    mac_for(key, label, t).verify_slice(mac).is_ok()
}

/// Whether a peer may talk to us at all; the first mismatch found is the reason.
pub fn compatible(
    local: &LocalIdentity,
    version: u16,
    group_incarnation: u64,
    fingerprint: &str,
    layout: &KvLayout,
) -> Result<(), (RejectReason, String)> {
    if version != PROTOCOL_VERSION {
        return Err((
            RejectReason::VersionMismatch,
            format!("protocol version {version}, expected {PROTOCOL_VERSION}"),
        ));
    }
    if group_incarnation != local.group_incarnation {
        return Err((
            RejectReason::IncarnationMismatch,
            format!(
                "group incarnation {group_incarnation}, expected {}",
                local.group_incarnation
            ),
        ));
    }
    if fingerprint != local.fingerprint {
        return Err((
            RejectReason::ModelMismatch,
            format!(
                "model fingerprint {fingerprint}, expected {}",
                local.fingerprint
            ),
        ));
    }
    if *layout != local.layout {
        return Err((
            RejectReason::LayoutMismatch,
            format!("KV layout {layout:?}, expected {:?}", local.layout),
        ));
    }
    Ok(())
}

/// Decode side of one handshake attempt.
#[derive(Debug, Clone)]
pub struct Initiator {
    pub nonce: [u8; 32],
}

/// The decode's view of an authenticated prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerAuthenticated {
    pub peer_incarnation: u64,
}

impl Initiator {
    pub fn new(nonce: [u8; 32]) -> Self {
        Self { nonce }
    }

    pub fn hello(&self, local: &LocalIdentity) -> Message {
        Message::Hello {
            fingerprint: local.fingerprint.clone(),
            layout: local.layout,
            nonce: self.nonce,
        }
    }

    /// Check a WELCOME: compatible, and the prefill proved the key. On success the reply
    /// is the AUTH message proving ours.
    pub fn on_welcome(
        &self,
        local: &LocalIdentity,
        key: &GroupKey,
        peer_incarnation: u64,
        peer_group_incarnation: u64,
        welcome: &Message,
    ) -> Result<(Message, PeerAuthenticated), (RejectReason, String)> {
        let Message::Welcome {
            fingerprint,
            layout,
            nonce,
            mac,
        } = welcome
        else {
            return Err((RejectReason::Malformed, "expected WELCOME".into()));
        };
        compatible(
            local,
            PROTOCOL_VERSION,
            peer_group_incarnation,
            fingerprint,
            layout,
        )?;
        let t = Transcript {
            decode_nonce: self.nonce,
            prefill_nonce: *nonce,
            decode_incarnation: local.incarnation,
            prefill_incarnation: peer_incarnation,
            group_incarnation: local.group_incarnation,
        };
        if !verify(key, PREFILL_LABEL, &t, mac) {
            return Err((
                RejectReason::AuthFailed,
                "the prefill's proof of the group key does not verify".into(),
            ));
        }
        Ok((
            Message::Auth {
                mac: sign(key, DECODE_LABEL, &t),
            },
            PeerAuthenticated { peer_incarnation },
        ))
    }
}

/// Prefill side: a HELLO answered with WELCOME, waiting for the decode's AUTH.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    pub transcript: Transcript,
}

/// Answer a HELLO: refuse an incompatible peer, or challenge it with our nonce and prove
/// the key ourselves.
pub fn respond_hello(
    local: &LocalIdentity,
    key: &GroupKey,
    version: u16,
    peer_incarnation: u64,
    peer_group_incarnation: u64,
    hello: &Message,
    our_nonce: [u8; 32],
) -> Result<(Message, Pending), (RejectReason, String)> {
    let Message::Hello {
        fingerprint,
        layout,
        nonce,
    } = hello
    else {
        return Err((RejectReason::Malformed, "expected HELLO".into()));
    };
    compatible(local, version, peer_group_incarnation, fingerprint, layout)?;
    let t = Transcript {
        decode_nonce: *nonce,
        prefill_nonce: our_nonce,
        decode_incarnation: peer_incarnation,
        prefill_incarnation: local.incarnation,
        group_incarnation: local.group_incarnation,
    };
    let welcome = Message::Welcome {
        fingerprint: local.fingerprint.clone(),
        layout: local.layout,
        nonce: our_nonce,
        mac: sign(key, PREFILL_LABEL, &t),
    };
    Ok((welcome, Pending { transcript: t }))
}

/// Check the decode's AUTH against the pending challenge. `peer_incarnation` is the one in
/// the AUTH's header; it must be the one the HELLO announced.
pub fn check_auth(
    key: &GroupKey,
    pending: &Pending,
    peer_incarnation: u64,
    auth: &Message,
) -> Result<(), (RejectReason, String)> {
    let Message::Auth { mac } = auth else {
        return Err((RejectReason::Malformed, "expected AUTH".into()));
    };
    if peer_incarnation != pending.transcript.decode_incarnation {
        return Err((
            RejectReason::IncarnationMismatch,
            "AUTH from another incarnation than the HELLO".into(),
        ));
    }
    if !verify(key, DECODE_LABEL, &pending.transcript, mac) {
        return Err((
            RejectReason::AuthFailed,
            "the decode's proof of the group key does not verify".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident(inc: u64) -> LocalIdentity {
        LocalIdentity {
            incarnation: inc,
            group_incarnation: 7,
            fingerprint: "abc".into(),
            layout: KvLayout {
                dtype: 1,
                layers: 30,
                kv_heads: 3,
                head_dim: 64,
                block_size: 16,
            },
        }
    }

    /// Runs a full handshake; returns what each side concluded.
    fn handshake(
        d: &LocalIdentity,
        dkey: &GroupKey,
        p: &LocalIdentity,
        pkey: &GroupKey,
        version: u16,
    ) -> Result<(), (RejectReason, String)> {
        let init = Initiator::new([1; 32]);
        let hello = init.hello(d);
        let (welcome, pending) = respond_hello(
            p,
            pkey,
            version,
            d.incarnation,
            d.group_incarnation,
            &hello,
            [2; 32],
        )?;
        let (auth, peer) =
            init.on_welcome(d, dkey, p.incarnation, p.group_incarnation, &welcome)?;
        assert_eq!(peer.peer_incarnation, p.incarnation);
        check_auth(pkey, &pending, d.incarnation, &auth)
    }

    #[test]
    fn good_key_authenticates_both_sides() {
        let k = GroupKey::new(*b"secret");
        assert_eq!(
            handshake(&ident(1), &k, &ident(2), &k, PROTOCOL_VERSION),
            Ok(())
        );
    }

    #[test]
    fn wrong_key_is_auth_failed_on_either_side() {
        let (a, b) = (GroupKey::new(*b"secret"), GroupKey::new(*b"other"));
        // The decode detects the prefill's bad proof first.
        let e = handshake(&ident(1), &a, &ident(2), &b, PROTOCOL_VERSION).unwrap_err();
        assert_eq!(e.0, RejectReason::AuthFailed);
        // A decode that skips checking and forges an AUTH is caught by the prefill.
        let d = ident(1);
        let p = ident(2);
        let hello = Initiator::new([1; 32]).hello(&d);
        let (_, pending) = respond_hello(&p, &a, PROTOCOL_VERSION, 1, 7, &hello, [2; 32]).unwrap();
        let forged = Message::Auth { mac: [0; 32] };
        assert_eq!(
            check_auth(&a, &pending, 1, &forged).unwrap_err().0,
            RejectReason::AuthFailed
        );
        // A valid AUTH replayed under another incarnation is refused too.
        let t = pending.transcript;
        let good = Message::Auth {
            mac: sign(&a, DECODE_LABEL, &t),
        };
        assert_eq!(check_auth(&a, &pending, 1, &good), Ok(()));
        assert_eq!(
            check_auth(&a, &pending, 99, &good).unwrap_err().0,
            RejectReason::IncarnationMismatch
        );
        // The prefill's own MAC is not accepted as the decode's.
        let as_prefill = Message::Auth {
            mac: sign(&a, PREFILL_LABEL, &t),
        };
        assert_eq!(
            check_auth(&a, &pending, 1, &as_prefill).unwrap_err().0,
            RejectReason::AuthFailed
        );
    }

    #[test]
    fn incompatible_peers_are_refused_with_the_reason() {
        let k = GroupKey::new(*b"k");
        let mut other_group = ident(2);
        other_group.group_incarnation = 8;
        let mut other_model = ident(2);
        other_model.fingerprint = "def".into();
        let mut other_layout = ident(2);
        other_layout.layout.block_size = 32;
        let cases = [
            (
                other_group,
                PROTOCOL_VERSION,
                RejectReason::IncarnationMismatch,
            ),
            (other_model, PROTOCOL_VERSION, RejectReason::ModelMismatch),
            (other_layout, PROTOCOL_VERSION, RejectReason::LayoutMismatch),
            (
                ident(2),
                PROTOCOL_VERSION + 1,
                RejectReason::VersionMismatch,
            ),
        ];
        for (p, v, want) in cases {
            let e = handshake(&ident(1), &k, &p, &k, v).unwrap_err();
            assert_eq!(e.0, want, "{}", e.1);
        }
    }

    #[test]
    fn key_is_not_in_debug_output_or_messages() {
        let k = GroupKey::new(*b"supersecretkey");
        assert!(!format!("{k:?}").contains("supersecret"));
        let hello = Initiator::new([3; 32]).hello(&ident(1));
        let (welcome, _) =
            respond_hello(&ident(2), &k, PROTOCOL_VERSION, 1, 7, &hello, [4; 32]).unwrap();
        let frames = super::super::encode(&super::super::Envelope {
            incarnation: 2,
            group_incarnation: 7,
            room: 0,
            msg: welcome,
        });
        let bytes = [frames[0].clone(), frames[1].clone()].concat();
        assert!(!bytes.windows(14).any(|w| w == b"supersecretkey"));
    }
}
