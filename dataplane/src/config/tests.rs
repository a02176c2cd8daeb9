use super::values::on_off;
use super::*;

#[test]
fn parses_flags_and_defaults() {
    let c = Config::try_parse_from([
        "x",
        "--model",
        "/m/SmolLM2.Q4_1.gguf",
        "--port",
        "9000",
        "--chunk-size",
        "64",
    ])
    .unwrap();
    assert_eq!(
        (c.role, c.http.port, c.engine.chunk_size),
        (Role::Both, 9000, 64)
    );
    assert_eq!(c.served_name(), "SmolLM2.Q4_1");
    assert_eq!(c.scheduler().chunk_size, 64);
    assert!(Config::try_parse_from(["x", "--model", "m", "--role", "sideways"]).is_err());
    assert!(
        Config::try_parse_from(["x"]).is_err(),
        "--model is required"
    );
}

#[test]
fn parses_pd_flags_as_the_operator_passes_them() {
    let c = Config::try_parse_from([
        "x",
        "--role",
        "decode",
        "--model",
        "m.gguf",
        "--served-model-name",
        "smol",
        "--port",
        "8000",
        "--kv-port",
        "6000",
        "--prefill",
        "p0.g:6000,p1.g:6000",
        "--probe-period-seconds",
        "1",
        "--failure-threshold",
        "2",
    ])
    .unwrap();
    assert_eq!(c.role, Role::Decode);
    assert_eq!(c.engine.kv_dtype, KvDtype::F16, "the default KV dtype");
    assert_eq!(c.kv.prefill_peers, ["p0.g:6000", "p1.g:6000"]);
    assert_eq!(c.kv.kv_port, 6000);
    let t = c.pd_timings();
    assert_eq!(t.liveness_window(), Duration::from_secs(2));
    // 2 x liveness window (4 s) is below the 10 s bootstrap timeout, which wins.
    assert_eq!(t.session_expiry(), Duration::from_secs(10));
    let short = PdTimings {
        bootstrap_timeout: Duration::from_secs(1),
        ..t
    };
    assert_eq!(short.session_expiry(), Duration::from_secs(4));
    // The channel deadline: 1 s by default, PINGed every quarter of it (the probe period
    // bounds the heartbeat of a long deadline).
    assert_eq!(t.channel_deadline, Duration::from_secs(1));
    assert_eq!(t.channel_heartbeat(), Duration::from_millis(250));
    let long = PdTimings {
        channel_deadline: Duration::from_secs(60),
        ..t
    };
    assert_eq!(long.channel_heartbeat(), t.probe_period);
}

/// A file that starts like a GGUF file, removed on drop.
struct FakeModel(PathBuf);

impl FakeModel {
    fn new(name: &str, content: &[u8]) -> Self {
        let p =
            std::env::temp_dir().join(format!("tandem-config-test-{}-{name}", std::process::id()));
        std::fs::write(&p, content).unwrap();
        Self(p)
    }
    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for FakeModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn check_refuses_what_would_fail_at_start_naming_the_setting() {
    let tiny = crate::model::synthetic::TinyLlama::default().to_bytes();
    let gguf = FakeModel::new("ok.gguf", &tiny);
    let text = FakeModel::new("text.gguf", b"hello");
    let check = |args: &[&str]| {
        let mut all = vec!["x"];
        all.extend_from_slice(args);
        Config::try_parse_from(all)
            .unwrap()
            .check()
            .map_err(|e| e.to_string())
    };
    let m = gguf.path();
    check(&["--model", m]).unwrap();
    check(&["--model", m, "--role", "prefill", "--group-key", "k"]).unwrap();
    check(&[
        "--model",
        m,
        "--role",
        "decode",
        "--group-key",
        "k",
        "--prefill",
        "p-0.g.ns.svc:5600,10.0.0.1:1",
    ])
    .unwrap();
    for (args, want) in [
        (
            vec!["--model", m, "--role", "decode", "--prefill", "p:1"],
            "configuration --group-key: role 'decode' needs a group key",
        ),
        (
            vec!["--model", m, "--role", "decode", "--group-key", "k"],
            "configuration --prefill: role decode needs at least one --prefill address",
        ),
        (
            vec![
                "--model",
                m,
                "--role",
                "decode",
                "--group-key",
                "k",
                "--prefill",
                "p",
            ],
            "configuration --prefill: \"p\": expected host:port",
        ),
        (
            vec![
                "--model",
                m,
                "--role",
                "decode",
                "--group-key",
                "k",
                "--prefill",
                "p:0",
            ],
            "configuration --prefill: \"p:0\": the port must be a number from 1 to 65535",
        ),
        (
            vec![
                "--model",
                m,
                "--role",
                "decode",
                "--group-key",
                "k",
                "--prefill",
                ":5600",
            ],
            "configuration --prefill: \":5600\": expected host:port with a host name or address",
        ),
        (
            vec!["--model", "/nonexistent/m.gguf"],
            "I/O error on /nonexistent/m.gguf: No such file or directory",
        ),
        (vec!["--model", text.path()], "is not a GGUF file"),
        (
            vec!["--model", m, "--fault-injection"],
            "configuration --fault-injection: for tests only",
        ),
    ] {
        let e = check(&args).expect_err(&format!("{args:?} must be refused"));
        assert!(e.contains(want), "{args:?}: {e}");
    }
    if !cfg!(feature = "cuda") {
        let e = check(&["--model", m, "--device", "cuda"]).unwrap_err();
        assert!(e.contains("built without CUDA support"), "{e}");
    }
}

#[test]
fn the_effective_configuration_has_every_setting_and_no_key() {
    let c = Config::try_parse_from([
        "x",
        "--model",
        "/m/SmolLM2.Q4_1.gguf",
        "--role",
        "decode",
        "--prefill",
        "a:1,b:2",
        "--group-key",
        "s3cret",
        "--kv-dtype",
        "q8_0",
        "--probe-period-seconds",
        "0.5",
        "--failure-threshold",
        "4",
        "--device",
        "cuda:1",
    ])
    .unwrap();
    let v = c.effective();
    let cfg = &v["config"];
    assert_eq!(cfg["role"], "decode");
    assert_eq!(cfg["model"], "/m/SmolLM2.Q4_1.gguf");
    assert_eq!(cfg["prefill_peers"], json!(["a:1", "b:2"]));
    assert_eq!(cfg["kv_dtype"], "q8_0");
    assert_eq!(cfg["device"], "cuda:1");
    assert_eq!(cfg["port"], 8000);
    assert_eq!(cfg["group_key"], "<redacted: 6 bytes>");
    assert!(!v.to_string().contains("s3cret"), "{v}");
    assert!(cfg.get("check_config").is_none());
    assert_eq!(v["derived"]["served_model_name"], "SmolLM2.Q4_1");
    assert_eq!(v["derived"]["liveness_window_seconds"], 2.0);
    // Every flag is there: one key per argument clap knows, less `--check-config`.
    use clap::CommandFactory;
    let flags = Config::command()
        .get_arguments()
        .filter(|a| a.get_long().is_some_and(|l| l != "check-config"))
        .count();
    assert_eq!(cfg.as_object().unwrap().len(), flags, "{cfg}");
}

#[test]
fn bad_numbers_are_rejected_by_name_not_clamped() {
    let err = |flag: &str, value: &str| {
        // `--flag=value`, so that a negative number is not taken for a flag.
        Config::try_parse_from(["x", "--model", "m.gguf", &format!("{flag}={value}")])
            .expect_err(&format!("{flag} {value} must be refused"))
            .to_string()
    };
    for (flag, value) in [
        ("--max-batch", "0"),
        ("--kv-blocks", "0"),
        ("--chunk-size", "0"),
        ("--max-waiting", "0"),
        ("--default-max-tokens", "0"),
        ("--failure-threshold", "0"),
        ("--probe-period-seconds", "0"),
        ("--kv-timeout-seconds", "-1"),
        ("--bootstrap-timeout-seconds", "NaN"),
        ("--queue-timeout-seconds", "inf"),
        ("--engine-stall-seconds", "soon"),
        ("--no-progress-seconds", "86401"),
        ("--drain-seconds", "-0.5"),
    ] {
        let e = err(flag, value);
        assert!(e.contains(flag), "the error names {flag}: {e}");
    }
    let c = Config::try_parse_from([
        "x",
        "--model",
        "m.gguf",
        "--drain-seconds",
        "0",
        "--probe-period-seconds",
        "0.25",
    ])
    .unwrap();
    assert_eq!(c.drain(), Duration::ZERO);
    assert_eq!(c.pd_timings().probe_period, Duration::from_millis(250));
}

#[test]
fn device_is_parsed_in_one_place() {
    let dev = |v: &str| Config::try_parse_from(["x", "--model", "m.gguf", "--device", v]);
    assert_eq!(dev("cpu").unwrap().model.device, Device::Cpu);
    assert_eq!(dev("cuda").unwrap().model.device, Device::Cuda(0));
    assert_eq!(dev("cuda:3").unwrap().model.device, Device::Cuda(3));
    assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
    for bad in ["gpu", "cuda:x", "cuda:", "tpu"] {
        let err = dev(bad).unwrap_err().to_string();
        assert!(
            err.contains("--device") && err.contains("use cpu, cuda or cuda:N"),
            "{bad}: {err}"
        );
    }
    let c = Config::try_parse_from(["x", "--model", "m.gguf"]).unwrap();
    assert_eq!(c.model.device, Device::Cpu, "the default");
}

#[test]
fn backend_knobs_are_flags_passed_down() {
    let c = Config::try_parse_from(["x", "--model", "m.gguf"]).unwrap();
    assert_eq!(c.cpu_options(), CpuOptions::default());
    assert!(
        c.model.cuda_sampling && !c.model.cuda_graphs,
        "graphs off until checked on a GPU"
    );
    let c = Config::try_parse_from([
        "x",
        "--model",
        "m.gguf",
        "--threads",
        "3",
        "--no-simd",
        "--cuda-sampling",
        "off",
        "--cuda-graphs",
        "on",
    ])
    .unwrap();
    assert_eq!(
        c.cpu_options(),
        CpuOptions {
            threads: Some(3),
            simd: false
        }
    );
    assert!(!c.model.cuda_sampling && c.model.cuda_graphs);
    for (flag, value) in [
        ("--threads", "0"),
        ("--threads", "many"),
        ("--cuda-graphs", "maybe"),
        ("--cuda-sampling", "2"),
    ] {
        let err = Config::try_parse_from(["x", "--model", "m.gguf", flag, value])
            .unwrap_err()
            .to_string();
        assert!(err.contains(flag) && err.contains(value), "{err}");
    }
    assert_eq!(on_off(" Yes "), Ok(true));
    assert_eq!(on_off("0"), Ok(false));
}

#[test]
fn kv_dtype_is_chosen_by_flag_and_bad_values_are_named() {
    let c = Config::try_parse_from(["x", "--model", "m.gguf", "--kv-dtype", "q8_0"]).unwrap();
    assert_eq!(c.engine.kv_dtype, KvDtype::Q8_0);
    assert_eq!(c.engine.kv_dtype.ggml(), tandem_kernels::GgmlType::Q8_0);
    let err = Config::try_parse_from(["x", "--model", "m.gguf", "--kv-dtype", "q4"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("--kv-dtype") && err.contains("q4"), "{err}");
    assert!(
        err.contains("q8_0"),
        "the error lists the valid values: {err}"
    );
}

#[test]
fn the_prefix_cache_is_on_unless_turned_off() {
    let parse = |args: &[&str]| {
        let mut v = vec!["x", "--model", "m.gguf"];
        v.extend_from_slice(args);
        Config::try_parse_from(v).unwrap().engine.no_prefix_cache
    };
    assert!(!parse(&[]));
    assert!(parse(&["--no-prefix-cache"]));
}

mod contract {
    use std::collections::HashMap;
    use std::ffi::OsString;

    use proptest::prelude::*;
    use tandem_contract::{MemberRole, MemberSettings, settings};

    use super::super::*;

    fn parse(args: &[String]) -> Config {
        let mut all = vec!["tandem-dataplane".to_string()];
        all.extend_from_slice(args);
        Config::try_parse_from(all).unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    fn member() -> impl Strategy<Value = MemberSettings> {
        (
            any::<bool>(),
            "/[a-z0-9_./=-]{1,40}",
            "[a-zA-Z0-9_.:=-]{1,30}",
            proptest::option::of(prop_oneof![
                Just("127.0.0.1".to_string()),
                Just("::1".to_string()),
                "[a-z]{1,10}\\.local",
            ]),
            (1u16.., 1u16..),
            proptest::collection::vec(
                "[a-z0-9-]{1,12}(\\.[a-z0-9-]{1,12}){0,3}:[1-9][0-9]{0,3}",
                1..4,
            ),
            any::<u64>(),
            (
                1u32..=3600,
                1u32..=100,
                1u32..=3600,
                1u32..=3600,
                50u32..=3_600_000,
                0u32..=86_400,
            ),
        )
            .prop_map(
                |(decode, model, name, host, (port, kv_port), peers, inc, t)| MemberSettings {
                    role: if decode {
                        MemberRole::Decode
                    } else {
                        MemberRole::Prefill
                    },
                    model,
                    served_model_name: name,
                    host,
                    port,
                    kv_port,
                    prefill_peers: if decode { peers } else { Vec::new() },
                    group_incarnation: inc,
                    probe_period_seconds: t.0,
                    failure_threshold: t.1,
                    bootstrap_timeout_seconds: t.2,
                    kv_timeout_seconds: t.3,
                    channel_deadline_ms: t.4,
                    no_progress_seconds: t.5,
                },
            )
    }

    proptest! {
        /// What the operator renders is what the dataplane reads: parse(render(s)) == s.
        #[test]
        fn the_dataplane_reads_back_what_the_operator_renders(m in member()) {
            let c = parse(&m.to_args());
            prop_assert_eq!(c.member_settings(), Ok(m));
        }
    }

    #[test]
    fn every_contract_setting_is_a_flag_of_the_dataplane_with_its_variable() {
        use clap::CommandFactory;
        let cmd = Config::command();
        for s in settings::ALL {
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_long() == Some(s.flag))
                .unwrap_or_else(|| panic!("--{} is not a dataplane flag", s.flag));
            assert_eq!(
                arg.get_env().and_then(|e| e.to_str()),
                Some(s.env),
                "--{}",
                s.flag
            );
        }
    }

    #[test]
    fn a_member_setting_given_twice_is_refused() {
        let mut m = MemberSettings {
            role: MemberRole::Prefill,
            model: "m.gguf".into(),
            served_model_name: "m".into(),
            host: None,
            port: 8000,
            kv_port: 5600,
            prefill_peers: vec![],
            group_incarnation: 1,
            probe_period_seconds: 2,
            failure_threshold: 3,
            bootstrap_timeout_seconds: 10,
            kv_timeout_seconds: 30,
            channel_deadline_ms: 1000,
            no_progress_seconds: 30,
        };
        let mut args = vec!["x".to_string()];
        args.extend(m.to_args());
        args.push("--port=9000".into());
        let e = Config::try_parse_from(&args).unwrap_err().to_string();
        assert!(e.contains("--port"), "{e}");
        // A role both is not a member; a fractional duration is not the operator's.
        m.role = MemberRole::Decode;
        m.prefill_peers = vec!["p:1".into()];
        let mut c = parse(&m.to_args());
        c.kv.probe_period_seconds = 0.5;
        let e = c.member_settings().unwrap_err();
        assert!(e.contains("--probe-period-seconds 0.5"), "{e}");
        c.role = Role::Both;
        assert!(c.member_settings().is_err());
    }

    fn with_env<'a>(
        args: &'a [&'a str],
        env: &'a [(&'a str, &'a str)],
    ) -> Result<(Config, Vec<String>), clap::Error> {
        let env: HashMap<String, OsString> =
            env.iter().map(|(k, v)| (k.to_string(), v.into())).collect();
        let mut all = vec!["x", "--model", "m.gguf"];
        all.extend_from_slice(args);
        Config::parse_with_deprecations(all, |k| env.get(k).cloned())
    }

    #[test]
    fn a_renamed_flag_keeps_its_old_spelling_for_one_release_with_a_warning() {
        let (c, w) = with_env(&["--drain-secs", "5"], &[]).unwrap();
        assert_eq!(c.drain(), Duration::from_secs(5));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].contains("--drain-secs is deprecated")
                && w[0].contains("--drain-seconds")
                && w[0].contains(RENAMED_REMOVED_IN),
            "{w:?}"
        );
        let (c, w) = with_env(&["--queue-timeout-secs=7.5"], &[]).unwrap();
        assert_eq!(c.engine.queue_timeout_seconds, 7.5);
        assert_eq!(w.len(), 1);
        // The new spelling: no warning.
        let (c, w) = with_env(&["--drain-seconds", "4"], &[]).unwrap();
        assert_eq!((c.drain(), w.len()), (Duration::from_secs(4), 0));
        // A flag whose name merely starts like an old one is not it.
        assert!(with_env(&["--drain-secsx", "1"], &[]).is_err());
        // Both spellings: refused as a flag given twice, by its new name.
        let e = with_env(&["--drain-secs", "1", "--drain-seconds", "2"], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--drain-seconds"), "{e}");
        // The old variable is read when nothing newer is given, with a warning.
        let (c, w) = with_env(&[], &[("TANDEM_DRAIN_SECS", "3")]).unwrap();
        assert_eq!(c.drain(), Duration::from_secs(3));
        assert!(w[0].contains("TANDEM_DRAIN_SECS is deprecated"), "{w:?}");
        let (c, w) = with_env(&["--drain-seconds=9"], &[("TANDEM_DRAIN_SECS", "3")]).unwrap();
        assert_eq!(c.drain(), Duration::from_secs(9), "the new spelling wins");
        assert!(w[0].contains("ignored"), "{w:?}");
        // (clap reads the new variable from the real environment, so here it only shows
        // that the old one is not used beside it.)
        let (c, w) = with_env(
            &[],
            &[("TANDEM_DRAIN_SECS", "3"), ("TANDEM_DRAIN_SECONDS", "9")],
        )
        .unwrap();
        assert_ne!(
            c.drain(),
            Duration::from_secs(3),
            "the old variable is ignored"
        );
        assert!(w[0].contains("ignored"), "{w:?}");
        // Hidden: --help lists only the new spellings.
        use clap::CommandFactory;
        let help = Config::command().render_long_help().to_string();
        for r in RENAMED {
            assert!(
                !help.contains(&format!("--{} ", r.old_flag)),
                "{}",
                r.old_flag
            );
            assert!(
                help.contains(&format!("--{}", r.new_flag)),
                "{}",
                r.new_flag
            );
        }
    }

    #[test]
    fn flags_are_grouped_by_subsystem_in_the_help() {
        use clap::CommandFactory;
        let help = Config::command().render_long_help().to_string();
        let at = |s: &str| {
            help.find(s)
                .unwrap_or_else(|| panic!("{s} missing from --help"))
        };
        for (heading, flag) in [
            ("Model and device:", "--device"),
            ("Engine:", "--kv-blocks"),
            ("HTTP server:", "--http-max-body-bytes"),
            ("KV transfer (prefill and decode roles):", "--kv-port"),
        ] {
            assert!(at(heading) < at(flag), "{flag} under {heading}");
        }
    }
}

#[test]
fn api_keys_are_read_from_the_flag_and_the_file_and_never_shown() {
    let dir = std::env::temp_dir().join(format!("tandem-api-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("keys");
    std::fs::write(&file, "# ops\nsk-file-1\n").unwrap();
    let c = Config::try_parse_from([
        "x",
        "--model",
        "m.gguf",
        "--api-key",
        "sk-flag-1",
        "--api-key-file",
        file.to_str().unwrap(),
    ])
    .unwrap();
    assert_eq!(c.api_keys().unwrap().len(), 2);
    let v = c.effective();
    assert_eq!(v["config"]["api_key"], "<redacted: 9 bytes>");
    assert!(!v.to_string().contains("sk-flag-1"), "{v}");
    std::fs::write(&file, "bad key\n").unwrap();
    let e = c.api_keys().unwrap_err().to_string();
    assert!(e.contains("--api-key-file") && e.contains("line 1"), "{e}");
    assert!(!e.contains("bad key"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
