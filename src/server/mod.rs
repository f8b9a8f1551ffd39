//! `markbase serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of the
//! scheduler, which runs many sequences of one model on one engine thread.
//!
//! - `POST /v1/chat/completions`, `POST /v1/completions`: whole answers or SSE streams (chat
//!   content may hold images and audio clips, see [`media`]);
//! - `GET /v1/models`, `GET /v1/models/{id}`;
//! - `GET /health`: 503 while the model loads and while shutting down, 200 when ready;
//! - `GET /metrics`: Prometheus text.
//!
//! With `--api-key`, the `/v1` endpoints want `Authorization: Bearer KEY`. SIGTERM or Ctrl-C
//! stops taking requests (503), finishes those accepted, then exits.

pub mod api;
pub mod media;
pub mod metrics;
pub mod routes;
pub mod scheduler;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;

use crate::engine::{Engine, ModelOptions};
use api::ApiError;
use metrics::Metrics;
use scheduler::Scheduler;

/// The paths metrics are labelled with (anything else counts as `other`).
pub const KNOWN_PATHS: &[&str] = &["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"];

/// The options of `markbase serve`.
#[derive(clap::Args, Clone, Debug)]
pub struct ServeArgs {
    /// Model directory (MLX checkpoint with tokenizer.json); with --synthetic, the directory
    /// whose tokenizer (and chat template) the synthetic model uses.
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Serve a synthetic model in real shapes with random 4-bit weights instead of the
    /// checkpoint's (for measuring throughput; see `bench --synthetic` for the names): -m then
    /// only gives the tokenizer, whose vocabulary must match the shape's.
    #[arg(long)]
    pub synthetic: Option<String>,
    /// Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences generated at once (each has a KV cache of --ctx-size positions).
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// Requests that may wait for a sequence; beyond, requests get 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Require `Authorization: Bearer KEY` on the /v1 endpoints.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Context of each sequence in tokens (default: the model's positions, at most 4096).
    #[arg(long = "ctx-size", visible_alias = "max-context")]
    pub ctx_size: Option<usize>,
    /// Tokens per prefill step: a long prompt is fed this many tokens per scheduler step,
    /// between the decode steps of the running sequences.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// vulkan | metal | dx12 | gl | cpu (default: MARKBASE_BACKEND, else the platform's best GPU).
    #[arg(long)]
    pub backend: Option<String>,
    /// The model's id in the API (default: the directory's name).
    #[arg(long)]
    pub alias: Option<String>,
    /// A Jinja chat template file, instead of the checkpoint's (checkpoints without one get
    /// Gemma's turn format).
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Decode steps multiply on the f16 GEMM with K in parts (tensor cores) instead of the
    /// several-token GEMV: faster steps with many sequences, slower with few (the same as
    /// MARKBASE_ROW_GEMM=f16; see docs/PERF.md). Each sequence's tokens stay those it gets alone.
    #[arg(long)]
    pub batch_f16: bool,
}

/// Where the server is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Loading,
    Ready,
    Draining,
}

/// What a loaded model serves with.
pub struct Ready {
    pub engine: Arc<Engine>,
    pub scheduler: Scheduler,
    pub chat_template: Option<String>,
    /// The sample rate of the audio tower's features (clips are resampled to it).
    pub audio_rate: u32,
}

/// The state every handler shares.
pub struct App {
    pub model: String,
    api_key: Option<String>,
    pub metrics: Arc<Metrics>,
    ready: OnceLock<Ready>,
    draining: AtomicBool,
    created: u64,
}

impl App {
    pub fn state(&self) -> Phase {
        if self.draining.load(Relaxed) {
            Phase::Draining
        } else if self.ready.get().is_some() {
            Phase::Ready
        } else {
            Phase::Loading
        }
    }

    pub fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready
            .get()
            .ok_or_else(|| ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "model_loading", "the model is still loading; retry shortly").retry(1))
    }

    /// A request's `model` must be this server's (or absent).
    pub fn check_model(&self, m: Option<&str>) -> Result<(), ApiError> {
        match m {
            None => Ok(()),
            Some(m) if m == self.model => Ok(()),
            Some(m) => Err(ApiError::status(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "model_not_found",
                format!("the model {m:?} does not exist on this server (it serves {:?}; see /v1/models)", self.model),
            )
            .param("model")),
        }
    }

    pub fn model_card(&self) -> serde_json::Value {
        let ctx = self.ready.get().map(|r| r.engine.max_context());
        let modalities = self.ready.get().map(|r| modalities(&r.engine));
        json!({"id": self.model, "object": "model", "created": self.created, "owned_by": "markbase", "max_model_len": ctx, "modalities": modalities})
    }
}

/// What a model takes in: text, and images and audio where it has the towers.
pub fn modalities(engine: &Engine) -> Vec<&'static str> {
    let mut m = vec!["text"];
    if engine.vision_config().is_some() {
        m.push("image");
    }
    if engine.audio_config().is_some() {
        m.push("audio");
    }
    m
}

/// Compares two keys in time independent of where they differ.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(g) if same_key(g.trim().as_bytes(), key.as_bytes()) => {}
            Some(_) => return ApiError::status(StatusCode::UNAUTHORIZED, "invalid_request_error", "invalid_api_key", "incorrect API key").into_response(),
            None => {
                return ApiError::status(StatusCode::UNAUTHORIZED, "invalid_request_error", "invalid_api_key", "missing API key: send Authorization: Bearer KEY")
                    .into_response()
            }
        }
    }
    next.run(req).await
}

async fn count(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let r = next.run(req).await;
    app.metrics.http_request(&path, r.status().as_u16());
    r
}

fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", "internal error").into_response()
}

/// The routes, for a server's state.
pub fn router(app: Arc<App>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(routes::chat))
        .route("/v1/completions", post(routes::completions))
        .route("/v1/models", get(routes::models))
        .route("/v1/models/{*id}", get(routes::model))
        .route_layer(middleware::from_fn_with_state(app.clone(), auth));
    Router::new()
        .merge(v1)
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), count))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(panic_response))
        .with_state(app)
}

/// Runs `markbase serve` until SIGTERM or Ctrl-C (and the requests accepted before it end).
pub fn serve(a: ServeArgs) -> Result<(), String> {
    if a.parallel == 0 || a.parallel > 1024 {
        return Err(format!("--parallel must be between 1 and 1024, got {}", a.parallel));
    }
    if a.prefill_chunk == 0 {
        return Err("--prefill-chunk must be at least 1 token".into());
    }
    if a.api_key.as_ref().is_some_and(|k| k.trim().is_empty()) {
        return Err("--api-key is empty".into());
    }
    if a.batch_f16 {
        std::env::set_var("MARKBASE_ROW_GEMM", "f16");
    }
    let device = crate::cli::parse_device(a.backend.as_deref())?;
    let synthetic = match &a.synthetic {
        Some(name) => Some((name.clone(), crate::synthetic::config(name)?)),
        None => None,
    };
    if a.synthetic.is_none() {
        crate::engine::check_dir(&a.model).map_err(|e| e.to_string())?;
    }
    if !a.model.join("tokenizer.json").is_file() {
        return Err(format!("{}: no such file (serving text needs the checkpoint's tokenizer)", a.model.join("tokenizer.json").display()));
    }
    let max_context = match (a.ctx_size, &synthetic) {
        (Some(n), _) => n,
        (None, Some((_, cfg))) => cfg.max_position_embeddings.clamp(1, 4096),
        (None, None) => crate::cli::read_config(&a.model)?.max_position_embeddings.clamp(1, 4096),
    };
    let chat_template = match &a.chat_template {
        Some(p) => Some(std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?),
        None => None,
    };
    let model = a.alias.clone().or_else(|| synthetic.as_ref().map(|(n, _)| n.clone())).unwrap_or_else(|| {
        let dir = std::fs::canonicalize(&a.model).unwrap_or_else(|_| a.model.clone());
        dir.file_name().map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned())
    });
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let app = Arc::new(App { model, api_key: a.api_key.clone(), metrics: Arc::new(Metrics::default()), ready: OnceLock::new(), draining: AtomicBool::new(false), created });
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("markbase-http").build().map_err(|e| format!("starting the runtime: {e}"))?;
    let r = rt.block_on(run(a, app, device, max_context, chat_template));
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    r
}

async fn run(a: ServeArgs, app: Arc<App>, device: crate::engine::DeviceKind, max_context: usize, chat_template: Option<String>) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port)).await.map_err(|e| format!("listening on {}:{}: {e}", a.host, a.port))?;
    let addr: SocketAddr = listener.local_addr().map_err(|e| e.to_string())?;
    eprintln!("listening on http://{addr} (loading {})", a.model.display());
    // the model loads on a thread of its own; /health answers 503 meanwhile
    let (loaded_tx, loaded_rx) = tokio::sync::oneshot::channel::<Result<std::thread::JoinHandle<()>, String>>();
    let (app2, dir) = (app.clone(), a.model.clone());
    let (parallel, max_queue, chunk) = (a.parallel, a.max_queue, a.prefill_chunk);
    let synthetic = a.synthetic.clone();
    let cpu_if_software_gpu = crate::cli::device_is_default(a.backend.as_deref());
    std::thread::spawn(move || {
        let t0 = std::time::Instant::now();
        let opts = ModelOptions { device, max_context, prefill_chunk: chunk, cpu_if_software_gpu, ..Default::default() };
        let r = load(&dir, synthetic.as_deref(), opts).and_then(|engine| {
            if let Some(n) = engine.notice() {
                eprintln!("note: {n}");
            }
            let audio_rate = match (engine.audio_config(), engine.dir()) {
                (Some(_), Some(dir)) => crate::audio::FeatureConfig::from_checkpoint(dir).map_err(|e| e.to_string())?.sampling_rate,
                _ => crate::audio::LoadOptions::default().rate,
            };
            let (scheduler, handle) = Scheduler::start(engine.clone(), parallel, max_queue, app2.metrics.clone())?;
            let device = engine.session().map(|s| s.device()).unwrap_or_default();
            let inputs = modalities(&engine).join(", ");
            let _ = app2.ready.set(Ready { engine, scheduler, chat_template, audio_rate });
            eprintln!(
                "ready: {} on {device}, {parallel} sequences of {max_context} tokens, input {inputs}, loaded in {:.1}s",
                app2.model,
                t0.elapsed().as_secs_f64()
            );
            Ok(handle)
        });
        let _ = loaded_tx.send(r);
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(None::<String>);
    let watcher = {
        let app = app.clone();
        tokio::spawn(async move {
            let mut loaded_rx = loaded_rx;
            let mut worker = None;
            let failed = tokio::select! {
                r = &mut loaded_rx => match r {
                    Ok(Ok(h)) => { worker = Some(h); None }
                    Ok(Err(e)) => Some(e),
                    Err(_) => Some("loading the model ended without an answer".to_string()),
                },
                _ = signal() => None,
            };
            if failed.is_none() && worker.is_some() {
                signal().await;
            }
            app.draining.store(true, Relaxed);
            if let Some(r) = app.ready.get() {
                r.scheduler.drain();
            }
            eprintln!("{}", if failed.is_some() { "loading failed" } else { "shutting down: finishing the running requests" });
            let _ = stop_tx.send(Some(failed.unwrap_or_default()));
            worker
        })
    };
    let mut stop = stop_rx.clone();
    axum::serve(listener, router(app.clone()))
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| s.is_some()).await;
        })
        .await
        .map_err(|e| format!("serving: {e}"))?;
    let worker = watcher.await.map_err(|e| e.to_string())?;
    if let Some(h) = worker {
        // the accepted requests have been answered; the engine thread ends with them
        let _ = tokio::task::spawn_blocking(move || h.join()).await;
    }
    let failed = stop_rx.borrow().clone().unwrap_or_default();
    if failed.is_empty() {
        eprintln!("stopped");
        Ok(())
    } else {
        Err(failed)
    }
}

/// The engine of a checkpoint directory, or of the synthetic shape `synthetic` (random 4-bit
/// weights) with the tokenizer of `dir`.
fn load(dir: &std::path::Path, synthetic: Option<&str>, opts: ModelOptions) -> Result<Arc<Engine>, String> {
    let Some(name) = synthetic else {
        return Engine::load(dir, opts).map_err(|e| e.to_string());
    };
    let t = std::time::Instant::now();
    let (cfg, w) = crate::synthetic::model(name, markbase_graph::quant::QuantSpec::affine(4, 64))?;
    eprintln!("synthetic {name}: {:.2} GB of weights generated in {:.1}s", w.stored_bytes() as f64 / 1e9, t.elapsed().as_secs_f64());
    let tok = crate::tokenizer::Tokenizer::load(dir, cfg.bos_token_id, &cfg.eos_token_ids).map_err(|e| e.to_string())?;
    if tok.vocab_size() > cfg.vocab_size {
        return Err(format!("{}: the tokenizer has {} tokens, more than {name}'s {} embeddings", dir.display(), tok.vocab_size(), cfg.vocab_size));
    }
    Engine::from_parts(cfg, Arc::new(w), Some(tok), &opts).map_err(|e| e.to_string())
}

/// SIGTERM or Ctrl-C.
async fn signal() {
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
