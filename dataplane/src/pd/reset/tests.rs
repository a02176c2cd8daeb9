//! The pure parts of the in-place reset: the decision and the proof.

use tandem_contract::MemberRole;
use tandem_contract::reset::proof_message;

use super::*;

#[test]
fn older_is_stale_same_is_a_noop_newer_resets_and_draining_wins() {
    assert_eq!(decide(7, 6, false), Decision::Stale);
    assert_eq!(decide(7, 0, false), Decision::Stale);
    assert_eq!(decide(7, 7, false), Decision::Noop);
    assert_eq!(decide(7, 8, false), Decision::Reset);
    assert_eq!(decide(7, 1000, false), Decision::Reset);
    assert_eq!(decide(0, 0, false), Decision::Noop);
    assert_eq!(decide(u64::MAX, u64::MAX, false), Decision::Noop);
    for asked in [6, 7, 8] {
        assert_eq!(decide(7, asked, true), Decision::Draining);
    }
}

#[test]
fn outcome_labels_are_distinct_and_stable() {
    let labels: Vec<&str> = Outcome::ALL.iter().map(|o| o.label()).collect();
    assert_eq!(
        labels,
        [
            "done",
            "noop",
            "incomplete",
            "stale",
            "unauthorized",
            "draining",
            "failed"
        ]
    );
}

fn key() -> GroupKey {
    GroupKey::new(b"the-group-key".to_vec())
}

fn header(proof: &str) -> Vec<u8> {
    format!("Tandem-Reset {proof}").into_bytes()
}

#[test]
fn the_proof_is_the_lowercase_hex_hmac_of_the_contract_message() {
    // Computed independently of `proof`: HMAC-SHA256 over the contract's message.
    use hmac::{Hmac, Mac};
    let mut m = Hmac::<sha2::Sha256>::new_from_slice(b"the-group-key").unwrap();
    m.update(proof_message(MemberRole::Decode, 8).as_bytes());
    let want = hex::encode(m.finalize().into_bytes());
    assert_eq!(proof(&key(), MemberRole::Decode, 8), want);
    assert_eq!(want.len(), 64);
    assert_eq!(want, want.to_lowercase());
    assert_eq!(
        check_authorization(Some(&header(&want)), &key(), MemberRole::Decode, 8),
        Ok(())
    );
}

#[test]
fn a_proof_of_another_key_role_or_incarnation_is_wrong() {
    let good = proof(&key(), MemberRole::Prefill, 8);
    let check = |h: &[u8], role, n| check_authorization(Some(h), &key(), role, n);
    assert_eq!(check(&header(&good), MemberRole::Prefill, 8), Ok(()));
    // Another key.
    let other = proof(
        &GroupKey::new(b"another-key".to_vec()),
        MemberRole::Prefill,
        8,
    );
    assert_eq!(
        check(&header(&other), MemberRole::Prefill, 8),
        Err(ProofError::Wrong)
    );
    // The same key, for the other role: a prefill's proof does not reset the decode.
    assert_eq!(
        check(&header(&good), MemberRole::Decode, 8),
        Err(ProofError::Wrong)
    );
    // Another incarnation: a proof seen on the wire only repeats its own reset.
    assert_eq!(
        check(&header(&good), MemberRole::Prefill, 9),
        Err(ProofError::Wrong)
    );
    assert_eq!(
        check(&header(&good), MemberRole::Prefill, 7),
        Err(ProofError::Wrong)
    );
    // One bit off.
    let mut flipped = good.clone().into_bytes();
    flipped[10] = if flipped[10] == b'0' { b'1' } else { b'0' };
    let flipped = String::from_utf8(flipped).unwrap();
    assert_eq!(
        check(&header(&flipped), MemberRole::Prefill, 8),
        Err(ProofError::Wrong)
    );
}

#[test]
fn missing_and_malformed_headers_are_refused_without_quoting_them() {
    let good = proof(&key(), MemberRole::Decode, 3);
    assert_eq!(
        check_authorization(None, &key(), MemberRole::Decode, 3),
        Err(ProofError::Missing)
    );
    let malformed: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"Tandem-Reset".to_vec(),
        b"Tandem-Reset ".to_vec(),
        format!("Bearer {good}").into_bytes(),
        format!("Basic {good}").into_bytes(),
        format!("Tandem-Reset {}", &good[..63]).into_bytes(),
        format!("Tandem-Reset {good}0").into_bytes(),
        format!("Tandem-Reset {}zz", &good[..62]).into_bytes(),
        format!("Tandem-Reset{good}").into_bytes(),
        vec![0xff, 0xfe, b' ', b'a'],
    ];
    for h in &malformed {
        assert_eq!(
            check_authorization(Some(h), &key(), MemberRole::Decode, 3),
            Err(ProofError::Malformed),
            "{:?}",
            String::from_utf8_lossy(h)
        );
    }
    // The scheme's case does not matter (HTTP auth schemes are case-insensitive).
    let lower = format!("tandem-reset {good}").into_bytes();
    assert_eq!(
        check_authorization(Some(&lower), &key(), MemberRole::Decode, 3),
        Ok(())
    );
    for e in [
        ProofError::Missing,
        ProofError::Malformed,
        ProofError::Wrong,
    ] {
        assert!(!e.message().contains(&good), "{}", e.message());
    }
}
