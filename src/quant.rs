//! Decoding of MLX quantized weights on the CPU.
