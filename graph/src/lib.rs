//! markbase-graph: the op-graph IR of markbase, Gemma model builders, compiler
//! passes (shape validation, liveness + buffer assignment, phase scheduling,
//! invariant checking) and deterministic dumps. No GPU dependency.

pub mod audio;
pub mod builder;
pub mod config;
pub mod dump;
pub mod fuse;
pub mod ir;
pub mod models;
pub mod ops;
pub mod passes;
pub mod quant;
pub mod tower;
pub mod vision;

pub use builder::{build, build_from_config, BuildOptions, Outputs, WeightResolver};
pub use fuse::FuseOptions;
pub use config::{Family, LayerType, ModelConfig};
pub use ir::{Graph, GraphKind, Node, NodeKind};
pub use ops::{DType, Op, TensorType};
pub use passes::{compile, Compiled, PhasePolicy, Storage};
pub use quant::{FloatType, QuantMode, QuantSpec, WeightFormat};
