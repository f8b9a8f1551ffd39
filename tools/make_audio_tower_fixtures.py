#!/usr/bin/env python3
"""A tiny Gemma 4 audio tower (USM conformer) built with mlx-vlm's own classes, with float32
references of every intermediate of the audio path.

Needs `pip install "mlx[cpu]" mlx-vlm` (as `make_vlm_fixtures.py`, whose tiny Gemma 4 config
and random weights this reuses, with two conformer blocks instead of one).
Writes `tests/fixtures/audio_tower/gemma4/`:

* `config.json`, `model.safetensors`: the audio tower and `embed_audio` only (F32, random
  weights, finite clip bounds that do clip); the text and vision parts of the config are the
  tiny VLM fixture's, their tensors are not stored;
* `ref.safetensors`: for each clip `<clip>.<name>` (the references come from a model that
  re-read the saved weights):
  - `features` `[T, 128]`, `valid` `[T]` (u8): the committed log-mel features and frame mask
    of `tests/fixtures/audio/<clip>.gemma4.{features,mask}.npy` (the tower's input);
  - `sscp0` `[T1, 64, C0]`, `sscp1` `[T2, 32, C1]`: each subsampling conv block (masked
    input, 3x3 stride-2 conv, channel LayerNorm, ReLU), `sscp_valid` `[T2]` (u8);
  - `subsample` `[T2, hidden]`: the input projection of the flattened (freq, channel) rows;
  - `block<i>` `[T2, hidden]`: each conformer block's output;
  - `encoder` `[T2, output_proj_dims]`: `output_proj`, padded rows zeroed (the tower output);
  - `soft` `[T2, D_text]`: `embed_audio` (no-weight RMSNorm, projection), the soft tokens.

The clips: `speech_16k` (199 frames, all valid: 50 rows, several attention chunks) and
`tone1k_48k_s24` (30 frames, the last one padding). Mlx-vlm and Hugging Face agree on the
audio tower (HF does not zero padded rows before `lconv1d`; valid rows are unaffected).

Deterministic: the same package versions give the same files.
"""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_vlm_fixtures import gemma4_config, instantiate, random_weights  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "audio_tower" / "gemma4"
AUDIO = ROOT / "tests" / "fixtures" / "audio"
CLIPS = ["speech_16k", "tone1k_48k_s24"]


def config():
    cfg = gemma4_config()
    cfg["audio_config"] = dict(cfg["audio_config"], num_hidden_layers=2)
    return cfg


def np32(x):
    mx.eval(x)
    return np.array(x.astype(mx.float32))


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    cfg = config()
    weights = random_weights(instantiate(cfg), 7, clip=True)
    audio = {k: v for k, v in weights.items() if k.startswith(("audio_tower.", "embed_audio."))}
    mx.save_safetensors(str(OUT / "model.safetensors"), audio, metadata={"format": "mlx"})
    (OUT / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    # a fresh model, the audio weights read back from the file
    model = instantiate(cfg)
    model.load_weights(list(mx.load(str(OUT / "model.safetensors")).items()), strict=False)
    at = model.audio_tower
    refs = {}
    info = {}
    for clip in CLIPS:
        feats = np.load(AUDIO / f"{clip}.gemma4.features.npy").astype(np.float32)
        valid = np.load(AUDIO / f"{clip}.gemma4.mask.npy").astype(bool)
        x = mx.array(feats[None])
        invalid = mx.array(~valid[None])
        refs[f"{clip}.features"] = feats
        refs[f"{clip}.valid"] = valid.astype(np.uint8)

        sc = at.subsample_conv_projection
        h = mx.expand_dims(x, -1)
        h, m = sc.layer0(h, invalid)
        refs[f"{clip}.sscp0"] = np32(h)[0]
        h, m = sc.layer1(h, m)
        refs[f"{clip}.sscp1"] = np32(h)[0]
        refs[f"{clip}.sscp_valid"] = (~np.array(m)[0]).astype(np.uint8)
        b, t, f, c = h.shape
        h = sc.input_proj_linear(h.reshape(b, t, f * c))
        refs[f"{clip}.subsample"] = np32(h)[0]
        causal = at._build_causal_valid_mask()
        for i, block in enumerate(at.layers):
            h = block(h, m, causal)
            refs[f"{clip}.block{i}"] = np32(h)[0]
        enc, m2 = at(x, invalid)
        e = np32(enc)[0]
        # the tower in one call matches the step-by-step path
        want = np.where(np.array(m2)[0][:, None], 0.0, np32(at.output_proj(h))[0])
        assert np.abs(e - want).max() < 1e-5, np.abs(e - want).max()
        refs[f"{clip}.encoder"] = e
        soft = model.embed_audio(enc)
        refs[f"{clip}.soft"] = np32(soft)[0]
        info[clip] = {"frames": int(feats.shape[0]), "valid_frames": int(valid.sum()), "rows": int(t), "valid_rows": int((~np.array(m)[0]).sum())}
    mx.save_safetensors(
        str(OUT / "ref.safetensors"),
        {k: mx.array(v) for k, v in sorted(refs.items())},
        metadata={"clips": json.dumps(info)},
    )
    for k, v in sorted(refs.items()):
        print(k, v.shape, v.dtype, float(np.abs(v.astype(np.float32)).max()))
    print(json.dumps(info))


if __name__ == "__main__":
    main()
