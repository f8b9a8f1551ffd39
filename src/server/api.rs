//! The OpenAI API's request bodies, their checks, and errors in its shape
//! (`{"error": {"message", "type", "param", "code"}}`).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use super::media;
use super::scheduler::Request;
use crate::engine::{Engine, SampleParams};
use crate::tokenizer::{render_chat_template, ContentPart, Message, PartsMessage, Tokenizer};
use crate::vision::prompt::{audio_marker, image_marker, rendered_chat_prompt};
use crate::vision::SoftTokens;

/// An error answered in the API's shape.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<&'static str>,
    /// Seconds a client should wait before trying again (429, 503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", code: None, param: None, retry_after: None }
    }
    pub fn param(self, p: &'static str) -> Self {
        ApiError { param: Some(p), ..self }
    }
    pub fn status(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, code: Some(code), param: None, retry_after: None }
    }
    pub fn retry(self, seconds: u32) -> Self {
        ApiError { retry_after: Some(seconds), ..self }
    }
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// A chat message's content: text, or a list of parts.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// A content part: `text`, `image_url` (`{"url": "data:image/png;base64,..."}`) or
/// `input_audio` (`{"data": "<base64>", "format": "wav"}`); the media parts are read by
/// [`media`], with their own errors.
#[derive(Deserialize, Debug)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
    #[serde(default)]
    pub image_url: Option<Value>,
    #[serde(default)]
    pub input_audio: Option<Value>,
}

#[derive(Deserialize, Debug)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

/// `prompt` of `/v1/completions`: text, token ids, or a list of one of them.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `logprobs`: a switch in chat requests, a count in completion requests.
#[derive(Deserialize, Debug, Clone, Copy)]
#[serde(untagged)]
pub enum Logprobs {
    On(bool),
    Top(u32),
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields of both generation endpoints; each endpoint checks which it needs.
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct ApiRequest {
    pub model: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    pub prompt: Option<Prompt>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub stop: Option<Stop>,
    pub seed: Option<i64>,
    pub n: Option<u64>,
    pub best_of: Option<u64>,
    pub logprobs: Option<Logprobs>,
    pub top_logprobs: Option<u32>,
    pub ignore_eos: Option<bool>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    pub tools: Option<Vec<Value>>,
    pub response_format: Option<Value>,
}

/// The most log-probability alternatives a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Stop strings per request (OpenAI's limit).
const MAX_STOPS: usize = 4;

/// Parses a request body, with the parser's words for what is wrong.
pub fn parse(body: &[u8]) -> Result<ApiRequest, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(ApiError::bad("the request has no body: send a JSON object"));
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad("the body must be a JSON object"));
    }
    serde_json::from_value(v).map_err(|e| ApiError::bad(format!("invalid request: {e}")))
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// A checked request: what the scheduler runs and how to answer.
pub struct Checked {
    pub req: Request,
    pub stream: bool,
    pub include_usage: bool,
}

/// What the checks need to know of the model.
pub struct Limits<'a> {
    pub tokenizer: &'a Tokenizer,
    pub chat_template: Option<&'a str>,
    pub max_context: usize,
    pub vocab: usize,
    /// The model, whose towers encode a request's images and clips.
    pub engine: &'a Engine,
    /// The sample rate the audio tower's features take.
    pub audio_rate: u32,
}

/// Checks a request's parameters and builds its prompt.
pub fn check(r: ApiRequest, ep: Endpoint, lim: &Limits, seed_source: impl FnOnce() -> u32) -> Result<Checked, ApiError> {
    if r.n.is_some_and(|n| n != 1) || r.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("only one choice per request is supported (n = 1)").param("n"));
    }
    for (v, name) in [(r.presence_penalty, "presence_penalty"), (r.frequency_penalty, "frequency_penalty")] {
        if v.is_some_and(|p| p != 0.0) {
            return Err(ApiError::bad(format!("{name} is not supported (use repetition_penalty)")).param(name));
        }
    }
    if r.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::bad("logit_bias is not supported").param("logit_bias"));
    }
    if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::bad("tools are not supported").param("tools"));
    }
    if let Some(f) = &r.response_format {
        if f.get("type").and_then(|t| t.as_str()) != Some("text") {
            return Err(ApiError::bad("response_format: only {\"type\": \"text\"} is supported").param("response_format"));
        }
    }
    if r.echo == Some(true) || r.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad("echo and suffix are not supported"));
    }
    let mut soft = vec![];
    let prompt = match ep {
        Endpoint::Chat => {
            if r.prompt.is_some() {
                return Err(ApiError::bad("chat completions take messages, not prompt (see /v1/completions)").param("prompt"));
            }
            let messages = r.messages.as_deref().ok_or_else(|| ApiError::bad("messages is required").param("messages"))?;
            let (ids, s) = chat_prompt(messages, lim)?;
            soft = s;
            ids
        }
        Endpoint::Completions => {
            if r.messages.is_some() {
                return Err(ApiError::bad("completions take a prompt, not messages (see /v1/chat/completions)").param("messages"));
            }
            let p = r.prompt.as_ref().ok_or_else(|| ApiError::bad("prompt is required").param("prompt"))?;
            completion_prompt(p, lim)?
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::bad("the prompt is empty").param("prompt"));
    }
    if prompt.len() > lim.max_context {
        return Err(ApiError::status(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "context_length_exceeded",
            format!(
                "the prompt has {} tokens, more than this server's context of {} tokens (--ctx-size); shorten the prompt",
                prompt.len(),
                lim.max_context
            ),
        )
        .param(if ep == Endpoint::Chat { "messages" } else { "prompt" }));
    }
    let room = lim.max_context - prompt.len() + 1;
    let asked = r.max_completion_tokens.or(r.max_tokens);
    if asked == Some(0) {
        return Err(ApiError::bad("max_tokens must be at least 1").param("max_tokens"));
    }
    // OpenAI's defaults: completions 16 tokens, chat until the context is full
    let max_tokens = asked.unwrap_or(if ep == Endpoint::Completions { 16 } else { room as u64 }).min(room as u64) as usize;
    let stop = match r.stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::bad(format!("at most {MAX_STOPS} stop sequences, got {}", stop.len())).param("stop"));
    }
    let top_k = match r.top_k {
        None => 0,
        Some(k) if k <= 0 => 0,
        Some(k) => u32::try_from(k).unwrap_or(u32::MAX),
    };
    let temperature = r.temperature.unwrap_or(1.0);
    let sampling = SampleParams {
        temperature,
        top_k,
        top_p: r.top_p.unwrap_or(1.0),
        min_p: r.min_p.unwrap_or(0.0),
        repetition_penalty: r.repetition_penalty.unwrap_or(1.0),
        // no seed: a fresh one, as a request without one is not reproducible
        seed: match r.seed {
            Some(s) => (s as u64 ^ (s as u64 >> 32)) as u32,
            None => seed_source(),
        },
    };
    sampling.validate().map_err(|e| ApiError::bad(format!("invalid sampling parameters: {e}")))?;
    let logprobs = match (ep, r.logprobs, r.top_logprobs) {
        (_, Some(Logprobs::On(false)) | None, None) => None,
        (Endpoint::Chat, Some(Logprobs::On(true)), n) => Some(n.unwrap_or(0)),
        (Endpoint::Chat, _, Some(_)) => return Err(ApiError::bad("top_logprobs needs logprobs: true").param("top_logprobs")),
        (Endpoint::Completions, Some(Logprobs::Top(n)), None) => Some(n),
        (Endpoint::Completions, Some(Logprobs::On(true)), None) => Some(0),
        (Endpoint::Chat, Some(Logprobs::Top(_)), None) => return Err(ApiError::bad("logprobs is a boolean in chat requests (top_logprobs is the count)").param("logprobs")),
        (Endpoint::Completions, _, Some(_)) => return Err(ApiError::bad("completions take logprobs as a count, not top_logprobs").param("top_logprobs")),
    };
    if logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return Err(ApiError::bad(format!("at most {MAX_TOP_LOGPROBS} top log-probabilities")).param("top_logprobs"));
    }
    let req = Request { prompt, max_tokens, sampling, stop, ignore_eos: r.ignore_eos.unwrap_or(false), logprobs: logprobs.map(|n| n as usize), soft };
    let stream = r.stream.unwrap_or(false);
    if r.stream_options.is_some() && !stream {
        return Err(ApiError::bad("stream_options is only allowed with stream: true").param("stream_options"));
    }
    Ok(Checked { req, stream, include_usage: r.stream_options.is_some_and(|o| o.include_usage) })
}

/// The prompt of a chat: its ids and, where the messages hold images or clips, the soft
/// tokens of their placeholder runs (the towers run here).
fn chat_prompt(messages: &[ChatMessage], lim: &Limits) -> Result<(Vec<u32>, Vec<SoftTokens>), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("messages must not be empty").param("messages"));
    }
    let mut msgs = Vec::with_capacity(messages.len());
    let mut media = vec![];
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => return Err(ApiError::bad(format!("messages[{i}]: unsupported role {other:?} (system, developer, user, assistant)")).param("messages")),
        };
        let content = match &m.content {
            None => vec![],
            Some(Content::Text(t)) => vec![ContentPart::Text { text: t.clone() }],
            Some(Content::Parts(parts)) => {
                let mut content = Vec::with_capacity(parts.len());
                for p in parts {
                    content.push(match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => ContentPart::Text { text: t.clone() },
                        ("text", None) => return Err(ApiError::bad(format!("messages[{i}]: a text part needs text")).param("messages")),
                        ("image_url", _) => {
                            media.push(media::image(p.image_url.as_ref(), i, lim.engine)?);
                            ContentPart::Image
                        }
                        ("input_audio", _) => {
                            media.push(media::audio(p.input_audio.as_ref(), i, lim.engine, lim.audio_rate)?);
                            ContentPart::Audio
                        }
                        (k, _) => {
                            return Err(ApiError::bad(format!("messages[{i}]: content parts of type {k:?} are not supported (text, image_url, input_audio)")).param("messages"))
                        }
                    });
                }
                content
            }
        };
        msgs.push(PartsMessage::new(role, content));
    }
    let bos = lim.tokenizer.bos_token.as_deref().unwrap_or_default();
    let err = |e: crate::Error| ApiError::bad(e.to_string()).param("messages");
    let text = match lim.chat_template {
        Some(t) => render_chat_template(t, bos, &msgs, true).map_err(err)?,
        None => gemma_turns(bos, &text_messages(&msgs, lim)?),
    };
    if media.is_empty() {
        return Ok((lim.tokenizer.encode(&text, true).map_err(|e| ApiError::bad(e.to_string()))?, vec![]));
    }
    media::fit_context(lim.engine, &media, lim.max_context)?;
    let soft = media::encode(lim.engine, &media)?;
    let p = rendered_chat_prompt(lim.engine, &msgs, &text, soft).map_err(media::api_error)?;
    // the steps it is fed in: an image that attends to itself fits one prefill step
    lim.engine.plan(&p.ids, &p.soft).map_err(media::api_error)?;
    Ok((p.ids, p.soft))
}

/// The messages as text, each image and clip as the marker the processor expands (for Gemma's
/// turn format, which has no content items).
fn text_messages(msgs: &[PartsMessage], lim: &Limits) -> Result<Vec<Message>, ApiError> {
    let err = |e: crate::Error| ApiError::bad(e.to_string()).param("messages");
    msgs.iter()
        .map(|m| {
            let mut content = String::new();
            for p in &m.content {
                match p {
                    ContentPart::Text { text } => content.push_str(text),
                    ContentPart::Image => content.push_str(&image_marker(lim.tokenizer, lim.engine.vision_or_err().map_err(err)?).map_err(err)?),
                    ContentPart::Audio => content.push_str(&audio_marker(lim.tokenizer, lim.engine.audio_or_err().map_err(err)?).map_err(err)?),
                }
            }
            Ok(Message { role: m.role.clone(), content })
        })
        .collect()
}

/// Gemma's turn format, for checkpoints that ship no chat template: system text opens the
/// first user turn, the assistant's turns are the model's.
pub fn gemma_turns(bos: &str, msgs: &[Message]) -> String {
    let mut out = bos.to_string();
    let mut system = String::new();
    for m in msgs {
        match m.role.as_str() {
            "system" => {
                system.push_str(m.content.trim());
                system.push_str("\n\n");
            }
            role => {
                let role = if role == "assistant" { "model" } else { role };
                out.push_str("<start_of_turn>");
                out.push_str(role);
                out.push('\n');
                if role == "user" {
                    out.push_str(&std::mem::take(&mut system));
                }
                out.push_str(m.content.trim());
                out.push_str("<end_of_turn>\n");
            }
        }
    }
    if !system.is_empty() {
        // a system message with no user turn after it still reaches the model
        out.push_str("<start_of_turn>user\n");
        out.push_str(system.trim_end());
        out.push_str("<end_of_turn>\n");
    }
    out.push_str("<start_of_turn>model\n");
    out
}

fn completion_prompt(p: &Prompt, lim: &Limits) -> Result<Vec<u32>, ApiError> {
    let one = |n: usize| if n == 1 { Ok(()) } else { Err(ApiError::bad(format!("one prompt per request is supported, got {n}")).param("prompt")) };
    let ids = match p {
        Prompt::Text(t) => return lim.tokenizer.encode(t, true).map_err(|e| ApiError::bad(e.to_string()).param("prompt")),
        Prompt::Texts(v) => {
            one(v.len())?;
            return lim.tokenizer.encode(&v[0], true).map_err(|e| ApiError::bad(e.to_string()).param("prompt"));
        }
        Prompt::Tokens(ids) => ids.clone(),
        Prompt::TokenLists(v) => {
            one(v.len())?;
            v[0].clone()
        }
    };
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= lim.vocab) {
        return Err(ApiError::bad(format!("token id {bad} is outside the vocabulary ({} tokens)", lim.vocab)).param("prompt"));
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma_turns_put_the_system_prompt_in_the_first_user_turn() {
        let msgs = [Message::system("Be brief."), Message::user("Hi"), Message::assistant("Hello."), Message::user("Bye")];
        assert_eq!(
            gemma_turns("<bos>", &msgs),
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
    }

    #[test]
    fn bodies_are_parsed_with_clear_errors() {
        assert!(parse(b"").unwrap_err().message.contains("no body"));
        assert!(parse(b"{").unwrap_err().message.contains("not valid JSON"));
        assert!(parse(b"[1]").unwrap_err().message.contains("JSON object"));
        let e = parse(br#"{"temperature": "hot"}"#).unwrap_err();
        assert!(e.message.contains("invalid type") && e.status == StatusCode::BAD_REQUEST, "{}", e.message);
        let r = parse(br#"{"prompt": [1, 2], "logprobs": 3, "stop": "x"}"#).unwrap();
        assert!(matches!(r.prompt, Some(Prompt::Tokens(_))) && matches!(r.logprobs, Some(Logprobs::Top(3))));
    }
}
