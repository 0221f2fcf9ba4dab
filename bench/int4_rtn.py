"""Writes a 4-bit checkpoint of a bfloat16/float32 one by round-to-nearest, in AutoAWQ's format
(GEMM) or GPTQ's (as gptqmodel saves it: checkpoint_format 'gptq', zero points stored minus one):
each decoder projection gets a float16 scale and an integer zero point per `group` input columns
(min/max of the group, widened to include 0), values rounded to [0, 15]. No activation-aware
scaling or error compensation (what AWQ and GPTQ add): a lower bound of what real ones score.

    python -m bench.int4_rtn SRC_DIR OUT_DIR [--group 128] [--format awq|gptq]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i of an int32 holds column AWQ_PACK_ORDER[i]


def gptq_pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] of 4-bit values -> GPTQ's int32 [rows / 8, cols]: row 8i + j in bits 4j of row i."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).view(rows // 8, 8, cols)
    packed = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for j in range(8):
        packed |= grouped[:, j, :] << (4 * j)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def gptq_pack_columns(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] of 4-bit values -> GPTQ's int32 [rows, cols / 8]: column 8c + j in bits 4j."""
    return gptq_pack_rows(values.t().contiguous()).t().contiguous()


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] of 4-bit values -> AutoAWQ's int32 [rows, cols / 8]."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).view(rows, cols // 8, 8)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_PACK_ORDER):
        packed |= grouped[:, :, column] << (4 * i)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def is_projection(name: str) -> bool:
    return any(f".{p}." in name for p in PROJECTIONS) and name.endswith(".weight")


def write_int4_rtn(src: Path, out: Path, group: int = 128, fmt: str = "awq") -> dict[str, torch.Tensor]:
    """The checkpoint in `out` (config.json gets AutoAWQ's or gptqmodel's quantization_config; other
    files copied). Returns the projections' dequantized weights, by name."""
    files = sorted(src.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{src} holds {len(files)} safetensors files; this writer takes one")
    written, dequantized = {}, {}
    for name, w in load_file(str(files[0])).items():
        if not is_projection(name):
            written[name] = w
            continue
        rows, cols = w.shape
        g = w.float().view(rows, cols // group, group)
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=1e-8).to(torch.float16)  # [rows, groups]
        # NOTE: GPTQ's 'gptq' format stores zero - 1, so a zero point of 0 cannot be written: 1 at least
        zero = (-low / scale.float()).round().clamp(1 if fmt == "gptq" else 0, 15)
        q = (g / scale.float()[:, :, None] + zero[:, :, None]).round().clamp(0, 15)  # [rows, groups, group]
        prefix = name.removesuffix(".weight")
        if fmt == "awq":
            written[prefix + ".qweight"] = awq_pack(q.view(rows, cols).t().contiguous())
            written[prefix + ".qzeros"] = awq_pack(zero.t().contiguous())
        else:
            written[prefix + ".qweight"] = gptq_pack_rows(q.view(rows, cols).t().contiguous())
            written[prefix + ".qzeros"] = gptq_pack_columns((zero - 1).clamp(min=0).t().contiguous())
            written[prefix + ".g_idx"] = torch.arange(cols, dtype=torch.int32) // group
        written[prefix + ".scales"] = scale.t().contiguous()
        dequantized[name] = ((q - zero[:, :, None]) * scale.float()[:, :, None]).view(rows, cols)
    out.mkdir(parents=True, exist_ok=True)
    save_file(written, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    if fmt == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                         "version": "gemm", "modules_to_not_convert": None}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                         "sym": False, "checkpoint_format": "gptq", "true_sequential": True}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dequantized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--format", choices=["awq", "gptq"], default="awq")
    args = parser.parse_args()
    write_int4_rtn(args.src, args.out, args.group, args.format)


if __name__ == "__main__":
    main()
