//! Prompts with images and audio clips for a [`Session`]: text, images and clips in order,
//! each one's placeholder run where Hugging Face's processors put it, and their soft tokens.
//!
//! ```no_run
//! use markbase::model::{GenerateParams, Model, ModelOptions};
//! use markbase::vision::{load_image, prompt::Part};
//!
//! let mut m = Model::load("models/gemma-3-4b-it", ModelOptions::default())?;
//! let parts = [Part::Image(load_image("cat.png".as_ref())?), Part::Text("What is in this picture?".into())];
//! let p = m.prompt(&parts, true)?; // through the chat template
//! for piece in m.generate_prompt(&p, GenerateParams::default())? {
//!     print!("{}", piece?.text);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use markbase_graph::audio::AudioConfig;
use markbase_graph::vision::{TowerKind, VisionConfig};

use crate::engine::{Engine, Error, Session};
use crate::generate::{GenerateParams, Generation};
use crate::tokenizer::{ContentPart, PartsMessage, Tokenizer};

use super::encode::{Modality, Placeholders};
use super::{RgbImage, SoftTokens};

/// A prompt ready for a session: token ids holding each image's and clip's placeholder run,
/// and the soft tokens that fill the runs (each kind in order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Prompt {
    /// The ids, each image and clip as its run of placeholders (the image or audio token).
    pub ids: Vec<u32>,
    /// The soft tokens of the runs, in order.
    pub soft: Vec<SoftTokens>,
}

impl Prompt {
    /// The prompt after its first `from` tokens, as `(start, rest)`: `start` is `from`, or the
    /// start of the placeholder run `from` would cut (a run is fed whole), and `rest` holds the
    /// soft tokens of the runs after it.
    pub fn tail(&self, from: usize, ph: &Placeholders) -> (usize, Prompt) {
        let mut start = from.min(self.ids.len());
        while start > 0 && start < self.ids.len() && ph.holds(self.ids[start]) && self.ids[start - 1] == self.ids[start] {
            start -= 1;
        }
        let mut soft = vec![];
        for kind in [Modality::Image, Modality::Audio] {
            let Some(id) = ph.id(kind) else { continue };
            let before = self.ids[..start].iter().filter(|&&t| t == id).count();
            let of_kind: Vec<&SoftTokens> = self.soft.iter().filter(|s| s.kind == kind).collect();
            let width = of_kind.first().map_or(0, |s| s.width);
            let rows: Vec<f32> = of_kind.iter().flat_map(|s| s.data.iter().copied()).skip(before * width).collect();
            if !rows.is_empty() {
                soft.push(SoftTokens { tokens: rows.len() / width, width, data: rows, kind });
            }
        }
        (start, Prompt { ids: self.ids[start..].to_vec(), soft })
    }
}

/// One piece of a prompt, in order.
#[derive(Clone, Debug)]
pub enum Part {
    /// Text (tokenized with the rest).
    Text(String),
    /// An image: its soft tokens, where the processor puts them.
    Image(RgbImage),
    /// An audio clip, mono samples at the feature extractor's rate (16 kHz; see
    /// [`crate::audio::load`]): its soft tokens, where the processor puts them.
    Audio(Vec<f32>),
}

/// The text that stands for one image before the processor expands it (what a chat template
/// writes for an image item): Gemma 3's `<start_of_image>`, Gemma 4's `<|image|>`.
pub fn image_marker(tk: &Tokenizer, vc: &VisionConfig) -> Result<String, Error> {
    token(tk, if vc.kind == TowerKind::Siglip { vc.boi_token } else { vc.image_token })
}

fn token(tk: &Tokenizer, id: u32) -> Result<String, Error> {
    tk.token(id).ok_or_else(|| Error::Load(format!("the tokenizer has no token of id {id} (an image token of config.json)")))
}

/// `text` with each image marker replaced by the run of the next image of `images` as HF's
/// processor writes it: Gemma 3 `"\n\n" boi, N × image, eoi "\n\n"` (with pan-and-scan crops,
/// HF's sentence around the whole image's run and the crops'), Gemma 4 `boi, N × image, eoi`.
pub fn expand_markers(tk: &Tokenizer, vc: &VisionConfig, text: &str, images: &[SoftTokens]) -> Result<String, Error> {
    let marker = image_marker(tk, vc)?;
    let pieces: Vec<&str> = text.split(marker.as_str()).collect();
    if pieces.len() - 1 != images.len() {
        return Err(Error::Input(format!("the prompt has {} image markers ({marker}) for {} images", pieces.len() - 1, images.len())));
    }
    let (boi, img, eoi) = (token(tk, vc.boi_token)?, token(tk, vc.image_token)?, token(tk, vc.eoi_token)?);
    let run = |n: usize| format!("{boi}{}{eoi}", img.repeat(n));
    let mut out = pieces[0].to_string();
    for (s, piece) in images.iter().zip(&pieces[1..]) {
        match vc.kind {
            TowerKind::Siglip => {
                let per = vc.tokens_per_image.max(1);
                let full = format!("\n\n{}\n\n", run(per));
                let crops = (s.tokens / per).saturating_sub(1);
                if crops == 0 {
                    out.push_str(&full);
                } else {
                    let all = vec![full.as_str(); crops].join(" ");
                    out.push_str(&format!("Here is the original image {full} and here are some crops to help you see better {all}"));
                }
            }
            TowerKind::Gemma4Vit => out.push_str(&run(s.tokens)),
        }
        out.push_str(piece);
    }
    Ok(out)
}

/// The text that stands for one clip before the processor expands it (what a chat template
/// writes for an audio item): Gemma 4's `<|audio|>`.
pub fn audio_marker(tk: &Tokenizer, ac: &AudioConfig) -> Result<String, Error> {
    token(tk, ac.audio_token)
}

/// `text` with each audio marker replaced by the run of the next clip of `clips` as HF's
/// processor writes it: `boa, N × audio, eoa`.
pub fn expand_audio_markers(tk: &Tokenizer, ac: &AudioConfig, text: &str, clips: &[SoftTokens]) -> Result<String, Error> {
    let marker = audio_marker(tk, ac)?;
    let pieces: Vec<&str> = text.split(marker.as_str()).collect();
    if pieces.len() - 1 != clips.len() {
        return Err(Error::Input(format!("the prompt has {} audio markers ({marker}) for {} clips", pieces.len() - 1, clips.len())));
    }
    let (boa, eoa) = (token(tk, ac.boa_token)?, token(tk, ac.eoa_token)?);
    let mut out = pieces[0].to_string();
    for (s, piece) in clips.iter().zip(&pieces[1..]) {
        out.push_str(&format!("{boa}{}{eoa}", marker.repeat(s.tokens)));
        out.push_str(piece);
    }
    Ok(out)
}

impl Session {
    /// The soft tokens of each image (the checkpoint's vision tower, on the session's device).
    pub fn encode_images(&self, images: &[RgbImage]) -> Result<Vec<SoftTokens>, Error> {
        images.iter().map(|i| self.engine().encode_image(i)).collect()
    }

    /// The soft tokens of each clip (mono samples at the feature extractor's rate; the
    /// checkpoint's audio tower, on the session's device).
    pub fn encode_clips(&self, clips: &[Vec<f32>]) -> Result<Vec<SoftTokens>, Error> {
        clips.iter().map(|c| self.engine().encode_audio(c)).collect()
    }

    /// The prompt of `parts` in order: with `chat`, one user message through the checkpoint's
    /// chat template (an image item per image, an audio item per clip); else the text with a
    /// marker per image and clip and BOS first. Images and clips are encoded here.
    pub fn prompt(&self, parts: &[Part], chat: bool) -> Result<Prompt, Error> {
        let imgs: Vec<RgbImage> = parts.iter().filter_map(|p| if let Part::Image(i) = p { Some(i.clone()) } else { None }).collect();
        let clips: Vec<Vec<f32>> = parts.iter().filter_map(|p| if let Part::Audio(c) = p { Some(c.clone()) } else { None }).collect();
        if !imgs.is_empty() {
            self.engine().vision_or_err()?;
        }
        if !clips.is_empty() {
            self.engine().audio_or_err()?;
        }
        let mut soft = self.encode_images(&imgs)?;
        soft.extend(self.encode_clips(&clips)?);
        if chat {
            let content = parts.iter().map(|p| match p {
                Part::Text(t) => ContentPart::Text { text: t.clone() },
                Part::Image(_) => ContentPart::Image,
                Part::Audio(_) => ContentPart::Audio,
            });
            return self.chat_prompt(&[PartsMessage::new("user", content.collect())], soft);
        }
        let tk = self.tokenizer()?;
        let mut text = String::new();
        for p in parts {
            match p {
                Part::Text(t) => text.push_str(t),
                Part::Image(_) => text.push_str(&image_marker(tk, self.engine().vision_or_err()?)?),
                Part::Audio(_) => text.push_str(&audio_marker(tk, self.engine().audio_or_err()?)?),
            }
        }
        self.text_prompt(&text, soft, true)
    }

    /// The prompt of `messages` through the checkpoint's chat template (with the generation
    /// prompt): `soft` are the soft tokens of their image and audio items, each kind in order.
    pub fn chat_prompt(&self, messages: &[PartsMessage], soft: Vec<SoftTokens>) -> Result<Prompt, Error> {
        let text = self.tokenizer()?.apply_chat_template(messages, true)?;
        rendered_chat_prompt(self.engine(), messages, &text, soft)
    }

    /// The prompt of `text`, each image marker in it expanded into the next image's run and
    /// each audio marker into the next clip's.
    pub fn text_prompt(&self, text: &str, soft: Vec<SoftTokens>, add_bos: bool) -> Result<Prompt, Error> {
        expand_prompt(self.engine(), text, soft, add_bos)
    }

    /// Streams up to `max_tokens` tokens after the prompt `p` (a fresh sequence).
    pub fn generate_prompt(&mut self, p: &Prompt, params: GenerateParams) -> Result<Generation<'_>, Error> {
        params.sampling.validate().map_err(Error::Sampling)?;
        self.reset();
        self.generate_after_with_images(&p.ids, &p.soft, params)
    }
}

/// The prompt of `text` (a chat template's rendering of `messages`, with the generation
/// prompt): `soft` are the soft tokens of their image and audio items, each kind in order.
pub fn rendered_chat_prompt(engine: &Engine, messages: &[PartsMessage], text: &str, soft: Vec<SoftTokens>) -> Result<Prompt, Error> {
    for (kind, n) in [(Modality::Image, messages.iter().map(|m| m.images()).sum::<usize>()), (Modality::Audio, messages.iter().map(|m| m.clips()).sum())] {
        let given = soft.iter().filter(|s| s.kind == kind).count();
        if n != given {
            return Err(Error::Input(format!("the messages have {n} {} items for {given} soft-token runs", kind.name())));
        }
    }
    expand_prompt(engine, text, soft, true).map_err(|e| match e {
        Error::Input(m) if m.contains(" markers (") => Error::Input(format!("{m}: the chat template does not render these items")),
        e => e,
    })
}

/// The prompt of `text` for `engine`'s model: each image marker in it expanded into the next
/// image's run and each audio marker into the next clip's, then tokenized.
pub fn expand_prompt(engine: &Engine, text: &str, soft: Vec<SoftTokens>, add_bos: bool) -> Result<Prompt, Error> {
    let tk = engine.tokenizer()?;
    let (images, clips): (Vec<SoftTokens>, Vec<SoftTokens>) = soft.iter().cloned().partition(|s| s.kind == Modality::Image);
    let text = match engine.vision_config() {
        Some(vc) => expand_markers(tk, vc, text, &images)?,
        None if images.is_empty() => text.to_string(),
        None => return Err(engine.vision_or_err().unwrap_err()),
    };
    let text = match engine.audio_config() {
        Some(ac) => expand_audio_markers(tk, ac, &text, &clips)?,
        None if clips.is_empty() => text,
        None => return Err(engine.audio_or_err().unwrap_err()),
    };
    Ok(Prompt { ids: tk.encode(&text, add_bos)?, soft })
}
