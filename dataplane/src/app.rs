//! Assembles the serving stack for role `both`: model runner, tokenizer, chat template,
//! engine thread and HTTP state.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::thread::JoinHandle;

use crate::chat::ChatTemplate;
use crate::config::{Config, Role};
use crate::engine_api::ModelRunner;
use crate::gguf::Gguf;
use crate::metrics::Metrics;
use crate::model::{CpuModelRunner, KvCacheConfig, RunnerConfig};
use crate::server::AppState;
use crate::tokenizer::{self, TokenText, Tokenizer};
use crate::{Error, Result};

pub struct App {
    pub state: Arc<AppState>,
    pub engine_thread: JoinHandle<()>,
}

pub fn build(cfg: &Config) -> Result<App> {
    if cfg.role != Role::Both {
        return Err(Error::Model(format!(
            "role '{}' is not implemented yet; only '--role both' is supported",
            cfg.role.as_str()
        )));
    }
    let gguf = Arc::new(Gguf::open(&cfg.model)?);
    let tok = Arc::new(Tokenizer::from_gguf(&gguf)?);
    let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or_default();
    let chat = tokenizer::chat_template(&gguf)?
        .map(|src| ChatTemplate::new(&src, &text(tok.bos_id()), &text(tok.eos_id())))
        .transpose()?;
    let add_bos = gguf
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let rc = RunnerConfig {
        kv: KvCacheConfig {
            n_blocks: cfg.kv_blocks.max(1),
            ..KvCacheConfig::default()
        },
    };
    let runner = CpuModelRunner::new(gguf, rc, tandem_kernels::best_backend())?;
    let info = runner.info().clone();
    if info.vocab_size != tok.vocab_size() {
        return Err(Error::Model(format!(
            "tokenizer has {} tokens but the model's vocabulary is {}",
            tok.vocab_size(),
            info.vocab_size
        )));
    }
    let metrics = Arc::new(Metrics::new());
    let text: Arc<dyn TokenText> = tok.clone();
    let (engine, engine_thread) =
        crate::scheduler::spawn(runner, text, cfg.scheduler(), metrics.clone()).map_err(|e| {
            Error::Io {
                path: "engine thread".into(),
                source: e,
            }
        })?;
    tracing::info!(
        model = %cfg.model.display(),
        served_as = %cfg.served_name(),
        context_length = info.context_length,
        kv_blocks = cfg.kv_blocks,
        kv_block_tokens = info.kv_block_size,
        has_chat_template = chat.is_some(),
        "model loaded"
    );
    let state = Arc::new(AppState {
        engine,
        tokenizer: tok,
        chat,
        add_bos,
        model_name: cfg.served_name(),
        context_length: info.context_length,
        default_max_tokens: cfg.default_max_tokens.max(1),
        metrics,
        max_heartbeat_age: cfg.engine_stall(),
        role: cfg.role.as_str(),
        draining: AtomicBool::new(false),
    });
    Ok(App {
        state,
        engine_thread,
    })
}
