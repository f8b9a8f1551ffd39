//! Streaming generation on a [`Session`]: sampling parameters, the token iterator, and
//! pipelined decode steps (the next step queued before the current token is read).

use crate::cpu::ops::SampleParams;
use crate::engine::{Error, Session};

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
        self.reset();
        if prompt.is_empty() {
            return Err(Error::Input("empty prompt".into()));
        }
        Ok(Generation { session: self, prompt: prompt.to_vec(), params, produced: vec![], next: None, done: false, in_flight: 0 })
    }
}

/// The generation iterator of [`Session::generate`].
pub struct Generation<'a> {
    session: &'a mut Session,
    prompt: Vec<u32>,
    params: GenerateParams,
    produced: Vec<u32>,
    next: Option<u32>,
    done: bool,
    /// Pipelined decode steps submitted and not read yet.
    in_flight: usize,
}

impl Generation<'_> {
    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.produced
    }

    fn step(&mut self) -> Result<Option<Piece>, Error> {
        if self.done || self.produced.len() >= self.params.max_tokens {
            return Ok(None);
        }
        let s = self.params.sampling;
        let pipelined = self.session.can_pipeline(&s);
        let more_after = |n: usize| n + 1 < self.params.max_tokens;
        let tok = if !self.prompt.is_empty() {
            let prompt = std::mem::take(&mut self.prompt);
            let t = self.session.forward(&prompt, false, Some(&s))?.token;
            if pipelined && more_after(self.produced.len()) && self.session.position() < self.session.max_context() {
                self.session.submit_decode(Some(t), &s)?;
                self.in_flight += 1;
            }
            t
        } else if pipelined {
            if self.in_flight == 0 {
                return Ok(None);
            }
            // Keep the GPU busy: the next step is queued before this one is read.
            if more_after(self.produced.len()) && self.session.position() < self.session.max_context() {
                self.session.submit_decode(None, &s)?;
                self.in_flight += 1;
            }
            self.in_flight -= 1;
            self.session.take_decode()?
        } else {
            match self.next.take() {
                Some(t) => t,
                None => return Ok(None),
            }
        };
        if self.params.stop_at_eos {
            if let Some(tk) = self.session.engine().tokenizer_opt() {
                if tk.stop_ids.contains(&tok) {
                    self.done = true;
                    return Ok(None);
                }
            } else if self.session.config.eos_token_ids.contains(&tok) {
                self.done = true;
                return Ok(None);
            }
        }
        let text = match (self.session.engine().tokenizer_opt(), self.params.text) {
            (Some(tk), true) => tk.decode_incremental(&self.produced, tok).map_err(Error::Input)?,
            _ => String::new(),
        };
        self.produced.push(tok);
        if !pipelined && self.produced.len() < self.params.max_tokens {
            if self.session.position() >= self.session.max_context() {
                self.done = true;
            } else {
                self.next = Some(self.session.forward(&[tok], false, Some(&s))?.token);
            }
        }
        Ok(Some(Piece { token: tok, text }))
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
