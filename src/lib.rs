//! markbase: a Gemma inference engine. It loads MLX checkpoints, compiles the
//! model's `config.json` into an op graph (crate `markbase-graph`), and runs it
//! on the GPU through wgpu/WGSL, or on the CPU reference executor.

pub mod audio;
pub mod batch;
pub mod bench;
pub mod bench_batch;
pub mod bench_vision;
pub mod cli;
pub mod cpu;
pub mod engine;
pub mod error;
pub mod exec;
pub mod generate;
pub mod gpu;
pub mod inspect;
pub mod loader;
pub mod memory;
pub mod model;
pub mod npy;
pub mod quant;
pub mod server;
pub mod synthetic;
pub mod tokenizer;
pub mod vision;
pub mod weights;

pub use error::Error;
pub use markbase_graph as graph;
