//! Deterministic dumps of a compiled graph: text, JSON (schema in
//! `docs/graph-json.md`) and Graphviz DOT.

use serde_json::{json, Value};

use crate::ir::NodeKind;
use crate::passes::{Compiled, Storage};

/// Schema version of the JSON dump.
pub const JSON_SCHEMA_VERSION: u32 = 1;

fn storage_str(s: Storage) -> String {
    match s {
        Storage::Weight(i) => format!("weight#{i}"),
        Storage::Input(i) => format!("input#{i}"),
        Storage::State(i) => format!("state#{i}"),
        Storage::Pool(b) => format!("buf{b}"),
    }
}

/// Bytes a node's value occupies (stored bytes for weights).
fn node_bytes(c: &Compiled, n: petgraph::graph::NodeIndex) -> usize {
    let node = c.graph.node(n);
    match &node.kind {
        NodeKind::Weight { weight } => weight.stored_bytes(),
        _ => node.ty.bytes(),
    }
}

fn kind_str(k: &NodeKind) -> (&'static str, String) {
    match k {
        NodeKind::Input { input } => ("input", format!("{input:?}").to_lowercase()),
        NodeKind::Weight { .. } => ("weight", "weight".into()),
        NodeKind::State { .. } => ("state", "kv_cache".into()),
        NodeKind::Op { op } => ("op", op.name().to_string()),
    }
}

/// The JSON dump.
pub fn to_json(c: &Compiled) -> Value {
    let g = &c.graph;
    let nodes: Vec<Value> = g
        .g
        .node_indices()
        .map(|n| {
            let node = g.node(n);
            let (class, op) = kind_str(&node.kind);
            let inputs: Vec<u32> = g.inputs(n).iter().map(|&i| g.node(i).id).collect();
            let mut v = json!({
                "id": node.id,
                "name": node.name,
                "class": class,
                "op": op,
                "layer": node.layer,
                "inputs": inputs,
                "shape": node.ty.shape,
                "dtype": node.ty.dtype,
                "storage": storage_str(c.alloc.storage[n.index()]),
                "phase": c.schedule.phase_of[n.index()],
                "bytes": node_bytes(c, n),
            });
            match &node.kind {
                NodeKind::Op { op } => {
                    v["attrs"] = serde_json::to_value(op).unwrap_or(Value::Null);
                    let weights: Vec<String> =
                        g.inputs(n).iter().filter_map(|&i| g.node(i).weight().map(|w| w.name.clone())).collect();
                    v["weights"] = json!(weights);
                    if let Some(rule) = node.rule {
                        v["fused_by"] = json!(rule);
                    }
                }
                NodeKind::Weight { weight } => {
                    v["weight"] = json!({
                        "name": weight.name,
                        "module": weight.module,
                        "format": weight.format,
                    });
                }
                NodeKind::State { state } => v["state"] = serde_json::to_value(state).unwrap_or(Value::Null),
                NodeKind::Input { .. } => {}
            }
            v
        })
        .collect();
    let phases: Vec<Value> = c
        .schedule
        .phases
        .iter()
        .zip(&c.schedule.names)
        .enumerate()
        .map(|(i, (p, name))| json!({"index": i, "name": name, "nodes": p.iter().map(|&n| g.node(n).id).collect::<Vec<_>>()}))
        .collect();
    let outputs: Vec<Value> = g.outputs.iter().map(|(name, n)| json!({"name": name, "node": g.node(*n).id})).collect();
    let weight_bytes: usize = g.weights().map(|(_, w)| w.stored_bytes()).sum();
    json!({
        "schema": JSON_SCHEMA_VERSION,
        "kind": g.kind,
        "tokens": g.tokens,
        "nodes": nodes,
        "outputs": outputs,
        "phases": phases,
        "buffers": c.alloc.pool_sizes.iter().enumerate().map(|(i, s)| json!({"id": i, "bytes": s})).collect::<Vec<_>>(),
        "summary": {
            "nodes": g.g.node_count(),
            "ops": g.op_nodes().count(),
            "phases": c.schedule.phases.len(),
            "weight_bytes": weight_bytes,
            "intermediate_bytes_before": c.alloc.bytes_before,
            "intermediate_bytes_after": c.alloc.bytes_after,
        }
    })
}

/// One line per node.
pub fn to_text(c: &Compiled) -> String {
    let g = &c.graph;
    let mut s = String::new();
    let weight_bytes: usize = g.weights().map(|(_, w)| w.stored_bytes()).sum();
    s.push_str(&format!(
        "# {:?} graph, {} tokens: {} nodes, {} ops, {} phases, {} pool buffers\n",
        g.kind,
        g.tokens,
        g.g.node_count(),
        g.op_nodes().count(),
        c.schedule.phases.len(),
        c.alloc.pool_sizes.len()
    ));
    s.push_str(&format!(
        "# weights {} bytes; intermediates {} bytes before sharing, {} after\n",
        weight_bytes, c.alloc.bytes_before, c.alloc.bytes_after
    ));
    for (i, name) in c.schedule.names.iter().enumerate() {
        s.push_str(&format!("# phase {i}: {name} ({} ops)\n", c.schedule.phases[i].len()));
    }
    for n in g.g.node_indices() {
        let node = g.node(n);
        let (class, op) = kind_str(&node.kind);
        let ins: Vec<String> = g.inputs(n).iter().map(|&i| format!("%{}", g.node(i).id)).collect();
        let phase = c.schedule.phase_of[n.index()].map(|p| format!("p{p}")).unwrap_or_else(|| "-".into());
        let extra = match &node.kind {
            NodeKind::Op { op } => match node.rule {
                Some(rule) => format!("{} [fused: {rule}]", op.attrs()).trim_start().to_string(),
                None => op.attrs(),
            },
            NodeKind::Weight { weight } => format!("{} [{}]", weight.name, weight.format.describe()),
            _ => String::new(),
        };
        s.push_str(&format!(
            "%{:<5} {:<24} {:<6} {:<14} ({}) -> {} @{} {} {}B {}\n",
            node.id,
            node.name,
            class,
            op,
            ins.join(", "),
            node.ty.describe(),
            storage_str(c.alloc.storage[n.index()]),
            phase,
            node_bytes(c, n),
            extra
        ));
    }
    for (name, n) in &g.outputs {
        s.push_str(&format!("output {name} = %{}\n", g.node(*n).id));
    }
    s
}

fn dot_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Graphviz DOT: one cluster per phase; weights, inputs and states as boxes.
pub fn to_dot(c: &Compiled) -> String {
    let g = &c.graph;
    let mut s = String::from("digraph markbase {\n  rankdir=TB;\n  node [fontname=\"monospace\", fontsize=10];\n");
    for (pi, ph) in c.schedule.phases.iter().enumerate() {
        s.push_str(&format!("  subgraph cluster_p{pi} {{\n    label=\"phase {pi}: {}\";\n", dot_escape(&c.schedule.names[pi])));
        for &n in ph {
            let node = g.node(n);
            let (_, op) = kind_str(&node.kind);
            let op = match node.rule {
                Some(rule) => format!("{op} [fused: {rule}]"),
                None => op,
            };
            s.push_str(&format!(
                "    n{} [shape=ellipse, label=\"%{} {}\\n{}\\n{}\"];\n",
                node.id,
                node.id,
                dot_escape(&node.name),
                op,
                dot_escape(&format!("{} @{}", node.ty.describe(), storage_str(c.alloc.storage[n.index()])))
            ));
        }
        s.push_str("  }\n");
    }
    for n in g.g.node_indices() {
        let node = g.node(n);
        let (class, _) = kind_str(&node.kind);
        if class == "op" {
            continue;
        }
        // each line escaped on its own: the `\n` between them is DOT's line break
        let label = match &node.kind {
            NodeKind::Weight { weight } => format!("{}\\n{}", dot_escape(&weight.name), dot_escape(&weight.format.describe())),
            _ => format!("{}\\n{}", dot_escape(&node.name), dot_escape(&node.ty.describe())),
        };
        let color = match class {
            "weight" => "lightblue",
            "state" => "lightyellow",
            _ => "lightgrey",
        };
        s.push_str(&format!(
            "  n{} [shape=box, style=filled, fillcolor={color}, label=\"%{} {}\"];\n",
            node.id,
            node.id,
            label
        ));
    }
    for n in g.g.node_indices() {
        for i in g.inputs(n) {
            s.push_str(&format!("  n{} -> n{};\n", g.node(i).id, g.node(n).id));
        }
    }
    s.push_str("}\n");
    s
}
