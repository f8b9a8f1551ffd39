#!/usr/bin/env python3
"""Tiny Gemma 4 (E2B-style ViT) and Gemma 3 (SigLIP) vision-language checkpoints in mlx-vlm's
layout, with float32 references of every intermediate of the image path.

Needs `pip install "mlx[cpu]" mlx-vlm scikit-image` (mlx-vlm pulls transformers, not torch).
Writes `tests/fixtures/vlm/<family>/`:

* `config.json`, `model.safetensors` (F32, random weights), `preprocessor_config.json`:
  a checkpoint that mlx-vlm's own loader reads back (the references come from the re-loaded
  model, not from the one that was saved);
* `square.png`, `wide.png`: crops of scikit-image's sample photographs (the inputs);
* `ref/*.npy` and `ref/manifest.json` (shape, dtype and meaning of every array);
* Gemma 4 only, `ref/audio_*.npy`: a prompt holding an image and an audio clip (the clip's
  log-mel features from `tests/fixtures/audio`, HF's extractor), its audio soft tokens and
  logits through the checkpoint's audio tower and decoder (`--audio-only` rewrites just
  these and the chat template).

Pixel values come from Hugging Face's PIL image processors (`Gemma4ImageProcessorPil`,
`Gemma3ImageProcessorPil`); the towers, projectors, merge and decoder run in mlx-vlm. Where
mlx-vlm and Hugging Face differ (Gemma 3's post-LayerNorm eps, its image-block attention mask,
its image-feature scaling), the references follow Hugging Face: the code below says where.

Deterministic: the same package versions give the same files.
"""

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from PIL import Image

from mlx_vlm.utils import get_model_and_args, load_model, update_module_configs

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "vlm"

# Special-token ids remapped into the tiny vocabulary (real ids are > 255000).
IMG, BOI, EOI, AUD, BOA, EOA = 500, 501, 502, 503, 504, 505


def gemma4_config():
    text = {
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "global_head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "vocab_size_per_layer_input": 512,
        "hidden_size_per_layer_input": 16,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "attention_k_eq_v": False,
        "enable_moe_block": False,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 16,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 1024,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    }
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "position_embedding_size": 128,
        "default_output_length": 70,
        "use_clipped_linears": True,
        "standardize": False,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
    }
    audio = {
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "subsampling_conv_channels": [16, 8],
        "output_proj_dims": 48,
    }
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": vision,
        "audio_config": audio,
        "image_token_id": IMG,
        "audio_token_id": AUD,
        "boi_token_id": BOI,
        "eoi_token_id": EOI,
        "boa_token_id": BOA,
        "eoa_token_id": EOA,
        "eoa_token_index": EOA,
        "vision_soft_tokens_per_image": 70,
        "hidden_size": 64,
        "vocab_size": 512,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
    }


def gemma3_config():
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6,
        "vocab_size": 512,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 16,
        "sliding_window_pattern": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 1024,
        "hidden_activation": "gelu_pytorch_tanh",
        "mm_tokens_per_image": 16,
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": 14,
        "image_size": 224,
        "layer_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh",
        "vision_use_head": False,
    }
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": vision,
        "mm_tokens_per_image": 16,
        "image_token_index": IMG,
        "boi_token_index": BOI,
        "eoi_token_index": EOI,
        # mlx-vlm divides image features by sqrt(hidden_size) (default 2048), then the decoder
        # multiplies by sqrt(D): with hidden_size = D the two cancel, as in HF (unscaled rows).
        "hidden_size": 64,
        "vocab_size": 512,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }


def instantiate(cfg):
    """The mlx-vlm model of `cfg`, built the way `load_model` builds it."""
    cfg = json.loads(json.dumps(cfg))
    arch, _ = get_model_and_args(cfg)
    mc = arch.ModelConfig.from_dict(cfg)
    mc = update_module_configs(mc, arch, cfg, ["text", "vision", "perceiver", "projector", "audio"])
    return arch.Model(mc)


def random_weights(model, seed, clip):
    """Random F32 weights: unit-ish norms, 1/sqrt(fan-in) linears, finite clip bounds."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in sorted(tree_flatten(model.parameters())):
        shape = tuple(p.shape)
        if name.endswith(("input_min", "output_min")):
            v = np.array(-rng.uniform(3.0, 4.5) if clip else -np.inf, np.float32)
        elif name.endswith(("input_max", "output_max")):
            v = np.array(rng.uniform(3.0, 4.5) if clip else np.inf, np.float32)
        elif "norm" in name.split(".")[-2] if "." in name else False:
            if name.endswith(".bias"):
                v = rng.normal(0, 0.1, shape)
            else:
                v = 1.0 + rng.normal(0, 0.1, shape)
        elif name.endswith(".bias"):
            v = rng.normal(0, 0.05, shape)
        elif len(shape) == 0:
            v = np.array(rng.uniform(0.5, 1.5))
        elif len(shape) == 1:
            v = rng.normal(0, 0.5, shape)
        elif "embed_tokens" in name or "position_embedding" in name or "embedding_table" in name:
            v = rng.normal(0, 0.5, shape)
        else:
            fan_in = int(np.prod(shape[1:])) if "mm_input_projection" not in name else shape[0]
            v = rng.normal(0, 1.0 / np.sqrt(fan_in), shape)
        out[name] = mx.array(np.asarray(v, np.float32))
    return out


def save_checkpoint(d, cfg, model, weights, processor):
    d.mkdir(parents=True, exist_ok=True)
    model.load_weights(list(weights.items()))
    params = dict(tree_flatten(model.parameters()))
    # mlx-vlm's Gemma 3 ties the head on load (its sanitizer copies embed_tokens): not stored
    params.pop("language_model.lm_head.weight", None)
    mx.save_safetensors(str(d / "model.safetensors"), params, metadata={"format": "mlx"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (d / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")


class Refs:
    def __init__(self, d):
        self.dir = d / "ref"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest = {}

    def put(self, name, arr, what):
        a = np.asarray(arr)
        if a.dtype.kind == "f":
            a = a.astype(np.float32)
        np.save(self.dir / f"{name}.npy", a)
        self.manifest[name] = {"shape": list(a.shape), "dtype": str(a.dtype), "what": what}

    def close(self, extra):
        self.manifest["_info"] = extra
        (self.dir / "manifest.json").write_text(json.dumps(self.manifest, indent=2, sort_keys=True) + "\n")


def np32(x):
    mx.eval(x)
    return np.array(x.astype(mx.float32))


def photos(d):
    """A square and a non-square crop of scikit-image's sample photographs, saved as PNG."""
    from skimage import data

    square = data.astronaut()[20:244, 150:374]  # 224 x 224
    wide = data.chelsea()[40:200, 60:316]  # 160 x 256
    out = []
    for name, a in (("square", square), ("wide", wide)):
        p = d / f"{name}.png"
        Image.fromarray(np.ascontiguousarray(a)).save(p, optimize=True)
        out.append((name, Image.open(p).convert("RGB")))
    return out


def gemma4_resized(proc, img):
    """HF's Gemma 4 processing of `img`: the resized RGB image (uint8 HWC, recovered exactly
    from the patches, x = u8/255), the padded patches and positions, and the soft tokens."""
    bf = proc.preprocess([img], return_tensors="np")
    patches = np.asarray(bf["pixel_values"])[0]  # [max_patches, 768], zero-padded
    pos = np.asarray(bf["image_position_ids"])[0]  # [max_patches, 2], (-1, -1) padding
    real = pos[:, 0] >= 0
    p = int(real.sum())
    pw, ph = int(pos[real, 0].max()) + 1, int(pos[real, 1].max()) + 1
    grid = patches[:p].reshape(ph, pw, 16, 16, 3).transpose(0, 2, 1, 3, 4).reshape(ph * 16, pw * 16, 3)
    u8 = np.rint(grid * 255).astype(np.uint8)
    assert np.abs(u8 / 255.0 - grid).max() < 1e-6
    return u8, patches, pos, int(np.asarray(bf["num_soft_tokens_per_image"])[0])


def gemma4(d):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    cfg = gemma4_config()
    budget = 70
    proc_cfg = {
        "image_processor_type": "Gemma4ImageProcessor",
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": False,
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
        "do_convert_rgb": True,
        "patch_size": 16,
        "max_soft_tokens": budget,
        "pooling_kernel_size": 3,
    }
    save_checkpoint(d, cfg, instantiate(cfg), random_weights(instantiate(cfg), 4, clip=True), proc_cfg)
    model = load_model(d)
    refs = Refs(d)
    proc = Gemma4ImageProcessorPil(max_soft_tokens=budget)
    vt = model.vision_tower
    pe = vt.patch_embedder
    softs = []
    for name, img in photos(d):
        u8, patches, pos, n = gemma4_resized(proc, img)
        p = int((pos[:, 0] >= 0).sum())
        grid = u8 / 255.0
        refs.put(f"{name}_resized", u8, "HF Gemma4ImageProcessorPil: the RGB image after the aspect-preserving bicubic resize, uint8 HWC (pixel value = u8/255)")
        refs.put(f"{name}_positions", pos[:p].astype(np.int32), "patch positions (x, y)")

        # tower, through mlx-vlm, HF-style padded input (padding patches are masked out)
        x = mx.array(patches[None].astype(np.float32))
        ppos = mx.array(pos[None].astype(np.int32))
        pad = mx.all(ppos == -1, axis=-1)
        h = pe.embed_patches(x, ppos, pad)
        refs.put(f"{name}_patch_embed", np32(h)[0, :p], "patch embedding: 2(x-0.5) W^T + T[0][x] + T[1][y]")
        valid = ~pad
        m = mx.expand_dims(valid, 1) * mx.expand_dims(valid, 2)
        m = mx.expand_dims(mx.where(m, mx.array(0.0), mx.array(-1e4)), 1)
        for i, layer in enumerate(vt.encoder.layers):
            h = layer(h, ppos, m)
            refs.put(f"{name}_layer{i}", np32(h)[0, :p], f"vision encoder layer {i} output")
        pooled, _ = vt.pooler(h, ppos, pad, output_length=patches.shape[0] // 9)
        pooled = pooled[:, :n]
        refs.put(f"{name}_pooled", np32(pooled)[0], "3x3 position-based average pool times sqrt(hidden): the tower output")
        tower = vt(x, ppos)
        assert np.abs(np32(tower)[0] - np32(pooled)[0]).max() < 1e-5
        # the unpadded NCHW path gives the same tokens
        nchw = mx.array(grid.transpose(2, 0, 1)[None].astype(np.float32))
        assert np.abs(np32(vt(nchw))[0] - np32(pooled)[0]).max() < 1e-4
        soft = model.embed_vision(pooled)
        refs.put(f"{name}_soft", np32(soft)[0], "soft tokens: embed_vision(RMSNorm_0(pooled)) [N, D_text]")
        softs.append((n, soft[0]))

    # a prompt with both images: bos, text, (boi, N x image, eoi) per image, text
    ids = [2, 17, 29]
    for k, (n, _) in enumerate(softs):
        ids += [BOI] + [IMG] * n + [EOI] + [40 + k, 41 + k]
    ids += [60, 61]
    input_ids = mx.array([ids], dtype=mx.int32)
    feats = mx.concatenate([s for _, s in softs], axis=0)[None]
    # mlx-vlm scatters cached features only when pixel values are given (not read then)
    emb = model.get_input_embeddings(input_ids=input_ids, pixel_values=mx.zeros((1,)), cached_image_features=feats)
    merged = np32(emb.inputs_embeds)[0]
    assert np.abs(merged[np.array(ids) == IMG] - np32(feats)[0]).max() == 0, "soft tokens not scattered"
    refs.put("input_ids", np.array(ids, np.int32), "prompt ids: both images' placeholder runs")
    refs.put("merged_embeds", np32(emb.inputs_embeds)[0], "decoder input: text rows * sqrt(D), image rows = soft tokens (unscaled)")
    refs.put("per_layer_inputs", np32(emb.per_layer_inputs)[0], "per-layer inputs (image ids read as id 0)")
    out = model.language_model(inputs=input_ids, inputs_embeds=emb.inputs_embeds, per_layer_inputs=emb.per_layer_inputs)
    refs.put("logits", np32(out.logits)[0], "logits of every position (causal decoder, as HF for E2B/E4B)")
    refs.close({"budget": budget, "tokens": [n for n, _ in softs]})


def gemma3(d):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    cfg = gemma3_config()
    size = cfg["vision_config"]["image_size"]
    proc_cfg = {
        "image_processor_type": "Gemma3ImageProcessor",
        "do_resize": True,
        "size": {"height": size, "width": size},
        "resample": 2,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
        "pan_and_scan_min_crop_size": 256,
        "pan_and_scan_max_num_crops": 4,
        "pan_and_scan_min_ratio_to_activate": 1.2,
    }
    save_checkpoint(d, cfg, instantiate(cfg), random_weights(instantiate(cfg), 3, clip=False), proc_cfg)
    model = load_model(d)
    refs = Refs(d)
    proc = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    sig = model.vision_tower.vision_model
    # HF's post-LayerNorm uses layer_norm_eps (mlx-vlm: the MLX default 1e-5)
    sig.post_layernorm.eps = cfg["vision_config"]["layer_norm_eps"]
    softs = []
    for name, img in photos(d):
        pv = np.asarray(proc.preprocess([img], return_tensors="np")["pixel_values"])[0]  # [3, S, S]
        refs.put(f"{name}_pixels", pv, "HF Gemma3ImageProcessorPil pixel values: bilinear squash, (x/255 - 0.5)/0.5, CHW")
        x = mx.array(pv.transpose(1, 2, 0)[None].astype(np.float32))
        h = sig.embeddings(x)
        refs.put(f"{name}_patch_embed", np32(h)[0], "patch embedding (14x14 stride-14 conv + bias) + learned positions")
        for i, layer in enumerate(sig.encoder.layers):
            h = layer(h, None)
            refs.put(f"{name}_layer{i}", np32(h)[0], f"SigLIP encoder layer {i} output")
        h = sig.post_layernorm(h)
        refs.put(f"{name}_post_ln", np32(h)[0], "post LayerNorm (eps = layer_norm_eps, as HF)")
        proj = model.multi_modal_projector
        g = h.reshape(1, size // 14, size // 14, -1)
        pooled = proj.avg_pool(g).reshape(1, -1, g.shape[-1])
        refs.put(f"{name}_pooled", np32(pooled)[0], "4x4 average pool of the patch grid, row-major")
        soft = proj(h)
        refs.put(f"{name}_soft", np32(soft)[0], "soft tokens: GemmaRMSNorm(pooled) @ mm_input_projection_weight")
        softs.append(soft[0])

    n = cfg["mm_tokens_per_image"]
    ids = [2, 17, 29]
    for k in range(len(softs)):
        ids += [BOI] + [IMG] * n + [EOI] + [40 + k, 41 + k]
    ids += [60, 61]
    t = len(ids)
    lm = model.language_model
    emb = lm.model.embed_tokens(mx.array([ids]))
    d_text = cfg["text_config"]["hidden_size"]
    scale = mx.array(d_text**0.5, mx.bfloat16).astype(mx.float32)
    emb = emb * scale
    is_img = np.array(ids) == IMG
    merged = np32(emb)[0]
    merged[is_img] = np.concatenate([np32(s) for s in softs], axis=0)
    refs.put("input_ids", np.array(ids, np.int32), "prompt ids: both images' placeholder runs")
    refs.put("merged_embeds", merged, "decoder input: text rows * bf16(sqrt D), image rows = soft tokens (unscaled, HF)")

    # HF mask: causal, OR same image block (each contiguous run of image tokens), on every layer;
    # sliding layers AND the window.
    block = np.where(is_img, np.cumsum(np.concatenate([[is_img[0]], is_img[1:] & ~is_img[:-1]])), 0)
    q = np.arange(t)[:, None]
    k = np.arange(t)[None, :]
    causal = k <= q
    same = (block[:, None] == block[None, :]) & (block[:, None] > 0)
    window = cfg["text_config"]["sliding_window"]
    full_mask = causal | same
    slide_mask = full_mask & (q - k < window)
    refs.put("attn_mask_full", full_mask.astype(np.uint8), "HF decoder mask of global layers: causal | same image block")
    refs.put("attn_mask_sliding", slide_mask.astype(np.uint8), "HF decoder mask of sliding layers: window & (causal | same block)")

    def run(masks):
        h = mx.array(merged[None])
        for i, layer in enumerate(lm.model.layers):
            mk = masks[i % 2 == 1]
            h = layer(h, mx.array(mk)[None, None], None)
        return np32(lm.lm_head(lm.model.norm(h)))[0]

    refs.put("logits", run((slide_mask, full_mask)), "logits with HF's image-block bidirectional mask")
    causal_slide = causal & (q - k < window)
    refs.put("logits_causal", run((causal_slide, causal)), "logits with a plain causal mask (mlx-vlm's behaviour)")
    refs.close({"tokens_per_image": n})


# Tokenizer and chat template of the tiny checkpoints: a WordLevel vocabulary of 512 ids
# ("w4" .. "w499"), the image ids remapped above, each family's turn markers, and a chat
# template in each family's turn format that renders an image item as the family's marker.
TOKENS = {
    "gemma3": {IMG: "<image_soft_token>", BOI: "<start_of_image>", EOI: "<end_of_image>", 506: "<start_of_turn>", 507: "<end_of_turn>"},
    "gemma4": {IMG: "<|image|>", BOI: "<|image>", EOI: "<image|>", AUD: "<|audio|>", BOA: "<|audio>", EOA: "<audio|>", 506: "<|turn>", 507: "<turn|>"},
}
WORDS = {508: "user", 509: "model", 510: "system"}

TEMPLATES = {
    "gemma3": (
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "<start_of_turn>{{ role }}\n"
        "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for item in m['content'] %}"
        "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
        "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    "gemma4": (
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "<|turn>{{ role }}\n"
        "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for item in m['content'] %}"
        "{% if item['type'] == 'image' %}<|image|>{% elif item['type'] == 'audio' %}<|audio|>"
        "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
        "{% endfor %}{% endif %}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
    ),
}


def tokenizer_files(d, family):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    special = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", **TOKENS[family]}
    vocab = {}
    for i in range(512):
        vocab[special.get(i) or WORDS.get(i) or f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken(special[i], special=True, normalized=False) for i in sorted(special)])
    tok.save(str(d / "tokenizer.json"))
    names = {"image_token": TOKENS[family][IMG], "boi_token": TOKENS[family][BOI], "eoi_token": TOKENS[family][EOI]}
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
          "unk_token": "<unk>", "model_max_length": 1024, "extra_special_tokens": names}
    (d / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    (d / "chat_template.jinja").write_text(TEMPLATES[family])
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 507], "do_sample": False}, indent=2) + "\n")


def image_soft(model, family, cfg, img):
    """The soft tokens of one image, as the references above compute them."""
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        size = cfg["vision_config"]["image_size"]
        sig = model.vision_tower.vision_model
        sig.post_layernorm.eps = cfg["vision_config"]["layer_norm_eps"]
        pv = np.asarray(Gemma3ImageProcessorPil(size={"height": size, "width": size}).preprocess([img], return_tensors="np")["pixel_values"])[0]
        h = sig.embeddings(mx.array(pv.transpose(1, 2, 0)[None].astype(np.float32)))
        for layer in sig.encoder.layers:
            h = layer(h, None)
        return model.multi_modal_projector(sig.post_layernorm(h))[0]
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    _, patches, pos, n = gemma4_resized(Gemma4ImageProcessorPil(max_soft_tokens=70), img)
    tower = model.vision_tower(mx.array(patches[None].astype(np.float32)), mx.array(pos[None].astype(np.int32)))
    return model.embed_vision(tower[:, :n])[0]


def prompt_logits(model, family, cfg, ids, soft):
    """Logits of every position of `ids` with `soft` in its image run (HF semantics)."""
    if family == "gemma4":
        emb = model.get_input_embeddings(input_ids=mx.array([ids], dtype=mx.int32), pixel_values=mx.zeros((1,)), cached_image_features=soft[None])
        out = model.language_model(inputs=mx.array([ids], dtype=mx.int32), inputs_embeds=emb.inputs_embeds, per_layer_inputs=emb.per_layer_inputs)
        return np32(out.logits)[0]
    lm = model.language_model
    t = len(ids)
    scale = mx.array(cfg["text_config"]["hidden_size"] ** 0.5, mx.bfloat16).astype(mx.float32)
    merged = np32(lm.model.embed_tokens(mx.array([ids])) * scale)[0]
    is_img = np.array(ids) == IMG
    merged[is_img] = np32(soft)
    block = np.where(is_img, np.cumsum(np.concatenate([[is_img[0]], is_img[1:] & ~is_img[:-1]])), 0)
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    full = (k <= q) | ((block[:, None] == block[None, :]) & (block[:, None] > 0))
    slide = full & (q - k < cfg["text_config"]["sliding_window"])
    h = mx.array(merged[None])
    for i, layer in enumerate(lm.model.layers):
        h = layer(h, mx.array((slide, full)[i % 2 == 1])[None, None], None)
    return np32(lm.lm_head(lm.model.norm(h)))[0]


CHAT_TEXT = "w17 w29 w40"
PAN_MIN_CROP = 32
GREEDY = 4


def chat_refs(d, family):
    """The tokenizer files, then HF's processing of a chat turn holding the square image and
    some text (Gemma 3: `Gemma3Processor`; Gemma 4: the marker expansion of
    `Gemma4Processor.replace_image_token`, its video and audio processors needing torch), and
    the greedy continuation of that prompt (HF semantics: Gemma 3's image span bidirectional
    in the prompt; each new token causal)."""
    from transformers import AutoTokenizer

    tokenizer_files(d, family)
    tok = AutoTokenizer.from_pretrained(str(d))
    tpl = (d / "chat_template.jinja").read_text()
    img = Image.open(d / "square.png").convert("RGB")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CHAT_TEXT}]}]
    cfg = json.loads((d / "config.json").read_text())
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
        from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

        size = cfg["vision_config"]["image_size"]
        proc = Gemma3Processor(Gemma3ImageProcessorPil(size={"height": size, "width": size}), tok, chat_template=tpl,
                               image_seq_length=cfg["mm_tokens_per_image"])
        text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        ids = np.asarray(proc(text=[text], images=[[img]], return_tensors="np")["input_ids"])[0]
    else:
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        n = int(np.asarray(Gemma4ImageProcessorPil(max_soft_tokens=70).preprocess([img], return_tensors="np")["num_soft_tokens_per_image"])[0])
        text = tok.apply_chat_template(msgs, chat_template=tpl, add_generation_prompt=True, tokenize=False)
        text = text.replace(tok.image_token, f"{tok.boi_token}{tok.image_token * n}{tok.eoi_token}")
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"])
    refs = Refs(d)
    refs.manifest = json.loads((refs.dir / "manifest.json").read_text())
    info = refs.manifest.pop("_info")
    refs.put("chat_ids", ids.astype(np.int32), f"HF's processing of a user turn [image square.png, text {CHAT_TEXT!r}] with the generation prompt")
    if family == "gemma3":
        # pan-and-scan (crops of at least 32 px here): the wide image's run and its crops' runs
        wide = Image.open(d / "wide.png").convert("RGB")
        msgs_wide = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CHAT_TEXT}]}]
        text = proc.apply_chat_template(msgs_wide, add_generation_prompt=True, tokenize=False)
        pan = proc(text=[text], images=[[wide]], return_tensors="np", do_pan_and_scan=True, pan_and_scan_min_crop_size=PAN_MIN_CROP,
                   pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)
        refs.put("chat_ids_pan_and_scan", np.asarray(pan["input_ids"])[0].astype(np.int32),
                 f"as chat_ids with wide.png, pan-and-scan on (min crop {PAN_MIN_CROP} px): the whole image and its crops")

    model = load_model(d)
    soft = image_soft(model, family, cfg, img)
    toks = [int(t) for t in ids]
    for _ in range(GREEDY):
        toks.append(int(np.argmax(prompt_logits(model, family, cfg, toks, soft)[-1])))
    refs.put("chat_greedy", np.array(toks[len(ids):], np.int32), f"greedy tokens after chat_ids ({GREEDY})")
    refs.put("chat_logits", prompt_logits(model, family, cfg, toks, soft), "logits of every position of chat_ids and chat_greedy")
    refs.close(info)


AUDIO_CLIP = "chirp_16k_s32_stereo"  # 25 frames, the last 4 padding: 7 tower rows, 6 real
AUDIO_TEXT = "w23 w31"


def audio_refs(d):
    """A prompt holding the square image and an audio clip, as HF's Gemma 4 processor writes
    it (`replace_image_token`, `replace_audio_token`: `<|audio>`, one `<|audio|>` per real
    tower row, `<audio|>`), through mlx-vlm's merge (`masked_scatter` of the tower's rows into
    the audio placeholders) and decoder. The clip's features are HF's (`make_audio_fixtures.py`)."""
    from transformers import AutoTokenizer
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    (d / "chat_template.jinja").write_text(TEMPLATES["gemma4"])
    audio_dir = ROOT / "tests" / "fixtures" / "audio"
    feats = np.load(audio_dir / f"{AUDIO_CLIP}.gemma4.features.npy").astype(np.float32)
    valid = np.load(audio_dir / f"{AUDIO_CLIP}.gemma4.mask.npy").astype(bool)
    n_audio = int(valid[::2][::2].sum())
    model = load_model(d)
    cfg = json.loads((d / "config.json").read_text())
    img = Image.open(d / "square.png").convert("RGB")
    soft_img = image_soft(model, "gemma4", cfg, img)
    n_img = soft_img.shape[0]

    # the chat turn [image, text, audio] through the template, each marker expanded
    tok = AutoTokenizer.from_pretrained(str(d))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": AUDIO_TEXT}, {"type": "audio"}]}]
    text = tok.apply_chat_template(msgs, chat_template=(d / "chat_template.jinja").read_text(), add_generation_prompt=True, tokenize=False)
    aud = TOKENS["gemma4"][AUD]
    text = text.replace(tok.image_token, f"{tok.boi_token}{tok.image_token * n_img}{tok.eoi_token}")
    text = text.replace(aud, f"{TOKENS['gemma4'][BOA]}{aud * n_audio}{TOKENS['gemma4'][EOA]}")
    ids = [int(t) for t in np.asarray(tok(text, add_special_tokens=False)["input_ids"])]
    assert ids.count(AUD) == n_audio and ids.count(IMG) == n_img

    input_ids = mx.array([ids], dtype=mx.int32)
    emb = model.get_input_embeddings(input_ids=input_ids, pixel_values=mx.zeros((1,)), cached_image_features=soft_img[None],
                                     audio_features=mx.array(feats[None]), audio_mask=mx.array(~valid[None]))
    enc, _ = model.audio_tower(mx.array(feats[None]), mx.array(~valid[None]))
    soft_audio = np32(model.embed_audio(enc))[0][:n_audio]
    merged = np32(emb.inputs_embeds)[0]
    assert np.abs(merged[np.array(ids) == AUD] - soft_audio).max() == 0, "audio soft tokens not scattered"
    out = model.language_model(inputs=input_ids, inputs_embeds=emb.inputs_embeds, per_layer_inputs=emb.per_layer_inputs)

    refs = Refs(d)
    refs.manifest = json.loads((refs.dir / "manifest.json").read_text())
    info = refs.manifest.pop("_info")
    refs.put("audio_features", feats, f"log-mel features of tests/fixtures/audio/{AUDIO_CLIP}.wav (HF's extractor), the tower's input")
    refs.put("audio_valid", valid.astype(np.uint8), "frame mask of audio_features (1: a real frame)")
    refs.put("audio_soft", soft_audio, "audio soft tokens: embed_audio(audio_tower(features)), the rows of real frames [N, D_text]")
    refs.put("audio_chat_ids", np.array(ids, np.int32), f"a user turn [image square.png, text {AUDIO_TEXT!r}, audio] with the generation prompt, markers expanded as HF does")
    refs.put("audio_merged_embeds", merged, "decoder input: text rows * sqrt(D), image and audio rows = their soft tokens")
    refs.put("audio_logits", np32(out.logits)[0], "logits of every position of audio_chat_ids")
    refs.close(info)


def quantized_variant(src, dst, mode, bits, group, vision_dtype, skip_vision=True):
    """`src` re-stored the way `mlx_vlm.convert` writes a quantized model: the text model
    quantized (`mode`, `bits`, `group`), the towers kept float (cast to `vision_dtype`) unless
    `skip_vision` is off. Read back through mlx-vlm's loader; no references of its own."""
    import mlx.nn as nn

    from mlx_vlm.utils import get_class_predicate

    model = load_model(src)
    cast = {k: v.astype(vision_dtype) for k, v in tree_flatten(model.parameters()) if not k.startswith("language_model.")}
    model.load_weights(list(cast.items()), strict=False)
    q = {"group_size": group, "bits": bits, "mode": mode}
    base = get_class_predicate(skip_vision=skip_vision)
    # as mlx-lm's converter: only modules whose input dim divides into groups
    pred = lambda p, m: base(p, m) and m.weight.shape[-1] % group == 0  # noqa: E731
    nn.quantize(model, group_size=group, bits=bits, mode=mode, class_predicate=pred)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization"] = q
    cfg["quantization_config"] = q
    dst.mkdir(parents=True, exist_ok=True)
    params = dict(tree_flatten(model.parameters()))
    params.pop("language_model.lm_head.weight", None)
    mx.save_safetensors(str(dst / "model.safetensors"), params, metadata={"format": "mlx"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copy(src / "preprocessor_config.json", dst / "preprocessor_config.json")
    load_model(dst)  # mlx-vlm reads it back


VARIANTS = [
    # (name, source, mode, bits, group, tower dtype, towers quantized too)
    ("gemma4-q4", "gemma4", "affine", 4, 32, mx.bfloat16, False),
    ("gemma4-mxfp4", "gemma4", "mxfp4", 4, 32, mx.bfloat16, False),
    ("gemma3-q8-towers", "gemma3", "affine", 8, 64, mx.float16, True),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["gemma4", "gemma3"], action="append")
    ap.add_argument("--chat-only", action="store_true", help="only (re)write the tokenizers, chat templates and chat references")
    ap.add_argument("--audio-only", action="store_true", help="only (re)write Gemma 4's audio prompt references")
    a = ap.parse_args()
    if a.audio_only:
        audio_refs(OUT / "gemma4")
        return
    if a.chat_only:
        for fam in ("gemma4", "gemma3"):
            if not a.only or fam in a.only:
                chat_refs(OUT / fam, fam)
        return
    for fam, f in (("gemma4", gemma4), ("gemma3", gemma3)):
        if a.only and fam not in a.only:
            continue
        d = OUT / fam
        if d.exists():
            shutil.rmtree(d)
        f(d)
        chat_refs(d, fam)
        if fam == "gemma4":
            audio_refs(d)
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        print(f"{fam}: {size / 1e6:.2f} MB in {d.relative_to(ROOT)}")
    for name, src, mode, bits, group, vdt, towers in VARIANTS:
        if a.only and src not in a.only:
            continue
        d = OUT / name
        if d.exists():
            shutil.rmtree(d)
        quantized_variant(OUT / src, d, mode, bits, group, vdt, skip_vision=not towers)
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        print(f"{name}: {size / 1e6:.2f} MB in {d.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
