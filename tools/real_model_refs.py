#!/usr/bin/env python3
"""mlx-lm reference outputs of the real Gemma 3 270M MLX checkpoints.

For each checkpoint (default: q4, bf16, q8, mxfp4 under models/gemma3-270m-*),
the model is loaded with mlx-lm and every floating parameter (weights, norms,
quantization scales/biases) is cast to float32, so all activations are f32
(mlx's CPU quantized matmul with bf16 activations is noisy).

For each of 4 prompts (BOS-prefixed; the chat prompt is the rendered Gemma
chat template, which already starts with <bos>):
  * greedy-generate 32 tokens with mlx-lm's generate_step (argmax sampler,
    EOS not honoured: always 32 tokens);
  * forced decoding with a fresh KV cache, the way generate_step feeds the
    model: prompt[:-1] as one chunk, then prompt[-1] alone, then each generated
    token alone; the logits of the 32 single-token steps are recorded (row j
    predicts gen token j).

Written to models/gemma3-270m-refs/<checkpoint>.safetensors:
  p<k>.prompt_ids int32 [P]      p<k>.gen_ids int32 [32]
  p<k>.logits     f32 [32, V]    p<k>.top2_gap f32 [32]  (top1 - top2 logit)
and <checkpoint>.json beside it (prompt texts, ids, decoded text, stats).
A checkpoint is skipped when its refs are newer than its model.safetensors,
unless --force.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_model as rm  # noqa: E402

REFS = rm.MODELS / "gemma3-270m-refs"
N_GEN = 32
CHECKPOINTS = ["q4", "bf16", "q8", "mxfp4"]


def prompts(tok) -> list[dict]:
    chat = [{"role": "user", "content": "Write a haiku about the sea."}]
    chat_text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    out = []
    for text in ["1, 2, 3, 4,", "The capital of France is", "def fibonacci(n):"]:
        out.append({"kind": "plain", "text": text, "ids": list(tok.encode(text))})
    out.append(
        {
            "kind": "chat",
            "messages": chat,
            "text": chat_text,
            "ids": list(tok.encode(chat_text, add_special_tokens=False)),
        }
    )
    for p in out:
        assert p["ids"][0] == 2 and p["ids"][1] != 2, p
    return out


def forced_logits(model, prompt_ids: list[int], gen_ids: list[int]):
    """Logits predicting gen_ids[j], fed like generate_step does."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if len(prompt_ids) > 1:
        mx.eval(model(mx.array(prompt_ids[:-1], dtype=mx.int32)[None], cache=cache))
    rows = []
    feed = [prompt_ids[-1]] + gen_ids[:-1]
    for t in feed:
        logits = model(mx.array([[t]], dtype=mx.int32), cache=cache)[0, -1]
        rows.append(np.array(logits.astype(mx.float32)))
    return np.stack(rows)


def make_refs(name: str, force: bool) -> dict | None:
    import mlx.core as mx
    import numpy as np

    ckpt = rm.variant_dir(name)
    weights = ckpt / "model.safetensors"
    if not weights.exists():
        print(f"[refs] {name}: no checkpoint at {ckpt}", flush=True)
        return None
    st, js = REFS / f"{name}.safetensors", REFS / f"{name}.json"
    if (
        not force
        and st.exists()
        and js.exists()
        and min(st.stat().st_mtime, js.stat().st_mtime) >= weights.stat().st_mtime
    ):
        print(f"[refs] {name}: present", flush=True)
        return json.loads(js.read_text())

    t0 = time.time()
    model, tok = rm.load_f32(ckpt)
    tensors = {}
    meta = {
        "checkpoint": str(ckpt.relative_to(rm.ROOT)),
        "dtype": "float32 (all floating parameters cast; f32 activations)",
        "mlx": mx.__version__,
        "mlx_lm": __import__("mlx_lm").__version__,
        "n_gen": N_GEN,
        "feeding": "prompt[:-1] in one call, then prompt[-1], then gen tokens one by one (fresh cache)",
        "note": "mlx-lm multiplies embeddings by sqrt(hidden_size) rounded to bf16 (25.25), also in f32",
        "prompts": [],
    }
    for k, p in enumerate(prompts(tok)):
        gen = rm.greedy(model, p["ids"], N_GEN)
        logits = forced_logits(model, p["ids"], gen)
        assert logits.shape == (N_GEN, rm.CONFIG["vocab_size"]), logits.shape
        top2 = np.sort(logits, axis=-1)[:, -2:]
        gap = (top2[:, 1] - top2[:, 0]).astype(np.float32)
        argmax = logits.argmax(axis=-1)
        agree = int((argmax == np.asarray(gen)).sum())
        tensors[f"p{k}.prompt_ids"] = mx.array(np.asarray(p["ids"], dtype=np.int32))
        tensors[f"p{k}.gen_ids"] = mx.array(np.asarray(gen, dtype=np.int32))
        tensors[f"p{k}.logits"] = mx.array(logits.astype(np.float32))
        tensors[f"p{k}.top2_gap"] = mx.array(gap)
        entry = {k2: v for k2, v in p.items()}
        entry.update(
            {
                "key": f"p{k}",
                "gen_ids": gen,
                "gen_text": tok.decode(gen),
                "argmax_agrees": agree,
                "top2_gap_min": float(gap.min()),
                "top2_gap_median": float(np.median(gap)),
                "n_gap_below_0.01": int((gap < 0.01).sum()),
                "n_gap_below_0.1": int((gap < 0.1).sum()),
            }
        )
        meta["prompts"].append(entry)
        print(
            f"[refs] {name} p{k} {p['text'][-40:]!r} -> {entry['gen_text']!r}\n"
            f"       argmax==gen {agree}/{N_GEN}, top2 gap min {gap.min():.4f} "
            f"median {np.median(gap):.3f}",
            flush=True,
        )
    REFS.mkdir(parents=True, exist_ok=True)
    tmp = st.with_suffix(".tmp.safetensors")
    mx.save_safetensors(str(tmp), tensors, metadata={"format": "mlx", "checkpoint": name})
    tmp.replace(st)
    meta["seconds"] = round(time.time() - t0, 1)
    js.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"[refs] {name}: wrote {st.relative_to(rm.ROOT)} ({meta['seconds']}s)", flush=True)
    return meta


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--checkpoints", default=",".join(CHECKPOINTS))
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (mlx's CPU decode is mostly one core)")
    args = ap.parse_args()
    names = [c for c in args.checkpoints.split(",") if c]
    for name in names:
        if name not in rm.VARIANTS:
            ap.error(f"unknown checkpoint {name}")
    if args.jobs > 1 and len(names) > 1:
        import subprocess

        groups = [names[i :: args.jobs] for i in range(min(args.jobs, len(names)))]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--checkpoints", ",".join(g)] + (["--force"] if args.force else [])
            )
            for g in groups
        ]
        rcs = [p.wait() for p in procs]
        return 1 if any(rcs) else 0

    failed = []
    for name in names:
        meta = make_refs(name, args.force)
        if meta is None:
            failed.append(f"{name}: checkpoint missing")
            continue
        for p in meta["prompts"]:
            if p["argmax_agrees"] != N_GEN:
                failed.append(f"{name} {p['key']}: forced argmax != greedy ({p['argmax_agrees']}/{N_GEN})")
    for f in failed:
        print(f"[refs] FAILED: {f}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
