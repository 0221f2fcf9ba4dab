"""What a checkpoint's `quantization_config` (in config.json) says its weights are, checked.

Known: no config (bfloat16/float16/float32 weights); `awq` as AutoAWQ writes it (4-bit, zero
points, GEMM layout: `<linear>.qweight` int32 [in, out / 8], `.qzeros` int32 [in / group, out / 8],
`.scales` float16 [in / group, out]); `gptq` as gptqmodel writes it (4-bit, `desc_act` off,
checkpoint_format 'gptq' with zero points stored minus one, or 'gptq_v2': `.qweight` int32
[in / 8, out] packed along the input, `.qzeros` int32 [in / group, out / 8], `.scales` float16
[in / group, out], `.g_idx`); `compressed-tensors` FP8 as llm-compressor writes it (format
`float-quantized`: `<linear>.weight` float8_e4m3fn with `<linear>.weight_scale` per channel
[out, 1] or per tensor; activations dynamic per token or a static `input_scale`). transformers'
block-scaled `fp8` (`<linear>.weight` float8_e4m3fn with `.weight_scale_inv` per
`weight_block_size` tile) loads dequantized: the GEMMs here take one scale per output channel, not
per tile. Anything else is refused with the field that is not supported. Knows nothing of tensors
but their scales (loading: engine/models/loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

Format = Literal["none", "compressed-tensors", "fp8-block", "awq", "gptq"]


@dataclass(frozen=True)
class CheckpointQuant:
    """format: how the linears' weights are stored; group_size: input columns a 4-bit scale covers;
    zero_offset: what to add to a stored zero point (GPTQ's 'gptq' format stores it minus one).
    fp8-block weights are dequantized as they load (their GEMM would need a scale per tile): the
    model runs them in its dtype, or, with quantization='fp8', requantized per channel."""

    format: Format = "none"
    group_size: int = 0
    zero_offset: int = 0
    block: tuple[int, int] = (0, 0)  # fp8-block: (rows, columns) one weight_scale_inv covers

    @property
    def is_fp8(self) -> bool:
        return self.format == "compressed-tensors"

    @property
    def is_int4(self) -> bool:
        return self.format in ("awq", "gptq")


def _check(value: Any, allowed: tuple[Any, ...], field: str, source: str) -> None:
    if value not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{source}: quantization_config.{field} is {value!r}; pdserve loads {shown}")


def _compressed_tensors(config: dict[str, Any], source: str) -> CheckpointQuant:
    _check(config.get("format"), ("float-quantized",), "format", source)
    groups = config.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{source}: quantization_config.config_groups is empty; nothing says how weights are stored")
    for name, group in groups.items():
        where = f"config_groups.{name}"
        weights = group.get("weights") or {}
        _check(weights.get("num_bits"), (8,), f"{where}.weights.num_bits", source)
        _check(weights.get("type"), ("float",), f"{where}.weights.type", source)
        _check(weights.get("strategy"), ("channel", "tensor"), f"{where}.weights.strategy", source)
        _check(weights.get("symmetric", True), (True,), f"{where}.weights.symmetric", source)
        activations = group.get("input_activations")
        if activations is not None:
            _check(activations.get("num_bits"), (8,), f"{where}.input_activations.num_bits", source)
            _check(activations.get("type"), ("float",), f"{where}.input_activations.type", source)
        if group.get("output_activations") is not None:
            raise ValueError(f"{source}: quantization_config.{where}.output_activations is set; pdserve does not "
                             "quantize outputs")
    return CheckpointQuant("compressed-tensors")


def _awq(config: dict[str, Any], source: str) -> CheckpointQuant:
    bits = config.get("bits", config.get("w_bit"))
    _check(bits, (4,), "bits", source)
    _check(config.get("zero_point", True), (True,), "zero_point", source)
    _check(str(config.get("version", "gemm")).lower(), ("gemm",), "version", source)
    group = _group_size(config, source, "group_size", "q_group_size")
    if config.get("modules_to_not_convert"):
        raise ValueError(f"{source}: quantization_config.modules_to_not_convert is "
                         f"{config['modules_to_not_convert']!r}; pdserve loads AWQ checkpoints whose every "
                         "decoder projection is 4-bit")
    return CheckpointQuant("awq", group)


def _group_size(config: dict[str, Any], source: str, *keys: str) -> int:
    group = next((config[k] for k in keys if k in config), None)
    if not isinstance(group, int) or group < 8 or group % 8:
        raise ValueError(f"{source}: quantization_config.{keys[0]} is {group!r}; pdserve loads a positive multiple "
                         "of 8 (e.g. 128)")
    return group


def _gptq(config: dict[str, Any], source: str) -> CheckpointQuant:
    _check(config.get("bits"), (4,), "bits", source)
    _check(config.get("desc_act", False), (False,), "desc_act", source)
    checkpoint_format = config.get("checkpoint_format", "gptq")
    _check(checkpoint_format, ("gptq", "gptq_v2"), "checkpoint_format", source)
    return CheckpointQuant("gptq", _group_size(config, source, "group_size"),
                           zero_offset=1 if checkpoint_format == "gptq" else 0)


def checkpoint_quant(raw_config: dict[str, Any], source: str) -> CheckpointQuant:
    """The storage format config.json (parsed, `raw_config`; named `source` in errors) declares."""
    config = raw_config.get("quantization_config")
    if config is None:
        return CheckpointQuant()
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config, source)
    if method == "awq":
        return _awq(config, source)
    if method == "gptq":
        return _gptq(config, source)
    if method == "fp8":
        block = config.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{source}: quantization_config.weight_block_size is {block!r}; pdserve loads "
                             "transformers' block-scaled fp8 with [rows, columns] of positive integers "
                             "(e.g. [128, 128])")
        return CheckpointQuant("fp8-block", block=(block[0], block[1]))
    raise ValueError(f"{source}: quantization_config.quant_method is {method!r}; pdserve loads 'compressed-tensors' "
                     "(FP8), 'fp8' (block-scaled), 'awq' (4-bit, GEMM layout) and 'gptq' (4-bit, no act-order) "
                     "checkpoints")


SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale", ".qzeros", ".scales", ".g_idx")
"""Checkpoint tensors that belong to a quantized linear's weight (read with it, never alone).
NOTE: a static `input_scale` is read past: activations are scaled per token, dynamically."""


def channel_scales(scale: torch.Tensor, rows: int, where: str) -> torch.Tensor:
    """A compressed-tensors weight_scale (per channel [rows, 1] or [rows]; per tensor [1] or [])
    -> [rows] float32."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows).contiguous()
    if tuple(scale.shape) in ((rows, 1), (rows,)):
        return scale.float().reshape(rows)
    raise ValueError(f"{where} has shape {tuple(scale.shape)}; a per-channel scale of {rows} output rows is "
                     f"({rows}, 1) and a per-tensor scale has one element")


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], where: str) -> torch.Tensor:
    """A block-scaled FP8 weight q [out, in] with scale_inv [ceil(out / rows), ceil(in / columns)] ->
    float32 (each value times its tile's scale, exactly)."""
    (rows, cols), (out, inp) = block, q.shape
    expected = (-(-out // rows), -(-inp // cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{where} has shape {tuple(scale_inv.shape)}; weight_block_size {list(block)} over a "
                         f"({out}, {inp}) weight implies {expected}")
    scale = scale_inv.float().repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]
    return q.float() * scale

