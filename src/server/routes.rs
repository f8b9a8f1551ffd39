//! The HTTP handlers: the generation endpoints (whole answers and SSE streams), models,
//! health and metrics.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::api::{self, ApiError, Checked, Endpoint, Limits};
use super::scheduler::{Event, Finish, Refused, TokenLogprob, Usage};
use super::App;

/// Largest request body (a long conversation fits many times over).
pub const MAX_BODY: usize = 16 << 20;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A fresh sampling seed for requests that give none.
fn fresh_seed() -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let x = t ^ NEXT_ID.fetch_add(1, Relaxed).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (x ^ (x >> 29) ^ (x >> 32)) as u32
}

pub async fn chat(State(app): State<Arc<App>>, body: Body) -> Response {
    generate(app, body, Endpoint::Chat).await.unwrap_or_else(|e| e.into_response())
}

pub async fn completions(State(app): State<Arc<App>>, body: Body) -> Response {
    generate(app, body, Endpoint::Completions).await.unwrap_or_else(|e| e.into_response())
}

async fn generate(app: Arc<App>, body: Body, ep: Endpoint) -> Result<Response, ApiError> {
    let bytes = axum::body::to_bytes(body, MAX_BODY)
        .await
        .map_err(|_| ApiError::status(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "body_too_large", format!("the body is larger than {MAX_BODY} bytes or could not be read")))?;
    let r = api::parse(&bytes)?;
    app.check_model(r.model.as_deref())?;
    let ready = app.ready()?;
    // templates and tokenization of long prompts run off the async workers
    let a = app.clone();
    let checked = tokio::task::spawn_blocking(move || {
        let ready = a.ready()?;
        let tokenizer = ready.engine.tokenizer().map_err(|e| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "no_tokenizer", e.to_string()))?;
        // --chat-template, else the checkpoint's
        let chat_template = ready.chat_template.as_deref().or(tokenizer.chat_template());
        let (max_context, vocab) = (ready.engine.max_context(), ready.engine.config.vocab_size);
        let lim = Limits { tokenizer, chat_template, max_context, vocab, engine: &ready.engine, audio_rate: ready.audio_rate };
        api::check(r, ep, &lim, fresh_seed)
    })
    .await
    .map_err(|_| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", "internal error while reading the request"))?;
    let Checked { req, stream, include_usage } = checked?;
    let logprobs = req.logprobs.is_some();
    let rx = ready.scheduler.submit(req).map_err(|e| match e {
        Refused::Full => ApiError::status(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "queue_full", "the server is at capacity (every slot runs and the queue is full); retry later").retry(1),
        Refused::Draining => ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "server_error", "shutting_down", "the server is shutting down").retry(5),
    })?;
    let id = NEXT_ID.fetch_add(1, Relaxed);
    let reply = Reply { ep, id: format!("{}-{id}", if ep == Endpoint::Chat { "chatcmpl" } else { "cmpl" }), created: now_s(), model: app.model.clone(), logprobs };
    Ok(if stream { stream_reply(reply, rx, include_usage) } else { whole_reply(reply, rx).await? })
}

/// What every chunk and answer of one request repeats.
struct Reply {
    ep: Endpoint,
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// Log-probabilities in each endpoint's shape: chat's `content` list, or completions'
/// parallel arrays (text offsets from `offset`).
fn logprobs_json(ep: Endpoint, lps: &[TokenLogprob], offset: usize) -> Value {
    let num = |x: f32| if x.is_finite() { json!(x) } else { json!(-9999.0) };
    match ep {
        Endpoint::Chat => json!({"content": lps.iter().map(|l| json!({
            "token": l.token,
            "logprob": num(l.logprob),
            "bytes": l.token.as_bytes(),
            "top_logprobs": l.top.iter().map(|(t, p)| json!({"token": t, "logprob": num(*p), "bytes": t.as_bytes()})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>()}),
        Endpoint::Completions => {
            let mut off = offset;
            let offsets: Vec<usize> = lps
                .iter()
                .map(|l| {
                    let o = off;
                    off += l.token.len();
                    o
                })
                .collect();
            json!({
                "tokens": lps.iter().map(|l| &l.token).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(|l| num(l.logprob)).collect::<Vec<_>>(),
                "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(t, p)| (t.clone(), num(*p))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
    }
}

fn server_error(message: String) -> ApiError {
    ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "generation_failed", message)
}

/// Waits for the whole generation and answers it in one body.
async fn whole_reply(reply: Reply, mut rx: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut lps = vec![];
    let (finish, usage) = loop {
        match rx.recv().await {
            Some(Event::Token { text: t, logprob }) => {
                text.push_str(&t);
                lps.extend(logprob);
            }
            Some(Event::Done { finish, usage }) => break (finish, usage),
            Some(Event::Error(e)) => return Err(server_error(e)),
            None => return Err(server_error("the generation ended without an answer".into())),
        }
    };
    let logprobs = if reply.logprobs { logprobs_json(reply.ep, &lps, 0) } else { Value::Null };
    let choice = match reply.ep {
        Endpoint::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish.as_str()}),
        Endpoint::Completions => json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish.as_str()}),
    };
    let object = if reply.ep == Endpoint::Chat { "chat.completion" } else { "text_completion" };
    Ok(Json(json!({
        "id": reply.id, "object": object, "created": reply.created, "model": reply.model,
        "choices": [choice], "usage": usage_json(&usage),
    }))
    .into_response())
}

impl Reply {
    /// One streamed chunk: a delta of text (or the role), log-probabilities, a finish reason.
    fn chunk(&self, text: Option<&str>, role: bool, logprobs: Value, finish: Option<Finish>) -> Value {
        let finish = finish.map(|f| f.as_str());
        match self.ep {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                       "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
            }
            Endpoint::Completions => json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                       "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}]}),
        }
    }

    fn usage_chunk(&self, u: &Usage) -> Value {
        let object = if self.ep == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [], "usage": usage_json(u)})
    }
}

/// Streams the generation as server-sent events, ending with `data: [DONE]`. The client
/// going away drops the stream and with it the request's receiver: the scheduler frees the
/// sequence at its next step.
fn stream_reply(reply: Reply, mut rx: UnboundedReceiver<Event>, include_usage: bool) -> Response {
    let (tx, out) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(64);
    tokio::spawn(async move {
        let data = |v: Value| Ok(SseEvent::default().data(v.to_string()));
        if reply.ep == Endpoint::Chat && tx.send(data(reply.chunk(Some(""), true, Value::Null, None))).await.is_err() {
            return;
        }
        let mut offset = 0;
        loop {
            let ev = match rx.recv().await {
                Some(Event::Token { text, logprob }) => {
                    if text.is_empty() && logprob.is_none() {
                        continue;
                    }
                    let lp = if reply.logprobs { logprobs_json(reply.ep, logprob.as_slice(), offset) } else { Value::Null };
                    offset += text.len();
                    data(reply.chunk(Some(&text), false, lp, None))
                }
                Some(Event::Done { finish, usage }) => {
                    let empty = if reply.ep == Endpoint::Chat { None } else { Some("") };
                    if tx.send(data(reply.chunk(empty, false, Value::Null, Some(finish)))).await.is_err() {
                        return;
                    }
                    if include_usage && tx.send(data(reply.usage_chunk(&usage))).await.is_err() {
                        return;
                    }
                    break;
                }
                Some(Event::Error(e)) => {
                    let _ = tx.send(data(server_error(e).body())).await;
                    break;
                }
                None => {
                    let _ = tx.send(data(server_error("the generation ended without an answer".into()).body())).await;
                    break;
                }
            };
            if tx.send(ev).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
    });
    // comment lines while a long prompt prefills keep proxies and clients from timing out
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(out)).keep_alive(axum::response::sse::KeepAlive::default()).into_response()
}

pub async fn models(State(app): State<Arc<App>>) -> Response {
    Json(json!({"object": "list", "data": [app.model_card()]})).into_response()
}

pub async fn model(State(app): State<Arc<App>>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    match app.check_model(Some(&id)) {
        Ok(()) => Json(app.model_card()).into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn health(State(app): State<Arc<App>>) -> Response {
    match app.state() {
        super::Phase::Loading => (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "1")], Json(json!({"status": "loading"}))).into_response(),
        super::Phase::Draining => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "shutting down"}))).into_response(),
        super::Phase::Ready => Json(json!({"status": "ok"})).into_response(),
    }
}

pub async fn metrics(State(app): State<Arc<App>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], app.metrics.render(&app.model)).into_response()
}

pub async fn not_found() -> Response {
    ApiError::status(StatusCode::NOT_FOUND, "invalid_request_error", "not_found", "no such endpoint (POST /v1/chat/completions, POST /v1/completions, GET /v1/models, /health, /metrics)").into_response()
}

pub async fn method_not_allowed() -> Response {
    ApiError::status(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method_not_allowed", "method not allowed on this endpoint").into_response()
}
