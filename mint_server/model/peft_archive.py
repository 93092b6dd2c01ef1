"""The adapter files behind a checkpoint archive (what `tinker checkpoint download` and the
cookbook's `weights.download` fetch), named so the cookbook's weight tools accept them.

Our PEFT dirs name the output-layer LoRA `lm_head`, as PEFT itself does: PEFT and vLLM load it
that way, tied embeddings included (the LoRA then applies to the output projection only, exactly
as we train it). The cookbook's `build_hf_model`, though, merges each LoRA into the base weight of
that name, and a base that ties embeddings stores no `lm_head` weight, so it refuses the adapter.
It does accept Tinker's own name, `model.unembed_tokens`, which it merges into `lm_head` or, for a
tied base, into the shared embedding (what PEFT's `merge_and_unload` does to a tied `lm_head`
too). So archives of a tied base use that name; everything else is byte-for-byte the PEFT dir.
`load_peft` reads both names, so such archives import back unchanged.

Renaming touches only the safetensors header (JSON), never tensor data, so no torch here.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

from mint_server.model.config import ModelError

LM_HEAD_PREFIX, TINKER_UNEMBED_PREFIX = "base_model.model.lm_head.", "base_model.model.model.unembed_tokens."
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def write_archive_dir(peft_dir: Path, dest: Path, tied_embeddings: bool) -> None:
    """Copy the adapter in `peft_dir` into the (existing, empty) dir `dest`, renamed for archives."""
    for f in sorted(peft_dir.iterdir()):
        if f.is_file() and not (tied_embeddings and f.name in (WEIGHTS, CONFIG)):
            shutil.copy2(f, dest / f.name)
    if not tied_embeddings:
        return
    cfg = json.loads((peft_dir / CONFIG).read_text())
    targets = cfg.get("target_modules") or []
    if isinstance(targets, list) and "lm_head" in targets:
        cfg["target_modules"] = sorted({*targets} - {"lm_head"} | {"unembed_tokens"})
    (dest / CONFIG).write_text(json.dumps(cfg, indent=2))
    rename_tensors(peft_dir / WEIGHTS, dest / WEIGHTS, LM_HEAD_PREFIX, TINKER_UNEMBED_PREFIX)


def rename_tensors(src: Path, dest: Path, old_prefix: str, new_prefix: str) -> None:
    """Write `src` to `dest` with tensor names starting `old_prefix` renamed; data bytes copied as is."""
    with open(src, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ModelError(f"{src.name} is not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ModelError(f"{src.name} has a corrupt safetensors header") from None
        renamed = {
            (new_prefix + k[len(old_prefix):] if k.startswith(old_prefix) else k): v for k, v in header.items()
        }
        # Offsets count from the end of the header, so only the header changes. Pad it with spaces
        # to a multiple of 8, as safetensors writers do, so the data stays aligned.
        raw = json.dumps(renamed, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(dest, "wb") as out:
            out.write(struct.pack("<Q", len(raw)) + raw)
            shutil.copyfileobj(f, out, 1 << 20)
