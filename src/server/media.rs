//! Images and audio clips in chat requests: `image_url` parts (base64 `data:` URLs of PNG,
//! JPEG or WebP images) and `input_audio` parts (base64 WAV, MP3, FLAC or OGG/Vorbis),
//! decoded and checked here, then encoded by the checkpoint's towers into the soft tokens of
//! the prompt's placeholder runs (the library's prompts do the same: see
//! [`crate::vision::prompt`]).

use serde_json::Value;

use super::api::ApiError;
use crate::audio::LoadOptions;
use crate::engine::Engine;
use crate::vision::{decode_image, RgbImage, SoftTokens};
use crate::Error;

/// The `format` values of `input_audio` parts.
pub const AUDIO_FORMATS: &[&str] = &["wav", "mp3", "flac", "ogg"];
/// The media types of image data URLs.
const IMAGE_TYPES: &[&str] = &["image/png", "image/jpeg", "image/jpg", "image/webp"];
/// Longest clip read from a request, in seconds (the towers take at most 30 s).
const MAX_CLIP_SECONDS: f64 = 60.0;

/// An image or a clip of a request, decoded.
pub enum Media {
    /// An image and, from its `detail`, Gemma 4's soft-token budget for it.
    Image(RgbImage, Option<usize>),
    /// Mono samples at the feature extractor's rate.
    Audio(Vec<f32>),
}

fn bad(i: usize, msg: impl std::fmt::Display) -> ApiError {
    ApiError::bad(format!("messages[{i}]: {msg}")).param("messages")
}

/// A model error in the API's words: what is wrong with the input is a 400, the rest a 500.
pub fn api_error(e: Error) -> ApiError {
    match e {
        Error::Input(m) | Error::Audio(m) | Error::Sampling(m) => ApiError::bad(m).param("messages"),
        e => ApiError::status(axum::http::StatusCode::INTERNAL_SERVER_ERROR, "server_error", "encoding_failed", e.to_string()),
    }
}

fn base64(data: &str, i: usize, what: &str) -> Result<Vec<u8>, ApiError> {
    let data: String = data.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    if data.is_empty() {
        return Err(bad(i, format!("the {what} is empty")));
    }
    base64::decode(&data).map_err(|e| bad(i, format!("the {what} is not valid base64 ({e})")))
}

/// Gemma 4's soft-token budget for an `image_url` part's `detail`: `low` the smallest (70),
/// `high` the largest (1,120), `auto` (or none) the checkpoint's. Gemma 3's SigLIP makes 256
/// soft tokens per image whatever the detail.
pub fn detail_budget(detail: Option<&Value>, i: usize) -> Result<Option<usize>, ApiError> {
    use crate::vision::processor::GEMMA4_BUDGETS;
    match detail {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(d)) => match d.as_str() {
            "auto" => Ok(None),
            "low" => Ok(GEMMA4_BUDGETS.first().copied()),
            "high" => Ok(GEMMA4_BUDGETS.last().copied()),
            d => Err(bad(i, format!("image_url.detail {d:?} is not one of \"low\", \"high\" or \"auto\""))),
        },
        Some(_) => Err(bad(i, "image_url.detail must be a string (\"low\", \"high\" or \"auto\")")),
    }
}

/// The image of an `image_url` part (`{"url": "data:image/png;base64,...", "detail": "low"}`,
/// or the URL alone).
pub fn image(part: Option<&Value>, i: usize, engine: &Engine) -> Result<Media, ApiError> {
    if engine.vision_config().is_none() {
        return Err(bad(i, "this model has no vision tower: it takes no images"));
    }
    let (url, budget) = match part {
        Some(Value::String(u)) => (u.as_str(), None),
        Some(Value::Object(o)) => (
            o.get("url").and_then(|u| u.as_str()).ok_or_else(|| bad(i, "an image_url part needs image_url.url (a data URL)"))?,
            detail_budget(o.get("detail"), i)?,
        ),
        _ => return Err(bad(i, "an image_url part needs image_url: {\"url\": \"data:image/png;base64,...\"}")),
    };
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return Err(bad(i, "remote image URLs are not fetched: send the image inline as a data URL (data:image/png;base64,...)"));
    }
    let Some(rest) = url.strip_prefix("data:") else {
        return Err(bad(i, "an image URL must be a data URL (data:image/png;base64,...)"));
    };
    let (head, data) = rest.split_once(',').ok_or_else(|| bad(i, "a malformed data URL: no comma before the data"))?;
    let mut head = head.split(';');
    let mime = head.next().unwrap_or_default().trim().to_ascii_lowercase();
    if !head.any(|p| p.trim().eq_ignore_ascii_case("base64")) {
        return Err(bad(i, "an image data URL must be base64-encoded (data:image/png;base64,...)"));
    }
    if !IMAGE_TYPES.contains(&mime.as_str()) {
        return Err(bad(i, format!("unsupported image type {mime:?} (image/png, image/jpeg and image/webp are)")));
    }
    let bytes = base64(data, i, "image data")?;
    decode_image(&bytes).map(|img| Media::Image(img, budget)).map_err(|e| bad(i, e))
}

/// The clip of an `input_audio` part (`{"data": "<base64>", "format": "wav"}`), at `rate` Hz.
pub fn audio(part: Option<&Value>, i: usize, engine: &Engine, rate: u32) -> Result<Media, ApiError> {
    if engine.audio_config().is_none() {
        return Err(bad(i, "this model has no audio tower: it takes no audio"));
    }
    let part = part.and_then(|p| p.as_object()).ok_or_else(|| bad(i, "an input_audio part needs input_audio: {\"data\": \"<base64>\", \"format\": \"wav\"}"))?;
    let format = part.get("format").and_then(|f| f.as_str()).ok_or_else(|| bad(i, "input_audio.format is required (wav, mp3, flac or ogg)"))?;
    let format = format.to_ascii_lowercase();
    if !AUDIO_FORMATS.contains(&format.as_str()) {
        return Err(bad(i, format!("unsupported audio format {format:?} (wav, mp3, flac and ogg are)")));
    }
    let data = part.get("data").and_then(|d| d.as_str()).ok_or_else(|| bad(i, "input_audio.data is required (the base64 of the file)"))?;
    let bytes = base64(data, i, "audio data")?;
    let opts = LoadOptions { rate, max_seconds: MAX_CLIP_SECONDS };
    let clip = crate::audio::load_bytes(bytes, &format, &format!("the {format} clip"), &opts).map_err(|e| bad(i, e))?;
    Ok(Media::Audio(clip))
}

/// Refuses, before any tower runs, a request whose images alone make more soft tokens than
/// the context holds (a large budget, or many images).
pub fn fit_context(engine: &Engine, media: &[Media], max_context: usize) -> Result<(), ApiError> {
    let mut total = 0usize;
    for m in media {
        if let Media::Image(img, budget) = m {
            total += engine.image_soft_tokens(img, *budget).map_err(api_error)?;
        }
    }
    if total > max_context {
        return Err(ApiError::status(
            axum::http::StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "context_length_exceeded",
            format!("the images make {total} soft tokens, more than this server's context of {max_context} tokens (--ctx-size): send fewer images or image_url.detail \"low\""),
        )
        .param("messages"));
    }
    Ok(())
}

/// The soft tokens of each image and clip, in order (the towers run here, one request's at a
/// time: the engine holds each tower behind a lock).
pub fn encode(engine: &Engine, media: &[Media]) -> Result<Vec<SoftTokens>, ApiError> {
    media
        .iter()
        .map(|m| match m {
            Media::Image(img, budget) => engine.encode_image_with_budget(img, *budget),
            Media::Audio(clip) => engine.encode_audio(clip),
        })
        .map(|r| r.map_err(api_error))
        .collect()
}
