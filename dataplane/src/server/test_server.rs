//! The in-process test server of the server's tests: the toy runner and a byte-level
//! tokenizer behind the real `serve` on a loopback port.

use std::sync::Mutex;

use super::*;
use crate::scheduler::{self, SchedulerConfig};
use crate::test_support::fake_runner::{FakeState, fake};
use crate::test_support::http_client::{HttpResponse, request};
use crate::tokenizer::{TokenText, TokenizerSpec, token_type};

pub(super) const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Byte-level vocabulary ordered so that ids 0..40 (the toy runner's vocabulary) are the
/// printable bytes 'A'.., plus two control tokens.
pub(super) fn toy_tokenizer() -> Tokenizer {
    let order: Vec<u8> = (0x41..=0xFFu8).chain(0..0x41).collect();
    let bm_char = |b: u8| -> String {
        // Same mapping as GPT-2: printable ASCII stands for itself.
        let visible = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if visible {
            char::from(b).to_string()
        } else {
            let shifted: Vec<u8> = (0..=255u8)
                .filter(|&x| !matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF))
                .collect();
            let n = shifted.iter().position(|&x| x == b).unwrap() as u32;
            char::from_u32(256 + n).unwrap().to_string()
        }
    };
    let mut tokens: Vec<String> = order.iter().map(|&b| bm_char(b)).collect();
    tokens.push("<|im_start|>".into());
    tokens.push("<|im_end|>".into());
    let mut types = vec![token_type::NORMAL; 256];
    types.extend([token_type::CONTROL, token_type::CONTROL]);
    Tokenizer::new(TokenizerSpec {
        model: "gpt2".into(),
        pre: "smollm".into(),
        tokens,
        token_types: types,
        merges: vec![],
        bos_id: Some(256),
        eos_id: Some(257),
        add_bos: Some(false),
        ..Default::default()
    })
    .unwrap()
}

pub(super) struct TestServer {
    pub(super) addr: SocketAddr,
    pub(super) runner: Arc<Mutex<FakeState>>,
    pub(super) stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Short, so the header-timeout test is quick; whole request heads are written at once.
pub(super) const HEADER_TIMEOUT: Duration = Duration::from_secs(1);

pub(super) fn start(blocks: usize) -> TestServer {
    start_with(blocks, SchedulerConfig::default())
}

pub(super) fn start_with(blocks: usize, cfg: SchedulerConfig) -> TestServer {
    start_custom(blocks, cfg, Duration::from_secs(5), Duration::from_secs(5)).0
}

/// A server with its `/ready` engine-stall limit and drain deadline; also the thread that
/// runs `serve`, which ends when `serve` returns.
pub(super) fn start_custom(
    blocks: usize,
    cfg: SchedulerConfig,
    max_heartbeat_age: Duration,
    drain: Duration,
) -> (TestServer, std::thread::JoinHandle<()>) {
    let limits = HttpLimits {
        header_timeout: HEADER_TIMEOUT,
        ..HttpLimits::default()
    };
    start_full(blocks, cfg, max_heartbeat_age, drain, limits)
}

/// A server with every knob: the HTTP limits too.
pub(super) fn start_full(
    blocks: usize,
    cfg: SchedulerConfig,
    max_heartbeat_age: Duration,
    drain: Duration,
    limits: HttpLimits,
) -> (TestServer, std::thread::JoinHandle<()>) {
    start_keyed(
        blocks,
        cfg,
        max_heartbeat_age,
        drain,
        limits,
        Default::default(),
    )
}

/// A server that requires `api_keys`.
pub(super) fn start_with_keys(api_keys: tandem_contract::api_keys::ApiKeys) -> TestServer {
    let limits = HttpLimits {
        header_timeout: HEADER_TIMEOUT,
        ..HttpLimits::default()
    };
    let five = Duration::from_secs(5);
    start_keyed(
        1000,
        SchedulerConfig::default(),
        five,
        five,
        limits,
        api_keys,
    )
    .0
}

fn start_keyed(
    blocks: usize,
    cfg: SchedulerConfig,
    max_heartbeat_age: Duration,
    drain: Duration,
    limits: HttpLimits,
    api_keys: tandem_contract::api_keys::ApiKeys,
) -> (TestServer, std::thread::JoinHandle<()>) {
    let (runner, st) = fake(blocks);
    let tok = Arc::new(toy_tokenizer());
    let metrics = Arc::new(Metrics::new());
    let text: Arc<dyn TokenText> = tok.clone();
    let (engine, _) = scheduler::spawn(runner, text, cfg, metrics.clone()).unwrap();
    let state = Arc::new(AppState {
        engine,
        tokenizer: tok,
        chat: Some(ChatTemplate::new(CHATML, "<|im_start|>", "<|im_end|>").unwrap()),
        add_bos: false,
        model_name: "toy".into(),
        context_length: 1024,
        default_max_tokens: 16,
        metrics,
        max_heartbeat_age,
        limits,
        role: "both",
        shutdown: Default::default(),
        pd: None,
        fault_injection: false,
        no_progress: Duration::from_secs(30),
        progress: Default::default(),
        readiness: Default::default(),
        api_keys,
        kv_block_tokens: crate::test_support::fake_runner::BLOCK,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let serving = std::thread::spawn(move || {
        rt.block_on(serve(listener, state, async { drop(rx.await) }, drain));
    });
    (
        TestServer {
            addr,
            runner: st,
            stop: Some(tx),
        },
        serving,
    )
}

pub(super) fn post(s: &TestServer, path: &str, body: &str) -> HttpResponse {
    request(s.addr, "POST", path, Some(body))
}

pub(super) fn chat_body(extra: &str) -> String {
    format!(r#"{{"model":"toy","messages":[{{"role":"user","content":"Hi there"}}]{extra}}}"#)
}

/// A one-token chat request sent from a thread (the test goes on while it waits).
pub(super) fn chat_in_background(
    addr: std::net::SocketAddr,
) -> std::thread::JoinHandle<HttpResponse> {
    std::thread::spawn(move || {
        request(
            addr,
            "POST",
            "/v1/chat/completions",
            Some(&chat_body(r#","max_tokens":1"#)),
        )
    })
}
