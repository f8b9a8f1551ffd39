//! Streaming generation on a [`Session`]: sampling parameters, the token iterator, why it
//! stopped, and pipelined decode steps (the next step queued before the current token is read).

use crate::cpu::ops::SampleParams;
use crate::engine::{Error, Session};
use crate::vision::{Modality, SoftTokens};

/// Parameters of [`Session::generate`].
#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SampleParams,
    /// Stop at the checkpoint's stop tokens (EOS, `<end_of_turn>`).
    pub stop_at_eos: bool,
    /// Decode tokens to text while streaming (needs a tokenizer).
    pub text: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams { max_tokens: 128, sampling: SampleParams::default(), stop_at_eos: true, text: true }
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `max_tokens` tokens were generated.
    MaxTokens,
    /// A stop token (EOS, `<end_of_turn>`) was sampled.
    Stop,
    /// The sequence filled the context (`max_context` tokens).
    ContextFull,
}

/// One generated token.
#[derive(Clone, Debug)]
pub struct Piece {
    pub token: u32,
    /// The text this token adds (empty while a character is incomplete).
    pub text: String,
}

impl Session {
    /// Streams up to `max_tokens` tokens after `prompt` (a fresh sequence).
    pub fn generate(&mut self, prompt: &[u32], params: GenerateParams) -> Result<Generation<'_>, Error> {
        params.sampling.validate().map_err(Error::Sampling)?;
        self.reset();
        self.generate_after(prompt, params)
    }

    /// Streams up to `max_tokens` tokens after the current sequence extended by `ids`:
    /// the cached keys and values of the sequence so far are kept (a chat's next turn).
    pub fn generate_after(&mut self, ids: &[u32], params: GenerateParams) -> Result<Generation<'_>, Error> {
        self.generate_after_with_images(ids, &[], params)
    }

    /// [`Session::generate_after`] of `ids` whose image placeholder runs take the soft tokens
    /// of `images` in order (see [`Session::forward_with_images`]).
    pub fn generate_after_with_images(&mut self, ids: &[u32], images: &[SoftTokens], params: GenerateParams) -> Result<Generation<'_>, Error> {
        params.sampling.validate().map_err(Error::Sampling)?;
        if ids.is_empty() {
            return Err(Error::Input("empty prompt".into()));
        }
        if self.position() + ids.len() > self.max_context() {
            let soft: usize = images.iter().map(|i| i.tokens).sum();
            let count = |kind: Modality, one: &str| match images.iter().filter(|s| s.kind == kind).count() {
                0 => None,
                1 => Some(format!("1 {one}")),
                n => Some(format!("{n} {one}s")),
            };
            let of_images = match [count(Modality::Image, "image"), count(Modality::Audio, "clip")].into_iter().flatten().collect::<Vec<_>>() {
                v if v.is_empty() => String::new(),
                v => format!(" ({soft} of them the soft tokens of {})", v.join(" and ")),
            };
            return Err(Error::Input(if self.position() == 0 {
                format!(
                    "the prompt has {} tokens{of_images}, more than the context of {} tokens: raise the max context (--max-context) or shorten the prompt",
                    ids.len(),
                    self.max_context()
                )
            } else {
                format!("context full: {} + {} tokens{of_images} exceed the context of {} tokens", self.position(), ids.len(), self.max_context())
            }));
        }
        let images = images.to_vec();
        Ok(Generation { session: self, prompt: ids.to_vec(), images, params, produced: vec![], pending: None, done: false, stop: None, in_flight: 0 })
    }
}

/// The generation iterator of [`Session::generate`].
pub struct Generation<'a> {
    session: &'a mut Session,
    prompt: Vec<u32>,
    /// The soft tokens of the prompt's images, in order.
    images: Vec<SoftTokens>,
    params: GenerateParams,
    produced: Vec<u32>,
    /// Unpipelined: the last token, fed when the next one is asked for.
    pending: Option<u32>,
    done: bool,
    stop: Option<StopReason>,
    /// Pipelined decode steps submitted and not read yet.
    in_flight: usize,
}

impl Generation<'_> {
    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.produced
    }

    /// Why the generation ended (`None` while it runs, or after an error).
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    fn finish(&mut self, why: StopReason) -> Result<Option<Piece>, Error> {
        self.done = true;
        self.stop = Some(why);
        Ok(None)
    }

    fn step(&mut self) -> Result<Option<Piece>, Error> {
        if self.done {
            return Ok(None);
        }
        if self.produced.len() >= self.params.max_tokens {
            return self.finish(StopReason::MaxTokens);
        }
        let s = self.params.sampling;
        let pipelined = self.session.can_pipeline(&s);
        let more_after = |n: usize| n + 1 < self.params.max_tokens;
        let tok = if !self.prompt.is_empty() {
            let prompt = std::mem::take(&mut self.prompt);
            let images = std::mem::take(&mut self.images);
            let t = self.session.forward_with_images(&prompt, &images, false, Some(&s))?.token;
            if pipelined && more_after(self.produced.len()) && self.session.position() < self.session.max_context() {
                self.session.submit_decode(Some(t), &s)?;
                self.in_flight += 1;
            }
            t
        } else if pipelined {
            if self.in_flight == 0 {
                // a step is always queued while tokens remain, unless the context is full
                return self.finish(StopReason::ContextFull);
            }
            // Keep the GPU busy: the next step is queued before this one is read.
            if more_after(self.produced.len()) && self.session.position() < self.session.max_context() {
                self.session.submit_decode(None, &s)?;
                self.in_flight += 1;
            }
            self.in_flight -= 1;
            self.session.take_decode()?
        } else {
            let Some(t) = self.pending.take() else {
                return self.finish(StopReason::ContextFull);
            };
            if self.session.position() >= self.session.max_context() {
                return self.finish(StopReason::ContextFull);
            }
            // the step runs when its token is asked for, so that timing a piece times its step
            self.session.forward(&[t], false, Some(&s))?.token
        };
        let stops = match self.session.engine().tokenizer_opt() {
            Some(tk) => tk.stop_ids.contains(&tok),
            None => self.session.config.eos_token_ids.contains(&tok),
        };
        if self.params.stop_at_eos && stops {
            return self.finish(StopReason::Stop);
        }
        let text = match (self.session.engine().tokenizer_opt(), self.params.text) {
            (Some(tk), true) => tk.decode_incremental(&self.produced, tok)?,
            _ => String::new(),
        };
        self.produced.push(tok);
        if !pipelined {
            self.pending = Some(tok);
        }
        Ok(Some(Piece { token: tok, text }))
    }
}

impl Drop for Generation<'_> {
    /// Reads the decode steps still queued, so that the sequence stays consistent
    /// (a following [`Session::generate_after`] continues it).
    fn drop(&mut self) {
        while self.in_flight > 0 {
            self.in_flight -= 1;
            if self.session.take_decode().is_err() {
                break;
            }
        }
    }
}

impl Iterator for Generation<'_> {
    type Item = Result<Piece, Error>;
    fn next(&mut self) -> Option<Self::Item> {
        match self.step() {
            Ok(Some(p)) => Some(Ok(p)),
            Ok(None) => None,
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}
