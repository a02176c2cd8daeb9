//! Assembles the serving stack: model runner, tokenizer, chat template, engine thread, HTTP
//! state, and for the PD roles the KV transfer loops.

use std::sync::Arc;
use std::thread::JoinHandle;

use crate::chat::ChatTemplate;
use crate::config::{Config, Device, Role};
use crate::engine_api::ModelRunner;
use crate::error::Context;
use crate::gguf::Gguf;
use crate::kv::auth::GroupKey;
use crate::metrics::Metrics;
use crate::model::{CpuModelRunner, KvCacheConfig, RunnerConfig};
use crate::pd::{PdSlot, PdStarter};
use crate::server::AppState;
use crate::tokenizer::{self, TokenText, Tokenizer};
use crate::{Error, Result};
use tandem_contract::MemberRole;

pub struct App {
    pub state: Arc<AppState>,
    pub engine_thread: JoinHandle<()>,
}

/// The model runner for `--device`: the CPU backend (with `--threads`, `--no-simd`), or
/// the CUDA one in a `cuda` build (which probes the driver first and fails with a clear
/// error when there is none).
fn load_runner(cfg: &Config, gguf: Arc<Gguf>, rc: RunnerConfig) -> Result<Box<dyn ModelRunner>> {
    match cfg.model.device {
        Device::Cpu => {
            let kernels = Arc::new(tandem_kernels::CpuKernels::with_options(cfg.cpu_options()));
            Ok(Box::new(CpuModelRunner::new(gguf, rc, kernels)?))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(n) => Ok(Box::new(crate::model::cuda::CudaModelRunner::new(
            gguf,
            rc,
            n,
            cfg.cuda_options(),
        )?)),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(Error::config(
            format!("--device {}", cfg.model.device),
            "this binary was built without CUDA support (build with `--features cuda`); \
             use --device cpu",
        )),
    }
}

pub fn build(cfg: &Config) -> Result<App> {
    cfg.check()?;
    let gguf = Arc::new(Gguf::open(&cfg.model.path)?);
    let tok = Arc::new(Tokenizer::from_gguf(&gguf)?);
    let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or_default();
    let source = match &cfg.model.chat_template {
        Some(path) => Some(crate::chat::read_template_file(path)?),
        None => tokenizer::chat_template(&gguf)?,
    };
    let chat = source
        .map(|src| ChatTemplate::new(&src, &text(tok.bos_id()), &text(tok.eos_id())))
        .transpose()?;
    let add_bos = tok.adds_bos();
    let rc = RunnerConfig {
        kv: KvCacheConfig {
            n_blocks: cfg.engine.kv_blocks,
            dtype: cfg.engine.kv_dtype.ggml(),
            ..KvCacheConfig::default()
        },
        prefix_cache: !cfg.engine.no_prefix_cache,
    };
    let kv_dtype = rc.kv.dtype.id();
    let runner = load_runner(cfg, gguf, rc)
        .with_context(|| format!("loading the model onto {}", cfg.model.device))?;
    let info = runner.info().clone();
    if info.vocab_size != tok.vocab_size() {
        return Err(Error::Tokenizer(format!(
            "the tokenizer has {} tokens but the model's vocabulary is {}",
            tok.vocab_size(),
            info.vocab_size
        )));
    }
    let metrics = Arc::new(Metrics::new());
    metrics.set_cache_config(info.kv_block_size, cfg.engine.kv_blocks);
    let api_keys = cfg.api_keys()?;
    if !api_keys.is_empty() {
        tracing::info!(
            keys = api_keys.len(),
            "API keys required on /v1/* and /tandem/* (Authorization: Bearer)"
        );
    }
    let text: Arc<dyn TokenText> = tok.clone();
    let (engine, engine_thread) =
        crate::scheduler::spawn(runner, text, cfg.scheduler(), metrics.clone()).map_err(
            |source| Error::Thread {
                name: "engine".into(),
                source,
            },
        )?;
    tracing::info!(
        model = %cfg.model.path.display(),
        served_as = %cfg.served_name(),
        context_length = info.context_length,
        kv_blocks = cfg.engine.kv_blocks,
        kv_block_tokens = info.kv_block_size,
        kv_dtype = ?cfg.engine.kv_dtype,
        device = %cfg.model.device,
        has_chat_template = chat.is_some(),
        "model loaded"
    );
    let pd = start_pd(cfg, &info, kv_dtype, &engine, &metrics)?;
    let state = Arc::new(AppState {
        engine,
        tokenizer: tok,
        chat,
        add_bos,
        model_name: cfg.served_name(),
        context_length: info.context_length,
        default_max_tokens: cfg.http.default_max_tokens,
        metrics,
        max_heartbeat_age: cfg.engine_stall(),
        limits: cfg.http_limits(),
        role: cfg.role.as_str(),
        shutdown: Default::default(),
        pd,
        fault_injection: cfg.fault_injection,
        no_progress: cfg.no_progress(),
        progress: Default::default(),
        readiness: Default::default(),
        api_keys,
        kv_block_tokens: info.kv_block_size,
    });
    Ok(App {
        state,
        engine_thread,
    })
}

/// Start the KV channel of a PD role (none for `both`), in the slot an in-place reset
/// replaces it in.
fn start_pd(
    cfg: &Config,
    info: &crate::engine_api::ModelInfo,
    kv_dtype: u32,
    engine: &crate::scheduler::EngineHandle,
    metrics: &Arc<Metrics>,
) -> Result<Option<PdSlot>> {
    let role = match cfg.role {
        Role::Both => return Ok(None),
        Role::Prefill => MemberRole::Prefill,
        Role::Decode => MemberRole::Decode,
    };
    let starter = PdStarter {
        role,
        host: cfg.http.host.clone(),
        kv_port: cfg.kv.kv_port,
        prefill_peers: cfg.kv.prefill_peers.clone(),
        info: info.clone(),
        kv_dtype,
        key: GroupKey::new(cfg.kv.group_key.as_bytes()),
        timings: cfg.pd_timings(),
        limits: cfg.pd_limits(),
        engine: engine.clone(),
        metrics: metrics.clone(),
    };
    metrics.preset_resets(crate::pd::reset::Outcome::ALL.iter().map(|o| o.label()));
    PdSlot::start(starter, cfg.kv.group_incarnation).map(Some)
}
