#!/usr/bin/env python3
"""Expected outputs of Hugging Face's Gemma image processors on real photographs and odd sizes,
for markbase's image-processor tests.

Needs `pip install pillow scikit-image transformers numpy` (no torch). Writes
`tests/fixtures/images/`:

* `src/*`: the inputs (crops of scikit-image's sample photographs as PNG, JPEG and lossless
  WebP; odd sizes; an RGBA and a grey PNG; a JPEG whose EXIF orientation rotates it);
* `decoded/<name>.png`: the RGB image as PIL decodes it (and, for the EXIF case, as
  `ImageOps.exif_transpose` turns it), after HF's `convert_to_rgb`;
* `out/<name>.<processor>.png`: the resized RGB image behind the processor's pixel values,
  recovered exactly from them (Gemma 4: `x = u8/255`; Gemma 3: `x = (u8/255 - 0.5)/0.5`);
* `manifest.json`: per case, the processor settings, the output size and soft tokens.

Deterministic.
"""

import io
import json
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps
from skimage import data
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.image_transforms import convert_to_rgb

from make_vlm_fixtures import gemma4_resized

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "images"


def sources():
    """(file name, bytes) of each input."""
    coffee = data.coffee()  # 400 x 600
    chelsea = data.chelsea()  # 300 x 451
    astro = data.astronaut()
    camera = data.camera()  # grey 512 x 512
    rocket = data.rocket()  # 427 x 640

    def enc(a, fmt, **kw):
        b = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(a)).save(b, fmt, **kw)
        return b.getvalue()

    out = [
        ("coffee.jpg", enc(coffee, "JPEG", quality=85)),
        ("chelsea.webp", enc(chelsea[::2, ::2], "WEBP", lossless=True)),
        ("astronaut.png", enc(astro[100:260, 180:300], "PNG")),
        ("one_pixel.png", enc(astro[200:201, 200:201], "PNG")),
        ("thin_row.png", enc(astro[300:303, 0:512], "PNG")),
        ("thin_col.png", enc(astro[0:517, 250:253] if astro.shape[0] >= 517 else np.concatenate([astro, astro])[0:517, 250:253], "PNG")),
        ("odd_333x257.png", enc(rocket[50:307, 100:433], "PNG")),
        ("grey.png", enc(camera[100:250, 200:300], "PNG")),
        # tall enough that Pillow resizes vertically first
        ("tall_250x700.png", enc(np.concatenate([astro[:, 100:350], astro[:188, 200:450]]), "PNG")),
    ]
    rgba = np.dstack([astro[0:90, 0:120], np.tile(np.linspace(0, 255, 120).astype(np.uint8), (90, 1))])
    out.append(("alpha.png", enc(rgba, "PNG")))
    # EXIF orientation 6: stored landscape, shown rotated 90 degrees clockwise
    img = Image.fromarray(np.ascontiguousarray(rocket[100:220, 100:300]))
    exif = Image.Exif()
    exif[0x0112] = 6
    b = io.BytesIO()
    img.save(b, "JPEG", quality=90, exif=exif.tobytes())
    out.append(("exif_rotated.jpg", b.getvalue()))
    return out


def processors():
    """(label, processor, recover u8 from pixel values, soft tokens)."""

    def g4(budget):
        p = Gemma4ImageProcessorPil(max_soft_tokens=budget)

        def run(img):
            u8, _, _, soft = gemma4_resized(p, img)
            return u8, soft

        return f"gemma4_{budget}", {"family": "gemma4", "max_soft_tokens": budget}, run

    def g3(size):
        p = Gemma3ImageProcessorPil(size={"height": size, "width": size})

        def run(img):
            pv = np.asarray(p.preprocess([img], return_tensors="np")["pixel_values"])[0]
            u8f = (pv.transpose(1, 2, 0) * 0.5 + 0.5) * 255
            u8 = np.rint(u8f).astype(np.uint8)
            assert np.abs(u8 - u8f).max() < 1e-3
            return u8, 0

        return f"gemma3_{size}", {"family": "gemma3", "size": size}, run

    return g4, g3


def main():
    if OUT.exists():
        shutil.rmtree(OUT)
    for sub in ("src", "decoded", "out"):
        (OUT / sub).mkdir(parents=True)
    g4, g3 = processors()
    manifest = {}
    for fname, raw in sources():
        (OUT / "src" / fname).write_bytes(raw)
        stem = fname.rsplit(".", 1)[0]
        img = Image.open(io.BytesIO(raw))
        if stem == "exif_rotated":
            img = ImageOps.exif_transpose(img)
        img = convert_to_rgb(img)
        Image.fromarray(np.asarray(img)).save(OUT / "decoded" / f"{stem}.png")
        cases = [g4(70), g3(224)]
        if stem in ("astronaut", "one_pixel"):
            cases.append(g4(280))
        if stem in ("one_pixel", "thin_row"):
            cases.append(g3(896))
        entry = {"source": fname, "decoded": [img.height, img.width], "cases": {}}
        for label, settings, run in cases:
            u8, soft = run(img)
            Image.fromarray(u8).save(OUT / "out" / f"{stem}.{label}.png")
            entry["cases"][label] = dict(settings, size=[int(u8.shape[0]), int(u8.shape[1])], soft_tokens=soft)
        manifest[stem] = entry
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{len(manifest)} images, {size / 1e6:.2f} MB in {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
