//! Tokenizer (from the checkpoint's `tokenizer.json`), chat template (from
//! `chat_template.jinja` or `tokenizer_config.json`, rendered with minijinja)
//! and the special tokens that start and stop generation.

use std::path::Path;

use serde_json::Value;

use crate::error::Error;

/// One chat message.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn user(s: &str) -> Self {
        Message { role: "user".into(), content: s.into() }
    }
    pub fn assistant(s: &str) -> Self {
        Message { role: "assistant".into(), content: s.into() }
    }
    pub fn system(s: &str) -> Self {
        Message { role: "system".into(), content: s.into() }
    }
}

/// One item of a message's content: text, an image or an audio clip (HF's multimodal message
/// form).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text { text: String },
    Image,
    Audio,
}

/// A chat message whose content may hold images and clips: templates see its content as a
/// list of `{"type": "text", "text": ..}`, `{"type": "image"}` and `{"type": "audio"}` items
/// where it has an image or a clip, as the text alone otherwise (the same rendering as
/// [`Message`]).
#[derive(Clone, Debug)]
pub struct PartsMessage {
    pub role: String,
    pub content: Vec<ContentPart>,
}

impl PartsMessage {
    pub fn new(role: &str, content: Vec<ContentPart>) -> Self {
        PartsMessage { role: role.into(), content }
    }
    pub fn text(role: &str, s: &str) -> Self {
        PartsMessage::new(role, vec![ContentPart::Text { text: s.into() }])
    }
    /// Images in the content.
    pub fn images(&self) -> usize {
        self.content.iter().filter(|p| **p == ContentPart::Image).count()
    }
    /// Audio clips in the content.
    pub fn clips(&self) -> usize {
        self.content.iter().filter(|p| **p == ContentPart::Audio).count()
    }
}

impl serde::Serialize for PartsMessage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut m = s.serialize_struct("Message", 2)?;
        m.serialize_field("role", &self.role)?;
        if self.images() + self.clips() > 0 {
            m.serialize_field("content", &self.content)?;
        } else {
            let text: String = self.content.iter().map(|p| if let ContentPart::Text { text } = p { text.as_str() } else { "" }).collect();
            m.serialize_field("content", &text)?;
        }
        m.end()
    }
}

/// The tokenizer of a checkpoint.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub bos_id: Option<u32>,
    /// Ids that end generation (EOS, `<end_of_turn>`, ...).
    pub stop_ids: Vec<u32>,
}

fn token_str(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and the template and special tokens from the
    /// configs beside it. `eos_ids` are the config's EOS ids.
    pub fn load(dir: &Path, bos_id: Option<u32>, eos_ids: &[u32]) -> Result<Self, Error> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| Error::Load(format!("{}: {e}", path.display())))?;
        let tc: Value = std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|s| serde_json::from_str(&s).ok())
            .unwrap_or(Value::Null);
        let chat_template = std::fs::read_to_string(dir.join("chat_template.jinja"))
            .ok()
            .or_else(|| tc.get("chat_template").and_then(|v| v.as_str()).map(String::from));
        let bos_token = token_str(tc.get("bos_token")).or_else(|| bos_id.and_then(|i| inner.id_to_token(i)));
        let bos_id = bos_id.or_else(|| bos_token.as_deref().and_then(|t| inner.token_to_id(t)));
        let mut stop_ids: Vec<u32> = eos_ids.to_vec();
        // generation_config.json may list more stop ids.
        if let Some(gc) = std::fs::read_to_string(dir.join("generation_config.json")).ok().and_then(|s| serde_json::from_str::<Value>(&s).ok()) {
            match gc.get("eos_token_id") {
                Some(Value::Number(n)) => stop_ids.extend(n.as_u64().map(|x| x as u32)),
                Some(Value::Array(a)) => stop_ids.extend(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32)),
                _ => {}
            }
        }
        if let Some(eos) = token_str(tc.get("eos_token")).and_then(|t| inner.token_to_id(&t)) {
            stop_ids.push(eos);
        }
        // Chat models end a turn with <end_of_turn>.
        if let Some(eot) = inner.token_to_id("<end_of_turn>") {
            stop_ids.push(eot);
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        Ok(Tokenizer { inner, chat_template, bos_token, bos_id, stop_ids })
    }

    /// Encodes text; `add_bos` prepends BOS (when the checkpoint has one and the
    /// text does not already start with it).
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, Error> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Input(format!("tokenizer: {e}")))?;
        let mut ids = enc.get_ids().to_vec();
        if add_bos {
            if let Some(b) = self.bos_id {
                if ids.first() != Some(&b) {
                    ids.insert(0, b);
                }
            }
        }
        Ok(ids)
    }

    /// Decodes ids to text (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, Error> {
        self.inner.decode(ids, true).map_err(|e| Error::Input(format!("tokenizer: {e}")))
    }

    /// The token string of `id`.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// The checkpoint's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders the checkpoint's chat template (over [`Message`]s or [`PartsMessage`]s).
    pub fn apply_chat_template<M: serde::Serialize>(&self, messages: &[M], add_generation_prompt: bool) -> Result<String, Error> {
        let tpl = self.chat_template.as_deref().ok_or_else(|| Error::Input("this checkpoint has no chat template".into()))?;
        render_chat_template(tpl, self.bos_token.as_deref().unwrap_or_default(), messages, add_generation_prompt)
    }

    /// Chat prompt ids: the rendered template (which carries its own BOS).
    pub fn encode_chat(&self, messages: &[Message]) -> Result<Vec<u32>, Error> {
        let text = self.apply_chat_template(messages, true)?;
        // The template writes BOS as text; the tokenizer maps it to its id.
        self.encode(&text, true)
    }

    /// Text a token adds when appended to `prev` (streaming decode that keeps
    /// multi-byte characters and SentencePiece spaces intact).
    pub fn decode_incremental(&self, prev: &[u32], next: u32) -> Result<String, Error> {
        // A few tokens of context are enough to place spaces and finish characters.
        let prev = &prev[prev.len().saturating_sub(8)..];
        let before = self.decode(prev)?;
        if before.ends_with('\u{fffd}') {
            // The previous token ended mid-character: emit from the completed text.
            let mut all = prev.to_vec();
            all.push(next);
            let after = self.decode(&all)?;
            let keep = before.trim_end_matches('\u{fffd}').len();
            return Ok(if after.ends_with('\u{fffd}') { String::new() } else { after.get(keep..).unwrap_or("").to_string() });
        }
        let mut all = prev.to_vec();
        all.push(next);
        let after = self.decode(&all)?;
        if after.ends_with('\u{fffd}') {
            return Ok(String::new());
        }
        Ok(after.get(before.len()..).unwrap_or("").to_string())
    }
}

/// Renders a chat template (Jinja, as Hugging Face's `apply_chat_template` sees it) over
/// `messages`; `raise_exception` in the template becomes an input error.
pub fn render_chat_template<M: serde::Serialize>(tpl: &str, bos_token: &str, messages: &[M], add_generation_prompt: bool) -> Result<String, Error> {
    let mut env = minijinja::Environment::new();
    env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    let template_err = |e: minijinja::Error| Error::Input(format!("chat template: {e}"));
    env.add_template("chat", tpl).map_err(template_err)?;
    let t = env.get_template("chat").map_err(template_err)?;
    t.render(minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
    })
    .map_err(template_err)
}
