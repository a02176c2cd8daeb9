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
    assert_eq!((c.role, c.port, c.chunk_size), (Role::Both, 9000, 64));
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
    assert_eq!(c.kv_dtype, KvDtype::F16, "the default KV dtype");
    assert_eq!(c.prefill_peers, ["p0.g:6000", "p1.g:6000"]);
    assert_eq!(c.kv_port, 6000);
    let t = c.pd_timings();
    assert_eq!(t.liveness_window(), Duration::from_secs(2));
    // 2 x liveness window (4 s) is below the 10 s bootstrap timeout, which wins.
    assert_eq!(t.session_expiry(), Duration::from_secs(10));
    let short = PdTimings {
        bootstrap_timeout: Duration::from_secs(1),
        ..t
    };
    assert_eq!(short.session_expiry(), Duration::from_secs(4));
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
    let gguf = FakeModel::new("ok.gguf", b"GGUF\x03\0\0\0");
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
    assert_eq!(dev("cpu").unwrap().device, Device::Cpu);
    assert_eq!(dev("cuda").unwrap().device, Device::Cuda(0));
    assert_eq!(dev("cuda:3").unwrap().device, Device::Cuda(3));
    assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
    for bad in ["gpu", "cuda:x", "cuda:", "tpu"] {
        let err = dev(bad).unwrap_err().to_string();
        assert!(
            err.contains("--device") && err.contains("use cpu, cuda or cuda:N"),
            "{bad}: {err}"
        );
    }
    let c = Config::try_parse_from(["x", "--model", "m.gguf"]).unwrap();
    assert_eq!(c.device, Device::Cpu, "the default");
}

#[test]
fn backend_knobs_are_flags_passed_down() {
    let c = Config::try_parse_from(["x", "--model", "m.gguf"]).unwrap();
    assert_eq!(c.cpu_options(), CpuOptions::default());
    assert!(
        c.cuda_sampling && !c.cuda_graphs,
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
    assert!(!c.cuda_sampling && c.cuda_graphs);
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
    assert_eq!(c.kv_dtype, KvDtype::Q8_0);
    assert_eq!(c.kv_dtype.ggml(), tandem_kernels::GgmlType::Q8_0);
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
        Config::try_parse_from(v).unwrap().no_prefix_cache
    };
    assert!(!parse(&[]));
    assert!(parse(&["--no-prefix-cache"]));
}
