"""Images as a vision-language model reads them: encoded bytes → patches, and where they sit in a
token sequence. Pure PIL and numpy (no torch), so the engine's job parser can run it on any thread.

Qwen3-VL's processor (transformers' Qwen2VLImageProcessor, PIL backend), reproduced: the image is
converted to RGB (transparency over white), resized with bicubic filtering to the nearest size whose
sides are multiples of patch × merge and whose area lies in [min_pixels, max_pixels] (`smart_resize`),
scaled to [0, 1], normalised by mean / std, and cut into patch × patch squares, each repeated over
`temporal_patch_size` frames (a still image is a one-step video), ordered merge-block by merge-block
(the merger folds each merge × merge block into one token). An image of h × w patches is written in
the prompt as h·w / merge² copies of the image token.

Multimodal RoPE (Qwen3-VL): a text token at sequence position p turns all three rotary axes (t, h, w)
by p + shift, where shift is what the images before it saved; an image's tokens get (start, start + row,
start + col) over its merged grid (start: its first position plus the shift before it), and the text
after it continues from start + max(rows, cols). `PromptImages.rope_positions` maps any positions
of a sequence to their three rotary positions, prompt or generated, so a decode step needs no table.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mint_server.model.vision_spec import VisionSpec

# Qwen3-VL's preprocessor_config.json defaults (used when a checkpoint ships none).
DEFAULT_MIN_PIXELS = 65536
DEFAULT_MAX_PIXELS = 16777216
DEFAULT_MEAN = (0.5, 0.5, 0.5)
DEFAULT_STD = (0.5, 0.5, 0.5)
# Images whose header claims more pixels than this are refused before decoding (decompression bombs);
# whatever is decoded is resized down to max_pixels anyway.
MAX_DECODED_PIXELS = 64 * 2**20
FORMATS = {"png": "PNG", "jpeg": "JPEG"}  # the Tinker ImageChunk formats → PIL's names


class ImageError(ValueError):
    """Bytes that are not a usable image; the message says why (the caller names the field)."""


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a sequence, ready for the vision tower."""

    start: int  # sequence position of its first image token
    grid: tuple[int, int, int]  # (frames, rows, cols) of patches
    merge: int  # spatial merge size: merge × merge patches make one token
    patches: np.ndarray  # [frames·rows·cols, channels·temporal·patch²] float32, merge-block order
    digest: str  # sha256 of the encoded bytes: its identity (prefix sharing, the feature cache)
    width: int = 0  # as sent, for messages
    height: int = 0

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid
        return t, h // self.merge, w // self.merge

    @property
    def tokens(self) -> int:
        t, h, w = self.llm_grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.start + self.tokens


class PromptImages:
    """The images of one sequence, in order. Equal (and hashing equal) exactly when the same
    images, byte for byte, sit at the same positions: the identity prefix sharing keys on."""

    def __init__(self, images: tuple[ImageInput, ...]) -> None:
        if any(b.start < a.end for a, b in zip(images, images[1:], strict=False)):
            raise ValueError("images overlap or are out of order")
        self.images = images
        self.key = tuple((im.start, im.digest) for im in images)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PromptImages) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"PromptImages({[(im.start, im.tokens, im.digest[:12]) for im in self.images]})"

    def rope_positions(self, positions: np.ndarray) -> np.ndarray:
        """Sequence positions [n] → multimodal rotary positions [3, n] (t, h, w), int64."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.repeat(positions[None], 3, axis=0)
        shift = 0  # what the images so far saved: text after them turns by position + shift
        for im in self.images:
            t, h, w = im.llm_grid
            inside = (positions >= im.start) & (positions < im.end)
            if inside.any():
                k = positions[inside] - im.start
                base = im.start + shift
                out[0, inside] = base + k // (h * w)
                out[1, inside] = base + (k // w) % h
                out[2, inside] = base + k % w
            shift += max(h, w) - im.tokens  # the text after it continues from base + max(h, w)
            after = positions >= im.end
            out[:, after] = positions[after] + shift
        return out

    def within(self, first: int, last: int) -> list[tuple[ImageInput, int, int]]:
        """(image, its first token in [first, last), the end) for the images that overlap those positions."""
        out = []
        for im in self.images:
            lo, hi = max(first, im.start), min(last, im.end)
            if lo < hi:
                out.append((im, lo, hi))
        return out


@dataclass(frozen=True)
class ImageProcessing:
    """How this model turns an image into patches (its preprocessor_config.json, or Qwen3-VL's defaults)."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    image_token_id: int

    @classmethod
    def for_model(cls, spec: VisionSpec, model_dir: str | Path | None = None) -> ImageProcessing:
        cfg: dict[str, Any] = {}
        path = Path(model_dir) / "preprocessor_config.json" if model_dir is not None else None
        if path is not None and path.is_file():
            cfg = json.loads(path.read_text())
        size = cfg.get("size") or {}
        return cls(
            patch_size=int(cfg.get("patch_size", spec.patch_size)),
            merge_size=int(cfg.get("merge_size", spec.spatial_merge_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", spec.temporal_patch_size)),
            min_pixels=int(size.get("shortest_edge") or cfg.get("min_pixels") or DEFAULT_MIN_PIXELS),
            max_pixels=int(size.get("longest_edge") or cfg.get("max_pixels") or DEFAULT_MAX_PIXELS),
            mean=tuple(float(x) for x in cfg.get("image_mean", DEFAULT_MEAN)),  # type: ignore[arg-type]
            std=tuple(float(x) for x in cfg.get("image_std", DEFAULT_STD)),  # type: ignore[arg-type]
            image_token_id=spec.image_token_id,
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """transformers' smart_resize: sides multiples of `factor`, area within [min, max] pixels,
        aspect ratio kept as nearly as that allows."""
        if max(height, width) / min(height, width) > 200:
            raise ImageError(f"aspect ratio {max(height, width) / min(height, width):.0f}:1 is more than 200:1")
        f = self.factor
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def read(self, data: bytes, fmt: str, start: int) -> ImageInput:
        """Decode and preprocess one image whose first token sits at sequence position `start`."""
        from PIL import Image

        if fmt not in FORMATS:
            raise ImageError(f"format {fmt!r} is not supported (png, jpeg)")
        if not data:
            raise ImageError("no image bytes")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(data), formats=[FORMATS[fmt]])
                width, height = img.size
                if width * height > MAX_DECODED_PIXELS:
                    raise ImageError(f"{width}×{height} pixels is more than this server decodes "
                                     f"({MAX_DECODED_PIXELS} pixels)")
                img.load()
        except ImageError:
            raise
        except Exception as e:  # PIL raises many kinds for bad bytes (UnidentifiedImageError, OSError, …)
            raise ImageError(f"the bytes are not a readable {fmt} image ({type(e).__name__}: {e})") from None
        rgb = _to_rgb(img)
        h, w = self.target_size(height, width)
        if (w, h) != rgb.size:
            rgb = rgb.resize((w, h), resample=Image.Resampling.BICUBIC)
        # As transformers: rescale in float64, then normalise in float32.
        pixels = (np.asarray(rgb, dtype=np.float64) * (1 / 255)).astype(np.float32)
        pixels = (pixels - np.asarray(self.mean, dtype=np.float32)) / np.asarray(self.std, dtype=np.float32)
        patches, rows, cols = self.patchify(pixels.transpose(2, 0, 1))
        digest = hashlib.sha256(fmt.encode() + b"\0" + data).hexdigest()
        return ImageInput(start=start, grid=(1, rows, cols), merge=self.merge_size, patches=patches, digest=digest,
                          width=width, height=height)

    def patchify(self, image: np.ndarray) -> tuple[np.ndarray, int, int]:
        """[channels, H, W] → ([rows·cols, channels·temporal·patch²], rows, cols), merge-block order."""
        c, height, width = image.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        rows, cols = height // p, width // p
        x = image.reshape(c, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
        return np.ascontiguousarray(x.reshape(rows * cols, c * tp * p * p), dtype=np.float32), rows, cols


def _to_rgb(img: Any) -> Any:
    """RGB, with any transparency composited over white (as transformers' convert_rgb does)."""
    from PIL import Image

    if img.mode == "RGB":
        return img
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")
