#!/usr/bin/env python3
"""A tiny Gemma 3n audio tower (USM conformer) built with mlx-vlm's own classes, with float32
references of every intermediate of the audio path, down to the clip's 188 soft tokens.

Needs `pip install "mlx[cpu]" mlx-vlm transformers` (no torch: HF's feature extractor is
numpy). Writes `tests/fixtures/audio_tower/gemma3n/`:

* `config.json`, `model.safetensors`: a `gemma3n` config (the tiny text config of the
  `gemma3n-bf16` fixture, its tensors not stored) whose `audio_config` is small (hidden 48,
  2 heads, 2 conformer blocks, subsampling channels 8 and 4), and the `audio_tower.*` and
  `embed_audio.*` tensors (F32, random weights);
* `ref.safetensors`: for each clip `<clip>.<name>` (the references come from a model that
  re-read the saved weights):
  - `features` `[T, 128]`, `valid` `[T]` (u8): HF `Gemma3nAudioFeatureExtractor`'s log-mel
    features and frame mask (the tower's input);
  - `sscp0` `[T1, 64, 8]`, `sscp1` `[T2, 32, 4]`: each subsampling conv block (3x3 stride-2
    conv padded 0 above and 2 below, cumulative group norm, ReLU), `sscp_valid` `[T2]` (u8:
    the frame mask at every 4th frame);
  - `subsample` `[T2, 48]`: the input projection of the flattened (freq, channel) rows;
  - `block<i>` `[T2, 48]`: each conformer block's output;
  - `encoder` `[R, 48]`: every 4th row, padded rows zeroed (the tower output), `valid_rows`
    `[R]` (u8);
  - `embedded` `[R, 32]`: `embed_audio` of the encoder rows (soft norm, projection, post norm);
  - `soft` `[188, 32]`: the clip's soft tokens as HF's `Gemma3nModel` makes them: padded rows
    and the slots past R take the hard embedding of the text vocabulary's last id.

The clips: `speech_16k` (the committed HF features of `tests/fixtures/audio/`: 196 frames,
all valid, 13 encoder rows) and `tone1k_60f` (the 28-frame 1 kHz tone padded as HF pads a
batch, to 60 frames; 7 of its 15 subsampled rows and 2 of its 4 encoder rows are real).

mlx-vlm pads with the hard embedding of its top-level `vocab_size - 1`, which real Gemma 3n
configs do not set (its default 257152 is no audio id); HF takes the text vocabulary's last
id. This script follows HF (the config's top-level `vocab_size` is the text one).

Deterministic: the same package versions give the same files.
"""

import json
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_vlm.models.gemma3n.audio import AudioModel
from mlx_vlm.models.gemma3n.config import AudioConfig
from mlx_vlm.models.gemma3n.gemma3n import Gemma3nMultimodalEmbedder
from transformers import Gemma3nAudioFeatureExtractor

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "audio_tower" / "gemma3n"
AUDIO = ROOT / "tests" / "fixtures" / "audio"
TEXT = ROOT / "tests" / "fixtures" / "gemma3n-bf16" / "config.json"
SLOTS = 188


def config():
    text = json.loads(TEXT.read_text())["text_config"]
    vocab = text["vocab_size"]  # 512: 256 text ids, 128 vision ids, 128 audio ids
    audio = {
        "model_type": "gemma3n_audio",
        "input_feat_size": 128,
        "hidden_size": 48,
        "conf_num_hidden_layers": 2,
        "conf_num_attention_heads": 2,
        "conf_attention_chunk_size": 12,
        "conf_attention_context_left": 13,
        "conf_attention_context_right": 0,
        "conf_attention_invalid_logits_value": -1e9,
        "conf_attention_logit_cap": 50.0,
        "conf_conv_kernel_size": 5,
        "conf_reduction_factor": 4,
        "conf_residual_weight": 0.5,
        "sscp_conv_channel_size": [8, 4],
        "sscp_conv_kernel_size": [[3, 3], [3, 3]],
        "sscp_conv_stride_size": [[2, 2], [2, 2]],
        "sscp_conv_group_norm_eps": 1e-3,
        "sscp_conv_eps": 1e-3,
        "rms_norm_eps": 1e-6,
        "gradient_clipping": 1e10,
        "vocab_size": 128,
        "vocab_offset": vocab - 128,
    }
    return {
        "architectures": ["Gemma3nForConditionalGeneration"],
        "model_type": "gemma3n",
        "text_config": text,
        "audio_config": audio,
        "audio_soft_tokens_per_image": SLOTS,
        "audio_token_id": vocab - 127,
        "boa_token_id": 5,
        "eoa_token_id": vocab - 128,
        "vocab_size": vocab,
    }


def random_weights(params, seed):
    """Random F32 weights: unit-ish norms, 1/sqrt(fan-in) linears and convs."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in sorted(params.items()):
        shape = tuple(p.shape)
        if "norm" in name:
            v = 1.0 + rng.normal(0, 0.1, shape)
        elif len(shape) == 1:
            v = rng.normal(0, 0.5, shape)
        elif name.endswith("embedding.weight"):
            v = rng.normal(0, 0.5, shape)
        else:
            v = rng.normal(0, 1.0 / np.sqrt(np.prod(shape[1:])), shape)
        out[name] = mx.array(np.asarray(v, np.float32))
    return out


def np32(x):
    mx.eval(x)
    return np.array(x.astype(mx.float32))


def features():
    """The clips' HF features and frame masks."""
    clips = {}
    feats = np.load(AUDIO / "speech_16k.gemma3n.features.npy").astype(np.float32)
    clips["speech_16k"] = (feats, np.load(AUDIO / "speech_16k.gemma3n.mask.npy").astype(bool))
    fx = Gemma3nAudioFeatureExtractor()
    tone = np.load(AUDIO / "tone1k_48k_s24.resampled16k.npy").astype(np.float32)
    # padded as in a batch with a longer clip: 60 frames
    n = 513 + 59 * 160
    out = fx([tone], sampling_rate=16000, padding="max_length", max_length=n, return_tensors="np")
    f, m = out["input_features"][0].astype(np.float32), out["input_features_mask"][0].astype(bool)
    assert f.shape[0] == 60 and 0 < m.sum() < 60, (f.shape, m.sum())
    clips["tone1k_60f"] = (f, m)
    return clips


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    cfg = config()
    ac = AudioConfig.from_dict(cfg["audio_config"])
    text = types.SimpleNamespace(hidden_size=cfg["text_config"]["hidden_size"])
    tower, embed = AudioModel(ac), Gemma3nMultimodalEmbedder(ac, text)
    params = {f"audio_tower.{k}": v for k, v in tree_flatten(tower.parameters())}
    params.update({f"embed_audio.{k}": v for k, v in tree_flatten(embed.parameters())})
    weights = random_weights(params, 11)
    mx.save_safetensors(str(OUT / "model.safetensors"), weights, metadata={"format": "mlx"})
    (OUT / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    # a fresh tower and embedder, the weights read back from the file
    tower, embed = AudioModel(ac), Gemma3nMultimodalEmbedder(ac, text)
    saved = mx.load(str(OUT / "model.safetensors"))
    tower.load_weights([(k[len("audio_tower."):], v) for k, v in saved.items() if k.startswith("audio_tower.")], strict=True)
    embed.load_weights([(k[len("embed_audio."):], v) for k, v in saved.items() if k.startswith("embed_audio.")], strict=True)
    pad_id = cfg["vocab_size"] - 1
    refs, info = {}, {}
    for clip, (feats, valid) in features().items():
        x = mx.array(feats[None])
        invalid = mx.array(~valid[None])
        refs[f"{clip}.features"] = feats
        refs[f"{clip}.valid"] = valid.astype(np.uint8)
        sc = tower.subsample_conv_projection
        h = sc.conv_0(mx.expand_dims(x, 1))
        refs[f"{clip}.sscp0"] = np32(h.transpose(0, 2, 3, 1))[0]
        h = sc.conv_1(h)
        refs[f"{clip}.sscp1"] = np32(h.transpose(0, 2, 3, 1))[0]
        b, c, t, f = h.shape
        h = sc.input_proj_linear(h.transpose(0, 2, 3, 1).reshape(b, t, f * c))
        refs[f"{clip}.subsample"] = np32(h)[0]
        m = invalid[:, ::4][:, :t]
        refs[f"{clip}.sscp_valid"] = (~np.array(m)[0]).astype(np.uint8)
        for i, block in enumerate(tower.conformer):
            h = block(h, m)
            refs[f"{clip}.block{i}"] = np32(h)[0]
        enc, m2 = tower(x, invalid)
        e = np32(enc)[0]
        # the tower in one call matches the step-by-step path
        want = np.where(np.array(m2)[0][:, None], 0.0, np32(h)[0][::4])
        assert np.abs(e - want).max() < 1e-5, np.abs(e - want).max()
        refs[f"{clip}.encoder"] = e
        refs[f"{clip}.valid_rows"] = (~np.array(m2)[0]).astype(np.uint8)
        emb = embed(inputs_embeds=enc)
        refs[f"{clip}.embedded"] = np32(emb)[0]
        # HF Gemma3nModel: padded rows and the slots past the clip's take the padding embedding
        pad = embed(input_ids=mx.array([[pad_id]]))
        soft = mx.where(m2[..., None], pad, emb)
        soft = mx.concatenate([soft, mx.broadcast_to(pad, (1, SLOTS - soft.shape[1], pad.shape[-1]))], axis=1)
        refs[f"{clip}.soft"] = np32(soft)[0]
        info[clip] = {"frames": int(feats.shape[0]), "valid_frames": int(valid.sum()), "rows": int(t), "encoder_rows": int(e.shape[0]), "valid_encoder_rows": int((~np.array(m2)[0]).sum())}
    mx.save_safetensors(str(OUT / "ref.safetensors"), {k: mx.array(v) for k, v in sorted(refs.items())}, metadata={"clips": json.dumps(info)})
    for k, v in sorted(refs.items()):
        print(k, v.shape, v.dtype, float(np.abs(v.astype(np.float32)).max()))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
