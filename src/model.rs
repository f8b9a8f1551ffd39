//! The one-sequence API: a [`Model`] is a [`Session`] on an engine of its own. For many
//! sequences on one model, see [`crate::engine`].
//!
//! ```no_run
//! use markbase::model::{Model, ModelOptions, GenerateParams};
//! let mut m = Model::load("models/gemma3-270m-q4", ModelOptions::default())?;
//! // Logits of every position of a token sequence.
//! let logits = m.logits(&[2, 818, 5279])?;
//! assert_eq!(logits.len(), 3);
//! // Streaming generation.
//! let prompt = m.tokenizer()?.encode("The capital of France is", true)?;
//! for piece in m.generate(&prompt, GenerateParams { max_tokens: 16, ..Default::default() })? {
//!     print!("{}", piece?.text);
//! }
//! # Ok::<(), markbase::model::Error>(())
//! ```

pub use crate::cpu::ops::SampleParams;
pub use crate::engine::{check_dir, DeviceKind, Engine, Error, ModelOptions, Session};
pub use crate::exec::{CpuExecutor, Executor, GraphKey, StepOutput};
pub use crate::generate::{GenerateParams, Generation, Piece, StopReason};

/// A session on an engine of its own.
pub type Model = Session;
