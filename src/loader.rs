//! Loading MLX checkpoints (filled in by the loader work).
