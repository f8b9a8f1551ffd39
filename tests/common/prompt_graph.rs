//! The prefill graph of a prompt with soft tokens, its merge of the soft rows into the
//! embeddings as an output: what the prompt tests compare against mlx-vlm's merged input.

use markbase::graph::passes::{compile, Compiled, PhasePolicy};
use markbase::graph::{BuildOptions, Graph};
use markbase::loader::Checkpoint;
use markbase::weights::Weights;

/// The prefill graph of `cp` over `t` tokens taking `soft_rows` soft rows, with the output
/// `merged` (the decoder's input), `planted` applied before compiling; and its weights.
pub fn merged_graph(cp: &Checkpoint, t: usize, soft_rows: usize, planted: Option<&dyn Fn(&mut Graph)>) -> (Compiled, Weights) {
    let mut g = cp.build(BuildOptions { soft_rows, ..BuildOptions::prefill(t, t) }).unwrap();
    let (w, _) = cp.load_weights(&g).unwrap();
    if let Some(f) = planted {
        f(&mut g);
    }
    let merge = g.g.node_indices().find(|&i| g.node(i).name == "merge_soft_rows").expect("the merge node");
    g.set_output("merged", merge);
    (compile(g, PhasePolicy::EmbedLayersHead).unwrap(), w)
}
