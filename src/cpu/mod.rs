//! CPU lowering of the ops and the CPU reference executor.

pub mod audio_ops;
pub mod exec;
pub mod ops;
pub mod vision_ops;
