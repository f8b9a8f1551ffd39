#!/usr/bin/env python3
"""Writes the audio fixtures of tests/audio.rs: short clips (speech spoken by espeak-ng, and
tones) as WAV/FLAC/OGG files, and what HF transformers' Gemma 4 and Gemma 3n audio feature
extractors compute from them (log-mel features, frame masks, soft-token counts) as .npy.

Needs: numpy, scipy, lameenc, transformers (no torch), and the espeak-ng and sox programs.

    python tools/make_audio_fixtures.py [--out tests/fixtures/audio]

Clips at a rate other than 16 kHz are resampled for HF by sox (`rate -v -L`, linear phase,
float output), cut or zero-padded to ceil(n * 16000 / rate) samples; the resampled signal is
saved too (`<clip>.resampled16k.npy`) so the resampler can be checked on its own.
"""
import argparse
import json
import os
import struct
import subprocess
import tempfile
import types

import lameenc
import numpy as np
import scipy.io.wavfile
import transformers
from transformers import Gemma3nAudioFeatureExtractor, Gemma4AudioFeatureExtractor
from transformers.models.gemma3n.processing_gemma3n import Gemma3nProcessor
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

RATE = 16_000


def write_wav(path, rate, data, kind):
    """data: [frames, channels] ints (pcm) or float32 values (float). kind: s16, s24, s32, f32.
    s24 is written as WAVE_FORMAT_EXTENSIBLE to cover that header too."""
    frames, channels = data.shape
    bits = {"s16": 16, "s24": 24, "s32": 32, "f32": 32}[kind]
    width = bits // 8
    if kind == "s16":
        raw = data.astype("<i2").tobytes()
    elif kind == "s32":
        raw = data.astype("<i4").tobytes()
    elif kind == "f32":
        raw = data.astype("<f4").tobytes()
    else:
        b = data.astype("<i4").reshape(-1).view(np.uint8).reshape(-1, 4)[:, :3]
        raw = b.tobytes()
    tag = 3 if kind == "f32" else 1
    if kind == "s24":
        guid_tail = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
        fmt = struct.pack("<HHIIHHHHI", 0xFFFE, channels, rate, rate * channels * width, channels * width, bits,
                          22, bits, 0) + struct.pack("<H", tag) + guid_tail
    else:
        fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * channels * width, channels * width, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    # An unknown chunk before the data, as many writers add (LIST/INFO).
    body += b"LIST" + struct.pack("<I", 4) + b"INFO"
    body += b"data" + struct.pack("<I", len(raw)) + raw
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", len(body)) + body)


def speak(text, tmp, speed=175):
    path = os.path.join(tmp, "speech.wav")
    subprocess.run(["espeak-ng", "-s", str(speed), "-w", path, text], check=True)
    rate, x = scipy.io.wavfile.read(path)
    assert x.dtype == np.int16, x.dtype
    # Trim leading/trailing silence a little to keep the files small.
    nz = np.nonzero(np.abs(x) > 64)[0]
    x = x[max(nz[0] - 800, 0): nz[-1] + 800]
    return rate, x.astype(np.int16)


def sox_resample(x, rate, tmp):
    """Mono float signal at `rate` → 16 kHz float32 by sox, length ceil(n*16000/rate)."""
    src = os.path.join(tmp, "in.wav")
    dst = os.path.join(tmp, "out.wav")
    scipy.io.wavfile.write(src, rate, x.astype(np.float32))
    subprocess.run(["sox", src, "-e", "floating-point", "-b", "32", dst, "rate", "-v", "-L", str(RATE)], check=True)
    r, y = scipy.io.wavfile.read(dst)
    assert r == RATE and y.dtype == np.float32
    n = -(-len(x) * RATE // rate)
    y = y[:n]
    return np.pad(y, (0, n - len(y))).astype(np.float32)


def gemma4_tokens(mask):
    ns = types.SimpleNamespace(boa_token="<", audio_token="A", eoa_token=">")
    text = Gemma4Processor.replace_audio_token(ns, {"input_features_mask": [mask]}, 0)
    return text.count("A")


def gemma3n_tokens():
    import inspect
    return inspect.signature(Gemma3nProcessor.__init__).parameters["audio_seq_length"].default


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/fixtures/audio")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp()
    clips = {}

    # 1. Speech at 16 kHz, mono, 16-bit (espeak speaks at 22050 Hz; sox brings it to 16 kHz
    #    and the 16-bit file is the input of both sides).
    rate, x = speak("The quick brown fox jumps over the lazy dog.", tmp, speed=230)
    scipy.io.wavfile.write(os.path.join(tmp, "s22.wav"), rate, x)
    p = os.path.join(args.out, "speech_16k.wav")
    subprocess.run(["sox", os.path.join(tmp, "s22.wav"), "-D", "-b", "16", p, "rate", "-v", "-L", str(RATE)], check=True)
    r, y = scipy.io.wavfile.read(p)
    assert r == RATE and y.dtype == np.int16
    clips["speech_16k"] = dict(file="speech_16k.wav", rate=RATE, channels=1, wave=(y.astype(np.float64) / 32768.0))
    # The same clip as FLAC (lossless: the same samples) and OGG/Vorbis (lossy).
    subprocess.run(["sox", p, os.path.join(args.out, "speech_16k.flac")], check=True)
    subprocess.run(["sox", p, "-C", "3", os.path.join(args.out, "speech_16k.ogg")], check=True)
    enc = lameenc.Encoder()
    enc.set_bit_rate(48)
    enc.set_in_sample_rate(RATE)
    enc.set_channels(1)
    enc.set_quality(2)
    with open(os.path.join(args.out, "speech_16k.mp3"), "wb") as f:
        f.write(enc.encode(y.tobytes()) + enc.flush())

    # 2. Speech at 22050 Hz, stereo, 16-bit: left the voice, right the voice at 0.6 delayed 2 ms.
    rate, x = speak("Markbase hears speech at any rate.", tmp, speed=230)
    d = int(0.002 * rate)
    right = np.concatenate([np.zeros(d), 0.6 * x[:-d]]).round().astype(np.int16)
    st = np.stack([x, right], axis=1)
    write_wav(os.path.join(args.out, "speech_22k_stereo.wav"), rate, st, "s16")
    mono = st.astype(np.float64).mean(axis=1) / 32768.0
    clips["speech_22k_stereo"] = dict(file="speech_22k_stereo.wav", rate=rate, channels=2, wave=mono)

    # 3. A 440 Hz tone, amplitude 0.5, 1.0 s at 16 kHz, float32.
    n = np.arange(RATE)
    tone = (0.5 * np.sin(2 * np.pi * 440 * n / RATE)).astype(np.float32)
    write_wav(os.path.join(args.out, "tone440_16k_f32.wav"), RATE, tone[:, None], "f32")
    clips["tone440_16k_f32"] = dict(file="tone440_16k_f32.wav", rate=RATE, channels=1, wave=tone.astype(np.float64))

    # 4. A 1 kHz tone, 0.3 s at 48 kHz, 24-bit extensible (padded frames at the end).
    r48 = 48_000
    n = np.arange(int(0.3 * r48))
    t24 = np.round(0.4 * np.sin(2 * np.pi * 1000 * n / r48) * 8388607).astype(np.int32)
    write_wav(os.path.join(args.out, "tone1k_48k_s24.wav"), r48, t24[:, None], "s24")
    clips["tone1k_48k_s24"] = dict(file="tone1k_48k_s24.wav", rate=r48, channels=1, wave=t24 / 8388608.0)

    # 5. A 0.25 s chirp at 16 kHz, 32-bit integers, stereo (left chirp, right its negation/2).
    n = np.arange(4000)
    ch = 0.3 * np.sin(2 * np.pi * (200 + 3000 * n / 4000) * n / RATE)
    c32 = np.round(np.stack([ch, -0.5 * ch], axis=1) * 2147483647).astype(np.int64).astype(np.int32)
    write_wav(os.path.join(args.out, "chirp_16k_s32_stereo.wav"), RATE, c32, "s32")
    clips["chirp_16k_s32_stereo"] = dict(file="chirp_16k_s32_stereo.wav", rate=RATE, channels=2,
                                         wave=c32.astype(np.float64).mean(axis=1) / 2147483648.0)

    g4 = Gemma4AudioFeatureExtractor()
    g3n = Gemma3nAudioFeatureExtractor()
    manifest = {"transformers": transformers.__version__, "numpy": np.__version__, "clips": {}}
    for name, c in clips.items():
        wave = c["wave"].astype(np.float32)
        entry = {"file": c["file"], "rate": c["rate"], "channels": c["channels"], "samples_in": len(wave)}
        if c["rate"] != RATE:
            wave = sox_resample(wave, c["rate"], tmp)
            np.save(os.path.join(args.out, f"{name}.resampled16k.npy"), wave)
            entry["resampled"] = f"{name}.resampled16k.npy"
        entry["samples_16k"] = len(wave)
        for fam, fe in (("gemma4", g4), ("gemma3n", g3n)):
            out = fe([wave])
            feats = np.asarray(out["input_features"][0], dtype=np.float32)
            mask = np.asarray(out["input_features_mask"][0]).astype(np.uint8)
            np.save(os.path.join(args.out, f"{name}.{fam}.features.npy"), feats)
            np.save(os.path.join(args.out, f"{name}.{fam}.mask.npy"), mask)
            tokens = gemma4_tokens(out["input_features_mask"][0]) if fam == "gemma4" else gemma3n_tokens()
            entry[fam] = {"frames": int(feats.shape[0]), "valid": int(mask.sum()), "soft_tokens": int(tokens),
                          "max_abs": float(np.abs(feats).max())}
        manifest["clips"][name] = entry
        print(name, json.dumps({k: v for k, v in entry.items() if k in ("samples_16k", "gemma4", "gemma3n")}))
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
