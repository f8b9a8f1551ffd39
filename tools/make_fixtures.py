#!/usr/bin/env python3
"""Generate tiny Gemma-family checkpoints in genuine MLX format + reference outputs.

Method: the reference-harness notes of the architecture spec (mlx + mlx-lm on the CPU are the reference).

For every family a fake Hugging Face source directory is built (bf16 tensors under HF
names, HF-style config, WordLevel tokenizer), then converted with mlx-lm's own code
(`load` -> cast bf16 -> `quantize_model` -> `save`), exactly like `mlx_lm.convert`.
The saved directory is reloaded with `mlx_lm.utils.load_model`, every floating tensor is
cast to float32 and the f32 references are computed (prefill, teacher-forced decode,
per-layer hidden states).

Also written: quantization unit cases (tests/fixtures/quant) and broken checkpoints
(tests/fixtures/broken).

Requirements: python3.11, mlx[cpu]==0.32.4, mlx-lm==0.32.2, numpy (no torch).
Usage:  python3 tools/make_fixtures.py            (everything, ~2-4 min on 2 cores)
        python3 tools/make_fixtures.py --only gemma3_text-q4 --only quant
"""

import argparse
import copy
import json
import math
import re
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten

import mlx_lm
import mlx_lm.utils as mu
from mlx_lm.convert import mixed_quant_predicate_builder
from mlx_lm.models import gemma4_text
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures"

EXPECTED_VERSIONS = {"mlx": "0.32.4", "mlx_lm": "0.32.2"}

# Prompt of the harness (BOS=2 first). gemma3n: position 5 = 511 and position 21 = 448
# (>= vocab_size_per_layer_input=448, so the PLE lookup hits the clamp to row 0).
TOKENS = [2, 214, 297, 56, 207, 375, 155, 508, 146, 180, 282, 236,
          157, 33, 174, 161, 239, 383, 285, 377, 445, 123, 371, 479]
TOKENS_3N = list(TOKENS)
TOKENS_3N[5] = 511
TOKENS_3N[21] = 448
PREFILL_P = 20  # decode: prefill tokens[:20], then 4 single-token steps

H = 128
VOCAB = 512
WINDOW = 8

SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}

# --------------------------------------------------------------------------------------
# Family definitions (HF-style configs of the fake sources)
# --------------------------------------------------------------------------------------


def _common_ids():
    return {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}


def cfg_gemma3_text():
    lt = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": H,
        "num_hidden_layers": 6,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": WINDOW,
        "sliding_window_pattern": 3,
        "layer_types": lt,
        "max_position_embeddings": 1024,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        **_common_ids(),
    }


def cfg_gemma3_mm():
    lt = ["sliding_attention", "full_attention"] * 2
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "vocab_size": VOCAB,  # top-level: mlx-lm copies it into text_config
        "torch_dtype": "bfloat16",
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "image_token_index": 262144,
        "mm_tokens_per_image": 256,
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": H,
            "num_hidden_layers": 4,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "rms_norm_eps": 1e-6,
            "vocab_size": VOCAB,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "sliding_window": WINDOW,
            "sliding_window_pattern": 2,
            "layer_types": lt,
            "max_position_embeddings": 1024,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 8,
            "image_size": 16,
            "patch_size": 4,
            "num_hidden_layers": 1,
        },
        **_common_ids(),
    }


def _gemma4_rope():
    return {
        "full_attention": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
            "rope_type": "proportional",
        },
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    }


def _gemma4_wrapper(text_config):
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "vocab_size": VOCAB,
        "dtype": "bfloat16",
        "text_config": text_config,
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 8},
        "audio_config": None,
        "image_token_id": 258880,
        "tie_word_embeddings": True,
        **_common_ids(),
    }


def cfg_gemma4_dense_ple():
    lt = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    tc = {
        "model_type": "gemma4_text",
        "dtype": "bfloat16",
        "hidden_size": H,
        "num_hidden_layers": 6,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": None,
        "head_dim": 32,
        "global_head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 32,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
        "attention_k_eq_v": False,
        "enable_moe_block": False,
        "num_experts": None,
        "top_k_experts": None,
        "moe_intermediate_size": None,
        "layer_types": lt,
        "sliding_window": WINDOW,
        "rope_parameters": _gemma4_rope(),
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 1024,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "tie_word_embeddings": True,
        **_common_ids(),
    }
    return _gemma4_wrapper(tc)


def cfg_gemma4_moe():
    lt = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    tc = {
        "model_type": "gemma4_text",
        "dtype": "bfloat16",
        "hidden_size": H,
        "num_hidden_layers": 6,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "head_dim": 32,
        "global_head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "attention_k_eq_v": True,
        "enable_moe_block": True,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 64,
        "layer_types": lt,
        "sliding_window": WINDOW,
        "rope_parameters": _gemma4_rope(),
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 1024,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "tie_word_embeddings": True,
        **_common_ids(),
    }
    return _gemma4_wrapper(tc)


def cfg_gemma3n():
    lt = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    return {
        "architectures": ["Gemma3nForConditionalGeneration"],
        "model_type": "gemma3n",
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "gemma3n_text",
            "hidden_size": H,
            "num_hidden_layers": 6,
            "intermediate_size": [64] * 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rms_norm_eps": 1e-6,
            "vocab_size": VOCAB,
            "vocab_size_per_layer_input": 448,
            "hidden_size_per_layer_input": 32,
            "num_kv_shared_layers": 2,
            "sliding_window": WINDOW,
            "max_position_embeddings": 1024,
            "rope_local_base_freq": 10000.0,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "final_logit_softcapping": 30.0,
            "layer_types": lt,
            "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
            "altup_num_inputs": 4,
            "altup_coef_clip": 120.0,
            "altup_correct_scale": True,
            "altup_active_idx": 0,
            "altup_lr_multiplier": 1.0,
            "laurel_rank": 16,
            "hidden_activation": "gelu_pytorch_tanh",
            "torch_dtype": "bfloat16",
            **_common_ids(),
        },
        "vision_config": {"model_type": "gemma3n_vision", "hidden_size": 8},
        **_common_ids(),
    }


FAMILIES = {
    # name: (config builder, numpy seed, gemma3-style (1+w) norms)
    "gemma3_text": (cfg_gemma3_text, 1001, True),
    "gemma3_mm": (cfg_gemma3_mm, 1002, True),
    "gemma4_dense_ple": (cfg_gemma4_dense_ple, 1003, False),
    "gemma4_moe": (cfg_gemma4_moe, 1004, False),
    "gemma3n": (cfg_gemma3n, 1007, False),  # seed picked for top-2 gaps >= 0.02
}

# variant -> conversion recipe
VARIANT_DEFS = {
    "bf16": None,
    "q4": {"mode": "affine", "bits": 4, "group_size": 64},
    "q8": {"mode": "affine", "bits": 8, "group_size": 64},
    "q2g64": {"mode": "affine", "bits": 2, "group_size": 64},
    "q3g32": {"mode": "affine", "bits": 3, "group_size": 32},
    "q5g64": {"mode": "affine", "bits": 5, "group_size": 64},
    "q6g128": {"mode": "affine", "bits": 6, "group_size": 128},
    "mixed36": {"mode": "affine", "bits": 4, "group_size": 64, "recipe": "mixed_3_6"},
    "mxfp4": {"mode": "mxfp4"},
    "mxfp8": {"mode": "mxfp8"},
    "nvfp4": {"mode": "nvfp4"},
    "nvfp4gs": {"mode": "nvfp4", "global_scale": True},
    "q4sharded": {"mode": "affine", "bits": 4, "group_size": 64, "shards": 3},
}

FIXTURES = {
    "gemma3_text": ["bf16", "q4", "q8", "q2g64", "q3g32", "q5g64", "q6g128",
                    "mixed36", "mxfp4", "mxfp8", "nvfp4", "q4sharded"],
    "gemma3_mm": ["bf16", "q4"],
    "gemma4_dense_ple": ["bf16", "q4", "mxfp4"],
    "gemma4_moe": ["bf16", "q4", "nvfp4gs"],
    "gemma3n": ["bf16", "q4"],
}
# derived fixtures: name -> (source fixture, kind)
DERIVED = {
    "gemma4_moe-q4-hfnames": ("gemma4_moe-q4", "hfnames"),
    "gemma4_moe-bf16-hffused": ("gemma4_moe-bf16", "hffused"),
}

# --------------------------------------------------------------------------------------
# Fake HF source
# --------------------------------------------------------------------------------------

NORM_RE = re.compile(r"norm(_\d+)?\.weight$")
POST_NORM_RE = re.compile(
    r"(post_attention_layernorm|post_feedforward_layernorm|post_per_layer_input_norm)\.weight$")


def init_value(name, shape, rng, one_plus_w):
    """Deterministic non-degenerate random value for an MLX parameter name."""
    shape = tuple(int(s) for s in shape)
    if name.endswith("layer_scalar"):
        return rng.uniform(0.6, 1.4, shape)
    if name.endswith("router.scale") or name.endswith("per_expert_scale"):
        return rng.uniform(0.5, 1.5, shape)
    if name.endswith("correct_output_scale"):
        return rng.uniform(0.5, 1.5, shape)
    if POST_NORM_RE.search(name):
        # post-sublayer norms scale what each layer adds to the residual stream; make it
        # comparable to the scaled embedding so logits are not just self-similarity
        scale = rng.uniform(4.0, 10.0, shape)
        return scale - 1.0 if one_plus_w else scale
    if NORM_RE.search(name):
        if one_plus_w:
            return rng.normal(0.0, 0.15, shape)  # Gemma 3 stores w with scale (1 + w)
        return 1.0 + rng.normal(0.0, 0.15, shape)
    if "modality_router" in name:
        # input is rms(x)*w/H: std ~ 0.088*sigma per output -> sigma 10 keeps tanh ~0.7
        return rng.normal(0.0, 10.0, shape)
    if "prediction_coefs" in name or "correction_coefs" in name:
        return rng.normal(0.0, 0.2, shape)
    if "embed_tokens_per_layer" in name:
        return rng.normal(0.0, 0.3, shape)
    if "embed_tokens" in name:
        return rng.normal(0.0, 0.4, shape)
    if name.endswith("router.proj.weight"):
        return rng.normal(0.0, 1.5, shape)
    # Linear / expert stacks: unit-gain init
    return rng.normal(0.0, 1.0 / math.sqrt(shape[-1]), shape)


def build_mlx_model(config):
    model_class, args_class = mu._get_classes(config=config)
    return model_class(args_class.from_dict(copy.deepcopy(config)))


def make_tokenizer_files(d: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = dict(SPECIAL)
    for i in range(len(SPECIAL), VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.save(str(d / "tokenizer.json"))
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "model_max_length": 1024,
            },
            f,
            indent=2,
        )
    with open(d / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
                   "do_sample": False}, f, indent=2)


def mlx_to_hf(family, config, params):
    """MLX-named float32 numpy params -> HF-named dict (inverse of mlx-lm sanitize)."""
    rng = np.random.default_rng(FAMILIES[family][1] + 500)
    hf = {}
    if family == "gemma3_text":
        for k, v in params.items():
            if k == "lm_head.weight":
                continue  # tied, like real Gemma 3
            hf[k] = v
    elif family == "gemma3_mm":
        for k, v in params.items():
            if k == "language_model.lm_head.weight":
                continue
            hf[k] = v  # old HF layout language_model.model.* (what mlx-lm expects)
        hf["vision_tower.vision_model.embeddings.patch_embedding.weight"] = rng.normal(
            0, 0.1, (8, 3, 4, 4))
        hf["multi_modal_projector.mm_input_projection_weight"] = rng.normal(0, 0.1, (8, H))
        hf["multi_modal_projector.mm_soft_emb_norm.weight"] = rng.normal(0, 0.1, (8,))
    elif family.startswith("gemma4"):
        tc = config["text_config"]
        L = tc["num_hidden_layers"]
        first_shared = L - tc["num_kv_shared_layers"]
        for k, v in params.items():
            assert k.startswith("language_model.model."), k
            hk = "model.language_model." + k[len("language_model.model."):]
            if ".experts.switch_glu.gate_proj.weight" in hk:
                base = hk.replace(".switch_glu.gate_proj.weight", "")
                up = params[k.replace("gate_proj", "up_proj")]
                hf[base + ".gate_up_proj"] = np.concatenate([v, up], axis=-2)
                continue
            if ".experts.switch_glu.up_proj.weight" in hk:
                continue
            if ".experts.switch_glu.down_proj.weight" in hk:
                hf[hk.replace(".switch_glu.down_proj.weight", ".down_proj")] = v
                continue
            hf[hk] = v
        # real HF archives still carry k/v projections on KV-shared layers
        for i in range(first_shared, L):
            full = tc["layer_types"][i] == "full_attention"
            D = tc["global_head_dim"] if full else tc["head_dim"]
            nkv = tc["num_key_value_heads"]
            if full and tc["attention_k_eq_v"] and tc["num_global_key_value_heads"]:
                nkv = tc["num_global_key_value_heads"]
            p = f"model.language_model.layers.{i}.self_attn."
            hf[p + "k_proj.weight"] = rng.normal(0, H ** -0.5, (nkv * D, H))
            if not (full and tc["attention_k_eq_v"]):
                hf[p + "v_proj.weight"] = rng.normal(0, H ** -0.5, (nkv * D, H))
            hf[p + "k_norm.weight"] = 1.0 + rng.normal(0, 0.15, (D,))
        D = tc["head_dim"]
        hf["model.language_model.layers.0.self_attn.rotary_emb.inv_freq"] = (
            10000.0 ** (-np.arange(0, D, 2) / D)).astype(np.float32)
        hf["model.vision_tower.patch_embedder.input_proj.weight"] = rng.normal(0, 0.1, (8, 48))
        hf["model.embed_vision.embedding_projection.weight"] = rng.normal(0, 0.1, (H, 8))
        hf["model.audio_tower.subsample_conv_projection.layer0.conv.weight"] = rng.normal(
            0, 0.1, (8, 1, 3, 3))
    elif family == "gemma3n":
        for k, v in params.items():
            hf[k] = v  # MLX names == HF names
        hf["model.vision_tower.timm_model.conv_stem.conv.weight"] = rng.normal(0, 0.1, (8, 3, 3, 3))
        hf["model.audio_tower.subsample_conv_projection.conv_0.conv.weight"] = rng.normal(
            0, 0.1, (8, 1, 3, 3))
        hf["model.embed_vision.embedding.weight"] = rng.normal(0, 0.1, (8, H))
        hf["model.embed_audio.embedding.weight"] = rng.normal(0, 0.1, (8, H))
    else:
        raise ValueError(family)
    return hf


def build_hf_source(family, dst: Path):
    builder, seed, one_plus_w = FAMILIES[family]
    config = builder()
    mx.random.seed(seed)
    model = build_mlx_model(config)
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    rng = np.random.default_rng(seed)
    params = {}
    for k in sorted(shapes):
        params[k] = init_value(k, shapes[k], rng, one_plus_w).astype(np.float32)
    hf = mlx_to_hf(family, config, params)
    arrays = {}
    for k in sorted(hf):
        a = mx.array(np.asarray(hf[k], dtype=np.float32))
        arrays[k] = a if k.endswith("inv_freq") else a.astype(mx.bfloat16)
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), arrays, metadata={"format": "pt"})
    with open(dst / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    make_tokenizer_files(dst)
    return config


# --------------------------------------------------------------------------------------
# Conversion with mlx-lm's own code (mirrors mlx_lm.convert)
# --------------------------------------------------------------------------------------


class ShardLimit:
    """Swap mlx_lm.utils.make_shards for a byte-limited copy of its greedy logic."""

    def __init__(self, limit_bytes):
        self.limit = limit_bytes

    def __enter__(self):
        self.orig = mu.make_shards
        limit = self.limit

        def make_shards(weights, max_file_size_gb=None):
            shards, size = [], 0
            for k, v in weights.items():
                if not shards or size + v.nbytes > limit:
                    shards.append({})
                    size = 0
                shards[-1][k] = v
                size += v.nbytes
            return shards

        mu.make_shards = make_shards
        return self

    def __exit__(self, *exc):
        mu.make_shards = self.orig


def shard_limit_for(model, n_shards):
    sizes = [v.nbytes for _, v in tree_flatten(model.parameters())]
    total = sum(sizes)
    limit = max(max(sizes), -(-total // n_shards))
    while True:
        count, cur = 0, 0
        for s in sizes:
            if count == 0 or cur + s > limit:
                count += 1
                cur = 0
            cur += s
        if count <= n_shards:
            return limit, count
        limit += 1024


def convert_variant(hf_dir: Path, dst: Path, recipe):
    model, tokenizer, config = mu.load(str(hf_dir), return_config=True, lazy=True)
    dtype = config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    assert dtype == "bfloat16", dtype
    cast_predicate = getattr(model, "cast_predicate", lambda _: True)

    def set_dtype(k, v):
        if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(mx.bfloat16)
        return v

    model.update(tree_map_with_path(set_dtype, model.parameters()))
    if recipe is not None:
        pred = None
        if recipe.get("recipe"):
            pred = mixed_quant_predicate_builder(recipe["recipe"], model, recipe["group_size"])
        model, config = mu.quantize_model(
            model,
            config,
            recipe.get("group_size"),
            recipe.get("bits"),
            mode=recipe["mode"],
            global_scale=recipe.get("global_scale", False),
            quant_predicate=pred,
        )
    if dst.exists():
        shutil.rmtree(dst)
    n_shards = (recipe or {}).get("shards")
    if n_shards:
        limit, count = shard_limit_for(model, n_shards)
        assert count == n_shards, (count, n_shards)
        with ShardLimit(limit):
            mu.save(str(dst), str(hf_dir), model, tokenizer, config)
    else:
        mu.save(str(dst), str(hf_dir), model, tokenizer, config)


# --------------------------------------------------------------------------------------
# Independent numpy dequantization (mlx-format.md), used as a self-check
# --------------------------------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6],
                dtype=np.float64)


def e4m3_decode(u8):
    u = u8.astype(np.int64)
    s = np.where(u & 0x80, -1.0, 1.0)
    e = (u >> 3) & 0xF
    m = u & 0x7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * np.exp2(e - 7.0))
    v = np.where((u & 0x7F) == 0x7F, np.nan, v)
    return s * v


def np_unpack(w_u32, bits, n_in):
    w = np.ascontiguousarray(np.asarray(w_u32, dtype=np.uint32))
    by = w.astype("<u4").view(np.uint8)
    bitstream = np.unpackbits(by, axis=-1, bitorder="little")
    bitstream = bitstream[..., : n_in * bits].reshape(*w.shape[:-1], n_in, bits)
    return (bitstream.astype(np.int64) << np.arange(bits)).sum(-1)


def np_dequant(w_u32, scales, biases, group_size, bits, mode, global_scale=None):
    """Returns float64 dequantization; scales/biases given as f32/u8 numpy arrays."""
    n_in = w_u32.shape[-1] * 32 // bits
    q = np_unpack(w_u32, bits, n_in)
    rep = lambda a: np.repeat(np.asarray(a), group_size, axis=-1)  # noqa: E731
    if mode == "affine":
        s = rep(scales).astype(np.float32)
        b = rep(biases).astype(np.float32)
        return (s * q.astype(np.float32) + b).astype(np.float64)  # f32 formula
    if mode == "mxfp4":
        return E2M1[q] * np.exp2(rep(scales).astype(np.float64) - 127)
    if mode == "mxfp8":
        return e4m3_decode(q) * np.exp2(rep(scales).astype(np.float64) - 127)
    if mode == "nvfp4":
        sc = e4m3_decode(rep(scales))
        if global_scale is None:
            return E2M1[q] * sc
        # bit-exact f32 order of MLX: e2m1(q) * (e4m3(s) * (global_scale / 2688))
        g = np.asarray(global_scale, dtype=np.float32) / np.float32(6.0 * 448.0)
        return (E2M1[q].astype(np.float32) * (sc.astype(np.float32) * g)).astype(np.float64)
    raise ValueError(mode)


def to_np(a):
    if a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)
    return np.array(a)


def check_quantized_modules(model):
    """max |numpy decode - mx.dequantize(f32 scales)| over every quantized tensor."""
    worst, n = 0.0, 0
    for name, m in model.named_modules():
        if "scales" not in m or not hasattr(m, "mode"):
            continue
        w, s = m["weight"], m["scales"]
        b = m.get("biases")
        gsc = m.get("global_scale") if isinstance(m, QuantizedSwitchLinear) else None
        s32 = s if s.dtype == mx.uint8 else s.astype(mx.float32)
        b32 = None if b is None else b.astype(mx.float32)
        if gsc is not None:
            ref = mx.stack([
                mx.dequantize(w[e], s32[e], None, m.group_size, m.bits, m.mode,
                              global_scale=gsc[e], dtype=mx.float32)
                for e in range(w.shape[0])])
            gnp = np.array(gsc)[:, None, None]
        else:
            ref = mx.dequantize(w, s32, b32, m.group_size, m.bits, m.mode, dtype=mx.float32)
            gnp = None
        mine = np_dequant(np.array(w), to_np(s), None if b is None else to_np(b),
                          m.group_size, m.bits, m.mode, gnp)
        worst = max(worst, float(np.abs(mine - np.array(ref).astype(np.float64)).max()))
        n += 1
    return worst, n


# --------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------


def _qembed_call_f32(self, x):
    biases = self.get("biases")
    return mx.dequantize(
        self["weight"][x],
        scales=self["scales"][x],
        biases=biases[x] if biases is not None else None,
        group_size=self.group_size,
        bits=self.bits,
        mode=self.mode,
        dtype=mx.float32,
    )


class Patch:
    def __init__(self, cls, attr, fn):
        self.cls, self.attr, self.fn = cls, attr, fn

    def __enter__(self):
        self.orig = getattr(self.cls, self.attr)
        setattr(self.cls, self.attr, self.fn)

    def __exit__(self, *exc):
        setattr(self.cls, self.attr, self.orig)


def replace_global_scale_experts(model):
    """CPU can't run gather_qmm with a global scale: use the exact per-expert
    dequantization (same stored values) in a float32 SwitchLinear."""
    repl = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedSwitchLinear) and m.get("global_scale") is not None:
            w = mx.stack([
                mx.dequantize(m["weight"][e], m["scales"][e], None, m.group_size, m.bits,
                              m.mode, global_scale=m["global_scale"][e], dtype=mx.float32)
                for e in range(m["weight"].shape[0])])
            sl = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias=False)
            sl.weight = w
            repl.append((name, sl))
    if repl:
        model.update_modules(tree_unflatten(repl))
    return len(repl)


def cast_f32(model):
    model.update(tree_map(
        lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
        model.parameters()))


def load_f32(path: Path, model_config=None):
    model, config = mu.load_model(path, model_config=model_config)
    deq_err, n_q = check_quantized_modules(model)
    left_float = [n for n, m in model.named_modules()
                  if isinstance(m, (nn.Linear, nn.Embedding, SwitchLinear))]
    n_gs = replace_global_scale_experts(model)
    cast_f32(model)
    mx.eval(model.parameters())
    return model, config, {"dequant_numpy_vs_mlx_max_abs": deq_err,
                           "quantized_tensors_checked": n_q,
                           "global_scale_stacks_dequantized": n_gs,
                           "unquantized_linear_modules": left_float if n_q else "all"}


def run_refs(model, tokens):
    layers = model.layers
    idx = {id(l): i for i, l in enumerate(layers)}
    hidden = {}
    layer_cls = type(layers[0])
    orig_call = layer_cls.__call__

    def rec_call(self, *a, **k):
        out = orig_call(self, *a, **k)
        h = out[0] if isinstance(out, tuple) else out
        hidden[idx[id(self)]] = h
        return out

    router_margins = []
    orig_router = gemma4_text.Router.__call__

    def rec_router(self, x):
        z = mx.fast.rms_norm(x, self.scale * self._root_size, self.eps)
        sc = mx.sort(self.proj(z).astype(mx.float32), axis=-1)
        K = self.config.top_k_experts
        router_margins.append(float(mx.min(sc[..., -K] - sc[..., -K - 1])))
        return orig_router(self, x)

    x = mx.array(tokens, dtype=mx.int32)[None]
    with Patch(nn.QuantizedEmbedding, "__call__", _qembed_call_f32):
        with Patch(layer_cls, "__call__", rec_call), Patch(gemma4_text.Router, "__call__",
                                                            rec_router):
            cache = make_prompt_cache(model)
            prefill = model(x, cache=cache)[0]
            mx.eval(prefill, hidden)
        hidden_np = {i: np.array(hidden[i].astype(mx.float32)) for i in sorted(hidden)}
        # decode: prefill P tokens, then single steps teacher-forced
        cache = make_prompt_cache(model)
        mx.eval(model(x[:, :PREFILL_P], cache=cache))
        dec = []
        for j in range(PREFILL_P, len(tokens)):
            out = model(x[:, j:j + 1], cache=cache)[0, -1]
            mx.eval(out)
            dec.append(np.array(out))
        nocache = model(x)[0]
        mx.eval(nocache)
    prefill = np.array(prefill).astype(np.float32)
    decode = np.stack(dec).astype(np.float32)
    out = {"prefill": prefill, "decode": decode, "nocache": np.array(nocache),
           "router_min_margin": min(router_margins) if router_margins else None}
    for i, h in hidden_np.items():
        if h.ndim == 4:  # gemma3n AltUp stack [n, B, T, H]
            h = h[:, 0]
        else:
            h = h[0]
        out[f"hidden_{i}"] = h.astype(np.float32)
    return out


def top2_gaps(logits):
    s = np.sort(logits, axis=-1)
    return s[:, -1] - s[:, -2]


def weight_bytes(d: Path):
    return sum(p.stat().st_size for p in d.glob("model*.safetensors"))


def quant_summary(config):
    q = config.get("quantization")
    if not q:
        return {"quantized": False, "description": "bf16, unquantized"}
    glob_ = {k: q[k] for k in ("mode", "bits", "group_size") if k in q}
    overrides = {k: v for k, v in q.items() if isinstance(v, dict)}
    kinds = {}
    for v in overrides.values():
        key = f"{v.get('mode', 'affine')} {v.get('bits')}b g{v.get('group_size')}" + (
            " +global_scale" if v.get("global_scale") else "")
        kinds[key] = kinds.get(key, 0) + 1
    desc = f"{glob_.get('mode', 'affine')} {glob_['bits']}-bit g{glob_['group_size']}"
    if kinds:
        desc += "; per-module overrides: " + ", ".join(
            f"{n}x {k}" for k, n in sorted(kinds.items()))
    return {"quantized": True, "global": glob_, "override_count": len(overrides),
            "override_kinds": kinds, "description": desc}


def save_refs(d: Path, tokens, refs):
    tensors = {"tokens": mx.array(np.array(tokens, dtype=np.int32)),
               "logits_prefill": mx.array(refs["prefill"]),
               "logits_decode": mx.array(refs["decode"])}
    for k in sorted(k for k in refs if k.startswith("hidden_")):
        tensors[k] = mx.array(refs[k])
    mx.save_safetensors(str(d / "reference.safetensors"), tensors,
                        metadata={"format": "mlx", "generator": "tools/make_fixtures.py"})
    return {k: [str(v.dtype).replace("mlx.core.", ""), list(v.shape)]
            for k, v in tensors.items()}


def make_reference(name, family, variant, d: Path, tokens, extra=None):
    model, config, checks = load_f32(d)
    refs = run_refs(model, tokens)
    pre, dec = refs["prefill"], refs["decode"]
    gaps = top2_gaps(pre)
    dgaps = top2_gaps(dec)
    shapes = save_refs(d, tokens, refs)
    n_layers = len(model.layers)
    del model
    meta = {
        "name": name,
        "family": family,
        "variant": variant,
        "model_type": config["model_type"],
        "num_layers": n_layers,
        "quantization": quant_summary(config),
        "weights_bytes": weight_bytes(d),
        "weight_files": sorted(p.name for p in d.glob("model*.safetensors")),
        "reference_file": "reference.safetensors",
        "reference_tensors": shapes,
        "reference_semantics": {
            "tokens": "int32 [24], BOS=2 at position 0, no chat template",
            "logits_prefill": "f32 [24,V]: all 24 tokens in one call with a fresh "
                              "make_prompt_cache cache (post-softcap for gemma3n/gemma4)",
            "logits_decode": f"f32 [4,V]: prefill tokens[:{PREFILL_P}], then row j = logits "
                             f"after feeding tokens[{PREFILL_P}+j] (position {PREFILL_P}+j)",
            "hidden_i": "f32 output of decoder layer i in the prefill ([24,H]; gemma3n: "
                        "AltUp stack [4,24,H]; gemma4: after layer_scalar; before final norm)",
            "math": "f32: every floating tensor (weights, norms, affine scales/biases) cast "
                    "to float32 after loading; quantized values as stored; fp-mode "
                    "embedding rows dequantized to f32; nvfp4 global-scale expert stacks "
                    "replaced by their exact per-expert f32 dequantization",
        },
        "max_abs_logit": float(np.abs(pre).max()),
        "top2_gap_prefill": {"min": float(gaps.min()), "median": float(np.median(gaps)),
                             "per_position": [round(float(g), 5) for g in gaps]},
        "top2_gap_decode": {"min": float(dgaps.min()),
                            "per_step": [round(float(g), 5) for g in dgaps]},
        "argmax_prefill": [int(a) for a in pre.argmax(-1)],
        "self_checks": {
            "decode_vs_prefill_max_abs": float(np.abs(dec - pre[PREFILL_P:]).max()),
            "decode_vs_prefill_argmax_agree": float(
                (dec.argmax(-1) == pre[PREFILL_P:].argmax(-1)).mean()),
            "nocache_vs_cache_max_abs": float(np.abs(refs["nocache"] - pre).max()),
            **checks,
        },
        "environment": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                        "numpy": np.__version__},
    }
    if refs["router_min_margin"] is not None:
        meta["self_checks"]["router_topk_min_margin_prefill"] = refs["router_min_margin"]
    if extra:
        meta.update(extra)
    (d / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# --------------------------------------------------------------------------------------
# safetensors helpers (pure python, for derived and broken fixtures)
# --------------------------------------------------------------------------------------


def st_read(path: Path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    meta = hdr.pop("__metadata__", None)
    data = raw[8 + n:]
    entries = []
    for name, e in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        s, t = e["data_offsets"]
        entries.append((name, e["dtype"], list(e["shape"]), data[s:t]))
    return meta, entries


def st_header_bytes(meta, entries, offsets=None):
    hdr = {}
    if meta is not None:
        hdr["__metadata__"] = meta
    pos = 0
    for i, (name, dt, shape, blob) in enumerate(entries):
        off = offsets[i] if offsets else [pos, pos + len(blob)]
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": off}
        pos += len(blob)
    return json.dumps(hdr, separators=(",", ":")).encode()


def st_write(path: Path, meta, entries, offsets=None, header_override=None, n_override=None):
    hb = header_override if header_override is not None else st_header_bytes(meta, entries,
                                                                             offsets)
    n = len(hb) if n_override is None else n_override
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.write(hb)
        for _, _, _, blob in entries:
            f.write(blob)


def write_index(d: Path, weight_map_files):
    """Rewrite model.safetensors.index.json from the headers of the given files."""
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    wm = {}
    total = 0
    for fname in weight_map_files:
        _, entries = st_read(d / fname)
        for name, _, _, blob in entries:
            wm[name] = fname
            total += len(blob)
    idx["weight_map"] = dict(sorted(wm.items()))
    idx["metadata"]["total_size"] = total
    (d / "model.safetensors.index.json").write_text(json.dumps(idx, indent=4))


# --------------------------------------------------------------------------------------
# Derived MoE fixtures (naming variants)
# --------------------------------------------------------------------------------------


def copy_dir_files(src: Path, dst: Path, skip=()):
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name not in skip:
            shutil.copy2(p, dst / p.name)


def make_hfnames(src: Path, dst: Path):
    """experts.switch_glu.{gate,up,down}_proj.* -> experts.{gate,up,down}_proj.*"""
    copy_dir_files(src, dst)
    renamed = 0
    for p in sorted(dst.glob("model*.safetensors")):
        meta, entries = st_read(p)
        new = []
        for name, dt, shape, blob in entries:
            nn_ = name.replace(".experts.switch_glu.", ".experts.")
            renamed += nn_ != name
            new.append((nn_, dt, shape, blob))
        st_write(p, meta, new)
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        if key in cfg:
            cfg[key] = {k.replace(".experts.switch_glu.", ".experts."): v
                        for k, v in cfg[key].items()}
    (dst / "config.json").write_text(json.dumps(cfg, indent=4))
    write_index(dst, sorted(p.name for p in dst.glob("model*.safetensors")))
    return renamed


def make_hffused(src: Path, dst: Path):
    """bf16 experts -> HF fused experts.gate_up_proj [E,2Im,H] / experts.down_proj, and
    no enable_moe_block in the config (MoE must be detected from router.proj)."""
    copy_dir_files(src, dst)
    for p in sorted(dst.glob("model*.safetensors")):
        w = mx.load(str(p))
        out = {}
        for k in w:
            if k.endswith(".experts.switch_glu.gate_proj.weight"):
                base = k[: -len(".switch_glu.gate_proj.weight")]
                up = w[k.replace("gate_proj", "up_proj")]
                out[base + ".gate_up_proj"] = mx.concatenate([w[k], up], axis=-2)
            elif k.endswith(".experts.switch_glu.up_proj.weight"):
                continue
            elif k.endswith(".experts.switch_glu.down_proj.weight"):
                out[k[: -len(".switch_glu.down_proj.weight")] + ".down_proj"] = w[k]
            else:
                out[k] = w[k]
        mx.save_safetensors(str(p), out, metadata={"format": "mlx"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"].pop("enable_moe_block", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=4))
    write_index(dst, sorted(p.name for p in dst.glob("model*.safetensors")))


def derived_fixture(name, src_name, kind):
    src, dst = OUT / src_name, OUT / name
    src_meta = json.loads((src / "reference.json").read_text())
    checks = {}
    if kind == "hfnames":
        n = make_hfnames(src, dst)
        checks["renamed_tensors"] = n
        # same bytes under the new names
        a = {k.replace(".experts.switch_glu.", ".experts."): (dt, sh, b)
             for p in src.glob("model*.safetensors") for k, dt, sh, b in st_read(p)[1]}
        bb = {k: (dt, sh, b) for p in dst.glob("model*.safetensors")
              for k, dt, sh, b in st_read(p)[1]}
        checks["tensors_identical_after_rename"] = a == bb
    else:
        make_hffused(src, dst)
        # mlx-lm can load it once enable_moe_block is given back: logits must match exactly
        cfg = json.loads((dst / "config.json").read_text())
        tc = dict(cfg["text_config"], enable_moe_block=True)
        model, _, ch = load_f32(dst, model_config={"text_config": tc})
        refs = run_refs(model, TOKENS)
        ref_src = mx.load(str(src / "reference.safetensors"))
        checks["mlx_lm_reload_with_enable_moe_block_vs_source_max_abs"] = float(
            np.abs(refs["prefill"] - np.array(ref_src["logits_prefill"])).max())
        del model
    shutil.copy2(src / "reference.safetensors", dst / "reference.safetensors")
    meta = dict(src_meta)
    meta["name"] = name
    meta["variant"] = name.split("-", 1)[1]
    meta["derived_from"] = src_name
    meta["derivation"] = {
        "hfnames": "same tensors as the source with experts.switch_glu.{gate,up,down}_proj.* "
                   "renamed to experts.{gate,up,down}_proj.* (not loadable by mlx-lm)",
        "hffused": "source bf16 tensors with experts in Hugging Face's fused layout "
                   "experts.gate_up_proj [E,2*Im,H] (gate rows first) and experts.down_proj "
                   "[E,H,Im], no .weight suffix, no switch_glu; enable_moe_block removed from "
                   "text_config (MoE must be detected from router.proj)",
    }[kind]
    meta["weights_bytes"] = weight_bytes(dst)
    meta["self_checks"] = dict(src_meta["self_checks"], **checks)
    meta["quantization"] = quant_summary(json.loads((dst / "config.json").read_text()))
    (dst / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


# --------------------------------------------------------------------------------------
# Quantization unit cases
# --------------------------------------------------------------------------------------


def make_quant_cases():
    d = OUT / "quant"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    cases = []
    for bits in (2, 3, 4, 5, 6, 8):
        for gs in (32, 64, 128):
            cases.append((f"affine_b{bits}_g{gs}", "affine", bits, gs, False))
    cases += [("mxfp4_g32", "mxfp4", 4, 32, False), ("mxfp8_g32", "mxfp8", 8, 32, False),
              ("nvfp4_g16", "nvfp4", 4, 16, False), ("nvfp4_g16_gs", "nvfp4", 4, 16, True)]
    tensors, listing = {}, []
    for ci, (name, mode, bits, gs, use_gs) in enumerate(cases):
        rng = np.random.default_rng(7000 + ci)
        # rows with different magnitudes, a few outliers, some all-positive groups
        W = rng.normal(0, 1, (37, 256)) * rng.uniform(0.05, 3.0, (37, 1))
        W[rng.integers(0, 37, 6), rng.integers(0, 256, 6)] *= 8.0
        W[3, :64] = np.abs(W[3, :64]) + 0.5
        X = rng.normal(0, 1, (5, 256)).astype(np.float32)
        Wb = mx.array(W.astype(np.float32)).astype(mx.bfloat16)  # real checkpoints: bf16
        gsc = None
        if use_gs:
            gsc = mx.max(mx.abs(Wb)).astype(mx.float32).reshape(1)
            wq, sc = mx.quantize(Wb, gs, bits, mode=mode, global_scale=gsc)
            bi = None
        else:
            res = mx.quantize(Wb, gs, bits, mode=mode)
            wq, sc = res[0], res[1]
            bi = res[2] if len(res) > 2 else None
        s32 = sc if sc.dtype == mx.uint8 else sc.astype(mx.float32)
        b32 = None if bi is None else bi.astype(mx.float32)
        deq = mx.dequantize(wq, s32, b32, gs, bits, mode, global_scale=gsc, dtype=mx.float32)
        Xa = mx.array(X)
        mm = Xa @ deq.T
        mx.eval(deq, mm)
        tensors[f"{name}.weight"] = wq
        tensors[f"{name}.scales"] = sc
        if bi is not None:
            tensors[f"{name}.biases"] = bi
        if gsc is not None:
            tensors[f"{name}.global_scale"] = gsc
        tensors[f"{name}.dequant"] = deq
        tensors[f"{name}.x"] = Xa
        tensors[f"{name}.matmul"] = mm
        # self-checks: numpy decoder, quantized_matmul, fidelity to W
        mine = np_dequant(np.array(wq), to_np(sc), None if bi is None else to_np(bi), gs,
                          bits, mode, None if gsc is None else np.array(gsc)[0])
        np_err = float(np.abs(mine - np.array(deq)).max())
        qmm_err = None
        if gsc is None:
            qmm = mx.quantized_matmul(Xa, wq, s32, b32, True, gs, bits, mode=mode)
            qmm_err = float(np.abs(np.array(qmm) - np.array(mm)).max())
        ent = {
            "case": name, "mode": mode, "bits": bits, "group_size": gs,
            "global_scale": use_gs,
            "tensors": {k.split(".", 1)[1]: [str(v.dtype).replace("mlx.core.", ""),
                                             list(v.shape)]
                        for k, v in tensors.items() if k.startswith(name + ".")},
            "checks": {
                "numpy_decode_vs_dequant_max_abs": np_err,
                "quantized_matmul_vs_matmul_max_abs": qmm_err,
                "dequant_vs_source_max_abs": float(
                    np.abs(np.array(deq) - np.array(Wb.astype(mx.float32))).max()),
                "negative_scale_fraction": (
                    float((np.array(s32) < 0).mean()) if mode == "affine" else None),
            },
        }
        listing.append(ent)
    mx.save_safetensors(str(d / "cases.safetensors"), tensors, metadata={"format": "mlx"})
    doc = {
        "description": "mx.quantize cases. W: random f32 [37,256] rounded to bf16, quantized "
                       "with mx.quantize (affine scales/biases are bf16 as in checkpoints; "
                       "mx/nv fp scales are uint8). <case>.dequant = mx.dequantize in float32 "
                       "with scales/biases cast to f32 first (nvfp4 global scale: value = "
                       "e2m1(q)*e4m3(s)*global_scale/(6*448)). <case>.x: f32 [5,256]; "
                       "<case>.matmul = x @ dequant^T in f32.",
        "global_scale_formula": "e2m1(q) * (e4m3(scale) * (global_scale / 2688)) "
                                "(this f32 evaluation order is bit-exact with MLX)",
        "file": "cases.safetensors",
        "cases": listing,
    }
    (d / "cases.json").write_text(json.dumps(doc, indent=2) + "\n")
    return listing


# --------------------------------------------------------------------------------------
# Broken checkpoints
# --------------------------------------------------------------------------------------

BROKEN_DOC = [
    # (directory, defect, expected engine behaviour, what mlx-lm 0.32.2 load_model does)
    ("missing-tensor",
     "`{P}layers.1.self_attn.k_proj.weight` removed (its .scales/.biases kept; index updated).",
     "error: missing tensor `{P}layers.1.self_attn.k_proj.weight` (required by layer 1 "
     "attention); name the tensor and the file/directory.",
     "KeyError on the name"),
    ("misshaped-tensor",
     "`{P}layers.0.input_layernorm.weight` stored as BF16 [120] instead of [128] (data "
     "shortened accordingly; the file itself is well-formed).",
     "error: tensor `{P}layers.0.input_layernorm.weight` has shape [120], expected [128] "
     "(hidden_size).",
     "ValueError: Expected shape (128,) but received shape (120,)"),
    ("wrong-dtype",
     "`{P}layers.0.mlp.gate_proj.weight` declared F32 in the header instead of U32 (same "
     "byte size).",
     "error: tensor `{P}layers.0.mlp.gate_proj.weight` has dtype F32, expected U32 "
     "(packed quantized weight; `.scales` present).",
     "loads without complaint (no dtype check) - an engine should be stricter"),
    ("truncated-file",
     "model.safetensors cut to 60% of its length (header intact, data missing).",
     "error: model.safetensors is truncated: tensor `<name>` data ends at byte X but the "
     "file has only Y bytes.",
     "RuntimeError: invalid data offsets ... exceeding file size"),
    ("bad-json-header",
     "the JSON header has a syntax error (a `:` replaced by `;`), header length unchanged.",
     "error: model.safetensors: invalid safetensors header JSON (parse error at byte N).",
     "RuntimeError: json parse error"),
    ("offsets-past-end",
     "the data_offsets of `{P}norm.weight` (the last tensor in the data section) start "
     "4096 bytes after the end of the file (span length still matches its shape).",
     "error: tensor `{P}norm.weight` data_offsets [a, b] exceed the data section (size S).",
     "RuntimeError: invalid data offsets ... exceeding file size"),
    ("absurd-header-size",
     "the leading u64 header length is 2^40 (far larger than the file).",
     "error: model.safetensors: header length 1099511627776 exceeds file size N "
     "(corrupt or not a safetensors file). Must not try to allocate it.",
     "RuntimeError: Invalid json header length"),
    ("unknown-model-type",
     "config.json `model_type` = `gemma_unknown`.",
     "error: unsupported model_type `gemma_unknown` (supported: gemma3_text, gemma3, "
     "gemma4_text, gemma4, gemma3n).",
     "ValueError: Model type gemma_unknown not supported."),
    ("config-not-json",
     "config.json is cut in the middle (invalid JSON).",
     "error: config.json is not valid JSON (line L column C).",
     "JSONDecodeError"),
    ("quant-bits-mismatch",
     "config.json `quantization`/`quantization_config` say bits 8, the tensors are 4-bit.",
     "error: quantization config says 8-bit g64 but `{P}embed_tokens.weight` is "
     "[512, 16] U32 with scales [512, 2] (=> 4-bit g64); config and tensors disagree. "
     "(Acceptable alternative: infer 4-bit from the shapes with a warning; never decode "
     "as 8-bit.)",
     "loads: modules not listed in the config are re-inferred from shapes "
     "(infer_quant_config), so the wrong global bits are silently ignored"),
    ("extra-tensor",
     "an unexpected tensor `{P}layers.0.self_attn.extra_proj.weight` (BF16 [4, 128]) added "
     "(index updated).",
     "WARNING only (load succeeds): unexpected tensor `{P}layers.0.self_attn.extra_proj."
     "weight` ignored.",
     "ValueError: Received 1 parameters not in model (strict load)"),
]


def make_broken(src_name):
    src = OUT / src_name
    base = OUT / "broken"
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    meta, entries = st_read(src / "model.safetensors")
    names = [e[0] for e in entries]
    P = next(n for n in names if n.endswith("embed_tokens.weight"))[: -len("embed_tokens.weight")]
    keep = ("config.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "model.safetensors", "model.safetensors.index.json")

    def fresh(defect):
        d = base / defect
        d.mkdir()
        for f in keep:
            shutil.copy2(src / f, d / f)
        return d

    def ents():
        return [list(e) for e in entries]

    # 1 missing tensor
    d = fresh("missing-tensor")
    tgt = f"{P}layers.1.self_attn.k_proj.weight"
    assert tgt in names
    st_write(d / "model.safetensors", meta, [e for e in ents() if e[0] != tgt])
    write_index(d, ["model.safetensors"])
    # 2 mis-shaped tensor
    d = fresh("misshaped-tensor")
    tgt = f"{P}layers.0.input_layernorm.weight"
    e2 = ents()
    for e in e2:
        if e[0] == tgt:
            assert e[1] == "BF16" and e[2] == [H]
            e[2] = [120]
            e[3] = e[3][: 120 * 2]
    st_write(d / "model.safetensors", meta, e2)
    write_index(d, ["model.safetensors"])
    # 3 wrong dtype
    d = fresh("wrong-dtype")
    tgt = f"{P}layers.0.mlp.gate_proj.weight"
    e3 = ents()
    for e in e3:
        if e[0] == tgt:
            assert e[1] == "U32"
            e[1] = "F32"
    st_write(d / "model.safetensors", meta, e3)
    # 4 truncated
    d = fresh("truncated-file")
    raw = (src / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[: int(len(raw) * 0.6)])
    # 5 bad JSON header
    d = fresh("bad-json-header")
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = bytearray(raw[8:8 + n])
    pos = hdr.index(b":", hdr.index(b'"dtype"'))
    hdr[pos:pos + 1] = b";"
    (d / "model.safetensors").write_bytes(raw[:8] + bytes(hdr) + raw[8 + n:])
    # 6 offsets past the end
    d = fresh("offsets-past-end")
    tgt = f"{P}norm.weight"
    e6 = [e for e in ents() if e[0] != tgt] + [e for e in ents() if e[0] == tgt]
    offs, pos = [], 0
    for e in e6:  # all contiguous except the last one (the target), moved past the end
        offs.append([pos, pos + len(e[3])] if e[0] != tgt else
                    [pos + 4096, pos + 4096 + len(e[3])])
        pos += len(e[3])
    st_write(d / "model.safetensors", meta, e6, offsets=offs)
    # 7 absurd header size
    d = fresh("absurd-header-size")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    # 8 unknown model_type
    d = fresh("unknown-model-type")
    c = dict(cfg, model_type="gemma_unknown")
    (d / "config.json").write_text(json.dumps(c, indent=4))
    # 9 config not JSON
    d = fresh("config-not-json")
    txt = (src / "config.json").read_text()
    (d / "config.json").write_text(txt[: len(txt) // 2])
    # 10 quantization disagrees with shapes
    d = fresh("quant-bits-mismatch")
    c = copy.deepcopy(cfg)
    assert c["quantization"]["bits"] == 4
    c["quantization"]["bits"] = 8
    c["quantization_config"] = c["quantization"]
    (d / "config.json").write_text(json.dumps(c, indent=4))
    # 11 extra tensor
    d = fresh("extra-tensor")
    rng = np.random.default_rng(99)
    extra = (mx.array(rng.normal(0, 0.1, (4, H)).astype(np.float32)).astype(mx.bfloat16))
    blob = bytes(np.array(extra.view(mx.uint16)).astype("<u2").tobytes())
    st_write(d / "model.safetensors", meta,
             ents() + [[f"{P}layers.0.self_attn.extra_proj.weight", "BF16", [4, H], blob]])
    write_index(d, ["model.safetensors"])

    lines = [
        "# Broken checkpoints (one defect each)",
        "",
        f"Derived from `{src_name}` (the smallest q4 fixture; prefix `{P}`) by "
        "`tools/make_fixtures.py`: config.json, tokenizer files, model.safetensors and "
        "model.safetensors.index.json are copied, then exactly one thing is broken. The "
        "safetensors files are rewritten by Python (header JSON compact, no padding, "
        "like MLX). An engine must fail with a clear error (never panic, never allocate "
        "absurd sizes, never read out of bounds), except `extra-tensor`, which should load "
        "with a warning.",
        "",
        "| directory | defect | expected engine behaviour / message | mlx-lm 0.32.2 "
        "`load_model` |",
        "|---|---|---|---|",
    ]
    for name, what, msg, mlx in BROKEN_DOC:
        lines.append(f"| `{name}/` | {what.format(P=P)} | {msg.format(P=P)} | {mlx} |")
    lines += ["", "Regenerate: `python3 tools/make_fixtures.py --only broken` (needs the "
              f"`{src_name}` fixture).", ""]
    (base / "README.md").write_text("\n".join(lines))
    return [d[0] for d in BROKEN_DOC]


# --------------------------------------------------------------------------------------


def dir_size(d: Path):
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[],
                    help="fixture name, family, 'quant' or 'broken' (repeatable)")
    args = ap.parse_args()
    for mod, want in (("mlx", EXPECTED_VERSIONS["mlx"]), ("mlx_lm", EXPECTED_VERSIONS["mlx_lm"])):
        have = mx.__version__ if mod == "mlx" else mlx_lm.__version__
        if have != want:
            print(f"WARNING: {mod} {have} != expected {want}; references may differ",
                  file=sys.stderr)

    def wanted(name, family=None):
        if not args.only:
            return True
        return name in args.only or (family is not None and family in args.only)

    mx.set_default_device(mx.cpu)
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    summary = {}
    with tempfile.TemporaryDirectory(prefix="markbase-fixtures-") as tmp:
        tmp = Path(tmp)
        for family, variants in FIXTURES.items():
            names = [f"{family}-{v}" for v in variants]
            derived = [n for n, (s, _) in DERIVED.items() if s in names]
            if not any(wanted(n, family) for n in names + derived):
                continue
            hf_dir = tmp / "_hf" / family
            build_hf_source(family, hf_dir)
            for v in variants:
                name = f"{family}-{v}"
                if not (wanted(name, family) or any(
                        wanted(dn) for dn, (s, _) in DERIVED.items() if s == name)):
                    continue
                t1 = time.time()
                dst = OUT / name
                convert_variant(hf_dir, dst, VARIANT_DEFS[v])
                toks = TOKENS_3N if family == "gemma3n" else TOKENS
                meta = make_reference(name, family, v, dst, toks)
                summary[name] = meta
                sc = meta["self_checks"]
                print(f"[{time.time() - t1:5.1f}s] {name:28s} w={meta['weights_bytes'] / 1024:7.1f}KiB "
                      f"max|logit|={meta['max_abs_logit']:7.3f} "
                      f"dec-vs-pre={sc['decode_vs_prefill_max_abs']:.2e} "
                      f"nocache={sc['nocache_vs_cache_max_abs']:.2e} "
                      f"deq={sc['dequant_numpy_vs_mlx_max_abs']:.1e}"
                      f"({sc['quantized_tensors_checked']}) "
                      f"gap_min={meta['top2_gap_prefill']['min']:.4f} "
                      f"argmax_distinct={len(set(meta['argmax_prefill']))}"
                      + (f" router_margin={sc['router_topk_min_margin_prefill']:.2e}"
                         if "router_topk_min_margin_prefill" in sc else ""), flush=True)
    for dn, (src_name, kind) in DERIVED.items():
        if wanted(dn, "gemma4_moe"):
            meta = derived_fixture(dn, src_name, kind)
            summary[dn] = meta
            extra = {k: v for k, v in meta["self_checks"].items()
                     if k in ("renamed_tensors", "tensors_identical_after_rename",
                              "mlx_lm_reload_with_enable_moe_block_vs_source_max_abs")}
            print(f"        {dn:28s} w={meta['weights_bytes'] / 1024:7.1f}KiB {extra}", flush=True)
    if wanted("quant"):
        cases = make_quant_cases()
        worst_np = max(c["checks"]["numpy_decode_vs_dequant_max_abs"] for c in cases)
        worst_qmm = max((c["checks"]["quantized_matmul_vs_matmul_max_abs"] or 0) for c in cases)
        print(f"quant: {len(cases)} cases, numpy-vs-dequant max {worst_np:.1e}, "
              f"quantized_matmul-vs-matmul max {worst_qmm:.1e}")
    if wanted("broken"):
        q4 = sorted((weight_bytes(p), p.name) for p in OUT.glob("*-q4")
                    if (p / "model.safetensors").exists())
        src_name = q4[0][1]
        made = make_broken(src_name)
        print(f"broken: {len(made)} checkpoints from {src_name}")
    if not args.only:
        idx = {n: {"family": m["family"], "variant": m["variant"],
                   "model_type": m["model_type"],
                   "quantization": m["quantization"]["description"],
                   "weights_bytes": m["weights_bytes"],
                   "max_abs_logit": m["max_abs_logit"],
                   "decode_vs_prefill_max_abs": m["self_checks"]["decode_vs_prefill_max_abs"],
                   "derived_from": m.get("derived_from")}
               for n, m in sorted(summary.items())}
        (OUT / "index.json").write_text(json.dumps(idx, indent=2) + "\n")
    print(f"done in {time.time() - t0:.1f}s; tests/fixtures = {dir_size(OUT) / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
