//! The errors of the public API: what went wrong, by kind, with the message a user needs
//! (the file, tensor, node, parameter or limit concerned).

/// An error of [`crate::engine`] (and so of [`crate::model`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The checkpoint: its files, tensors, tokenizer.
    #[error("{0}")]
    Load(String),
    /// The model's configuration or the graph built from it.
    #[error("{0}")]
    Config(String),
    /// The device: adapter, allocation, kernels, a failed step.
    #[error("{0}")]
    Device(String),
    /// The input: token ids, prompt, context length, options.
    #[error("{0}")]
    Input(String),
    /// Sampling parameters.
    #[error("{0}")]
    Sampling(String),
    /// An audio clip: its file, format, samples or length.
    #[error("{0}")]
    Audio(String),
}

impl Error {
    /// The kind as a word (`load`, `config`, `device`, `input`, `sampling`, `audio`).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Load(_) => "load",
            Error::Config(_) => "config",
            Error::Device(_) => "device",
            Error::Input(_) => "input",
            Error::Sampling(_) => "sampling",
            Error::Audio(_) => "audio",
        }
    }
}

/// The message, for callers that speak strings (the CLI).
impl From<Error> for String {
    fn from(e: Error) -> String {
        e.to_string()
    }
}

impl From<crate::loader::LoadError> for Error {
    fn from(e: crate::loader::LoadError) -> Error {
        use crate::loader::LoadError as L;
        match e {
            L::Build(m) => Error::Config(m),
            e @ L::Config { .. } => Error::Config(e.to_string()),
            e => Error::Load(e.to_string()),
        }
    }
}
