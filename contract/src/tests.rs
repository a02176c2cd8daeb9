use proptest::prelude::*;

use super::*;

fn member(role: MemberRole) -> MemberSettings {
    MemberSettings {
        role,
        model: "/models/m.gguf".into(),
        served_model_name: "smol".into(),
        host: None,
        port: 8000,
        kv_port: 5600,
        prefill_peers: match role {
            MemberRole::Prefill => vec![],
            MemberRole::Decode => vec!["p0.g:5600".into(), "p1.g:5600".into()],
        },
        group_incarnation: 3,
        probe_period_seconds: 2,
        failure_threshold: 3,
        bootstrap_timeout_seconds: 10,
        kv_timeout_seconds: 30,
        channel_deadline_ms: 1000,
        no_progress_seconds: 30,
    }
}

/// The `--flag=value` arguments of a command line as (flag, value).
fn pairs(args: &[String]) -> Vec<(&str, &str)> {
    args.iter()
        .map(|a| {
            let a = a.strip_prefix("--").expect("a flag");
            a.split_once('=').expect("--flag=value")
        })
        .collect()
}

#[test]
fn every_setting_goes_once_and_the_key_never_on_the_command_line() {
    for role in [MemberRole::Prefill, MemberRole::Decode] {
        let mut m = member(role);
        m.host = Some("127.0.0.1".into());
        let args = m.to_args();
        let p = pairs(&args);
        let flags: Vec<&str> = p.iter().map(|(f, _)| *f).collect();
        for s in settings::ALL {
            let n = flags.iter().filter(|f| **f == s.flag).count();
            let want = match *s {
                settings::GROUP_KEY => 0,
                settings::PREFILL if role == MemberRole::Prefill => 0,
                _ => 1,
            };
            assert_eq!(n, want, "{} in {args:?}", s.flag);
        }
        assert!(p.contains(&("role", role.as_str())));
        assert!(p.contains(&("group-incarnation", "3")));
    }
    let d = member(MemberRole::Decode).to_args();
    assert!(pairs(&d).contains(&("prefill", "p0.g:5600,p1.g:5600")));
    assert!(
        !pairs(&member(MemberRole::Prefill).to_args())
            .iter()
            .any(|(f, _)| *f == "host"),
        "no --host unless one is given"
    );
}

#[test]
fn the_reserved_flags_are_every_rendered_flag_and_check_config() {
    let reserved = settings::reserved();
    let mut m = member(MemberRole::Decode);
    m.host = Some("::1".into());
    for (flag, _) in pairs(&m.to_args()) {
        assert!(reserved.contains(&format!("--{flag}")), "{flag}");
    }
    assert!(reserved.contains(&"--check-config".to_string()));
    assert!(!reserved.contains(&"--group-key".to_string()));
}

#[test]
fn names_are_distinct_and_spelled_as_flags_and_variables() {
    for (i, a) in settings::ALL.iter().enumerate() {
        assert!(
            a.flag.bytes().all(|b| b.is_ascii_lowercase() || b == b'-'),
            "{}",
            a.flag
        );
        assert!(a.env.starts_with("TANDEM_"), "{}", a.env);
        for b in &settings::ALL[i + 1..] {
            assert_ne!(a.flag, b.flag);
            assert_ne!(a.env, b.env);
        }
    }
    assert_eq!(settings::GROUP_KEY.env, GROUP_KEY_ENV);
}

proptest! {
    /// Whatever the values, every argument is one known flag with its value, so no value
    /// can be read as another setting.
    #[test]
    fn a_command_line_is_one_argument_per_setting(
        model in "[a-z/._=-]{1,40}",
        name in "[a-z0-9._=-]{1,20}",
        port in 1u16..,
        kv_port in 1u16..,
        peers in proptest::collection::vec("[a-z0-9.-]{1,20}:[0-9]{1,5}", 1..4),
        incarnation in any::<u64>(),
        t in (1u32.., 1u32.., 1u32.., 1u32.., 1u32.., 0u32..),
        decode in any::<bool>(),
    ) {
        let role = if decode { MemberRole::Decode } else { MemberRole::Prefill };
        let m = MemberSettings {
            role,
            model: format!("/{model}"),
            served_model_name: name,
            host: None,
            port,
            kv_port,
            prefill_peers: if decode { peers } else { vec![] },
            group_incarnation: incarnation,
            probe_period_seconds: t.0,
            failure_threshold: t.1,
            bootstrap_timeout_seconds: t.2,
            kv_timeout_seconds: t.3,
            channel_deadline_ms: t.4,
            no_progress_seconds: t.5,
        };
        let args = m.to_args();
        let p = pairs(&args);
        for (flag, _) in &p {
            prop_assert!(settings::ALL.iter().any(|s| s.flag == *flag));
        }
        prop_assert!(p.contains(&("model", m.model.as_str())));
        prop_assert!(p.contains(&("served-model-name", m.served_model_name.as_str())));
    }
}

#[test]
fn a_reset_proof_names_the_role_and_the_incarnation() {
    let p = reset::proof_message(MemberRole::Prefill, 7);
    assert_eq!(p, "tandem-reset/v1 prefill 7");
    assert_ne!(p, reset::proof_message(MemberRole::Decode, 7));
    assert_ne!(p, reset::proof_message(MemberRole::Prefill, 8));
}

mod api_keys {
    use crate::api_keys::{ApiKeys, Refusal};

    #[test]
    fn without_keys_everything_passes() {
        let k = ApiKeys::none();
        assert_eq!(k.check(None), Ok(()));
        assert_eq!(k.check(Some(b"Bearer anything")), Ok(()));
    }

    #[test]
    fn a_bearer_key_from_the_flag_or_the_file_passes_and_others_are_refused() {
        let k = ApiKeys::from_parts(
            Some("sk-flag"),
            Some(("keys.txt", "# team keys\n\nsk-one\n  sk-two  \n")),
        )
        .unwrap();
        assert_eq!(k.len(), 3);
        for good in ["Bearer sk-flag", "bearer sk-one", "BEARER   sk-two"] {
            assert_eq!(k.check(Some(good.as_bytes())), Ok(()), "{good}");
        }
        assert_eq!(k.check(None), Err(Refusal::Missing));
        assert_eq!(k.check(Some(b"Basic c2stb25l")), Err(Refusal::NotBearer));
        assert_eq!(k.check(Some(b"Bearer ")), Err(Refusal::NotBearer));
        assert_eq!(k.check(Some(b"sk-one")), Err(Refusal::NotBearer));
        for bad in [
            "Bearer sk-on",
            "Bearer sk-onee",
            "Bearer sk-one2",
            "Bearer SK-ONE",
        ] {
            assert_eq!(
                k.check(Some(bad.as_bytes())),
                Err(Refusal::Invalid),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_bad_key_or_an_empty_file_is_an_error_that_names_the_line_but_never_the_key() {
        let e = ApiKeys::from_parts(None, Some(("k.txt", "ok-key\nbad key\n"))).unwrap_err();
        assert!(e.0.contains("k.txt line 2"), "{e}");
        assert!(!e.0.contains("bad key"), "{e}");
        let e = ApiKeys::from_parts(None, Some(("k.txt", "# none\n"))).unwrap_err();
        assert!(e.0.contains("no key"), "{e}");
        assert!(ApiKeys::from_parts(Some(" "), None).is_err());
        assert_eq!(
            format!("{:?}", ApiKeys::from_parts(Some("secret"), None).unwrap()),
            "ApiKeys(1 key(s))"
        );
    }

    #[test]
    fn the_refusal_bodies_are_openai_errors() {
        for r in [Refusal::Missing, Refusal::NotBearer, Refusal::Invalid] {
            assert!(!r.message().contains(['"', '\\']));
            let b = r.body();
            assert!(
                b.starts_with(r#"{"error":{"message":""#)
                    && b.contains(r#""type":"invalid_request_error""#)
                    && b.ends_with(&format!(r#""code":"{}"}}}}"#, r.code())),
                "{b}"
            );
        }
    }
}
