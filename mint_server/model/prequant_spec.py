"""What config.json's `quantization_config` says about a pre-quantized checkpoint (read by config.py;
the weights are dequantized by prequant.py). Anything we cannot dequantize exactly is an
UnsupportedModelError naming its field, `quantization_config.<key>`."""

from __future__ import annotations

from dataclasses import dataclass

from mint_server.model.errors import UnsupportedModelError

METHODS = ("fp8", "mxfp4")


@dataclass(frozen=True)
class Prequantized:
    """How a checkpoint's weights are stored: `method` fp8 (with its block) or mxfp4."""

    method: str
    block: tuple[int, int] = (0, 0)  # fp8: weight_block_size (rows, columns)

    @property
    def label(self) -> str:
        return f"{self.method}-dequantized"


def _refuse(key: str, value: object, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"quantization_config.{key} {value!r}: {why}")


def parse_quantization(raw: object, family: str) -> Prequantized | None:
    """The checkpoint's storage from config.json's `quantization_config` (None: plain weights);
    UnsupportedModelError naming the field for anything we cannot dequantize exactly."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise UnsupportedModelError(f"quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method == "fp8":
        if family == "deepseek_v4":  # its checkpoints name scales and fp4 experts their own way
            raise _refuse("quant_method", method, "not read for DeepSeek-V4 yet: dequantize to bf16 first")
        fmt = raw.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _refuse("fmt", fmt, "only e4m3 fp8 weights are read")
        block = raw.get("weight_block_size")
        if block is None:
            raise _refuse("weight_block_size", block, "per-tensor fp8 is not read; a block-scaled checkpoint "
                          "names its [rows, columns] block here")
        if not (isinstance(block, list | tuple) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise _refuse("weight_block_size", block, "expected two positive integers [rows, columns]")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise _refuse("activation_scheme", scheme, "only dynamic activation scaling is read")
        scale_fmt = raw.get("scale_fmt", "float")
        if scale_fmt not in ("float", "ue8m0"):
            raise _refuse("scale_fmt", scale_fmt, "expected 'float' or 'ue8m0'")
        expert_dtype = raw.get("expert_dtype", "fp8")
        if expert_dtype != "fp8":
            raise _refuse("expert_dtype", expert_dtype, "only fp8 experts are read")
        return Prequantized("fp8", (block[0], block[1]))
    if method == "mxfp4":
        if family != "gpt_oss":
            raise _refuse("quant_method", method, f"MXFP4 is read for gpt-oss checkpoints only, not {family}")
        return Prequantized("mxfp4")
    if method is None:
        raise UnsupportedModelError(f"quantization_config.quant_method is missing; supported: {list(METHODS)}")
    raise _refuse("quant_method", method, f"not supported; supported: {list(METHODS)}")


_DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def base_precision(dtype: object, quantize: str = "none", prequantized: Prequantized | None = None) -> str:
    """The precision a base is served or trained in, as the catalog records it: the engine's dtype
    ("fp32", "bf16"), or its runtime weight quantization ("int8", "int4"), after how the checkpoint
    was stored when it was pre-quantized ("fp8-dequantized-bf16", "mxfp4-dequantized-int8")."""
    name = str(dtype).removeprefix("torch.")
    core = quantize if quantize not in ("", "none") else _DTYPE_LABELS.get(name, name)
    return f"{prequantized.label}-{core}" if prequantized is not None else core
