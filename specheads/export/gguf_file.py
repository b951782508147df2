"""One llama.cpp draft GGUF, whatever its architecture: the file's keys and tensors before they are
written (Draft), the tensor types llama.cpp's converter gives them, the writer, and the reader's
view of a tensor. gguf.py (EAGLE-3, arch `eagle3`) and gguf_dflash.py (the DFlash family, arch
`dflash`) build on it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

from ..errors import SpecHeadsError
from .common import rope_fields
from .gguf_vocab import Field

LLAMACPP = "llama.cpp b11434"
ENGINES = ["llama.cpp"]
PROVENANCE = "specheads.provenance"  # our source head config; llama.cpp ignores the key
ROPE_FREQS = "rope_freqs.weight"
FILE_TYPES = {
    torch.float32: (LlamaFileType.ALL_F32, GGMLQuantizationType.F32),
    torch.float16: (LlamaFileType.MOSTLY_F16, GGMLQuantizationType.F16),
    torch.bfloat16: (LlamaFileType.MOSTLY_BF16, GGMLQuantizationType.BF16),
}


@dataclass
class Draft:
    """One GGUF before it is written: its architecture, keys and tensors (name -> values, GGML type)."""

    arch: str
    fields: list[Field]
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]]
    engines: list[str]
    notes: list[str] = field(default_factory=list)


def file_type(dtype: torch.dtype) -> int:
    if dtype not in FILE_TYPES:
        raise SpecHeadsError(f"format gguf writes float32, float16 or bfloat16 weights, not {dtype}")
    return int(FILE_TYPES[dtype][0])


def file_dtype(kv: dict[str, Any]) -> torch.dtype:
    """The torch dtype of a file's matrices, from general.file_type."""
    return next(d for d, (ft, _) in FILE_TYPES.items() if int(ft) == kv["general.file_type"])


def layer_fields(arch: str, title: str, info, dtype: torch.dtype, layers: int, intermediate_size: int) -> list[Field]:
    """The keys every draft architecture reads the same way: the file's name and type, the draft
    layers' Llama/Qwen3 shape under `arch.*` (the target's width, heads and RoPE), linear RoPE
    scaling where the target has it."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    rope = rope_fields(info.rope_parameters)
    a = arch
    fields: list[Field] = [
        ("general.name", f"{info.name} {title} draft", GGUFValueType.STRING, None),
        ("general.file_type", file_type(dtype), u32, None),
        (f"{a}.context_length", info.max_position_embeddings, u32, None),
        (f"{a}.embedding_length", info.hidden_size, u32, None),
        (f"{a}.block_count", layers, u32, None),
        (f"{a}.feed_forward_length", intermediate_size, u32, None),
        (f"{a}.attention.head_count", info.num_attention_heads, u32, None),
        (f"{a}.attention.head_count_kv", info.num_key_value_heads, u32, None),
        (f"{a}.attention.key_length", info.head_dim, u32, None),
        (f"{a}.attention.value_length", info.head_dim, u32, None),
        (f"{a}.attention.layer_norm_rms_epsilon", float(info.rms_norm_eps), f32, None),
        (f"{a}.rope.dimension_count", info.head_dim, u32, None),
        (f"{a}.rope.freq_base", rope["rope_theta"], f32, None),
    ]
    scaling = rope["rope_scaling"] or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        fields.append((f"{a}.rope.scaling.type", "linear", GGUFValueType.STRING, None))
        fields.append((f"{a}.rope.scaling.factor", float(scaling["factor"]), f32, None))
    return fields


def rope_freqs(info) -> torch.Tensor | None:
    """llama3 RoPE as llama.cpp takes it: one divisor per frequency, the default frequencies over
    transformers' scaled ones (what the head was trained with)."""
    rope = dict(info.rope_parameters or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", "linear"):
        return None
    if kind != "llama3":
        raise SpecHeadsError(
            f"the target's RoPE is {kind!r}; the gguf export writes default, linear and llama3 RoPE "
            "(convert format=eagle3 with llama.cpp's convert_hf_to_gguf.py instead)"
        )
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=info.hidden_size,
        num_attention_heads=info.num_attention_heads,
        head_dim=info.head_dim,
        max_position_embeddings=info.max_position_embeddings,
        rope_parameters=rope,
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = float(rope.get("rope_theta", 10000.0))
    plain = 1.0 / base ** (torch.arange(0, info.head_dim, 2, dtype=torch.float64) / info.head_dim)
    return (plain / scaled.double()).float()


def as_ggml(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A float tensor in the file's type: matrices in `dtype`, 1-D ones (norms) in F32."""
    tensor = tensor.detach().to("cpu")
    if tensor.dim() == 1 or dtype == torch.float32:
        return tensor.float().contiguous().numpy(), GGMLQuantizationType.F32
    if dtype == torch.float16:
        return tensor.half().contiguous().numpy(), GGMLQuantizationType.F16
    return tensor.bfloat16().contiguous().view(torch.int16).numpy(), GGMLQuantizationType.BF16


def write(draft: Draft, path: Path) -> None:
    log = logging.getLogger("gguf.gguf_writer")
    level = log.level
    log.setLevel(logging.WARNING)  # its info lines would name the temporary file
    try:
        writer = GGUFWriter(str(path), draft.arch)
        for key, value, kind, sub in draft.fields:
            writer.add_key_value(key, value, kind, sub)
        for name, (values, kind) in draft.tensors.items():
            writer.add_tensor(name, values, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    finally:
        log.setLevel(level)


# -- read back ----------------------------------------------------------------------------------------


def values(reader: GGUFReader) -> dict[str, Any]:
    return {name: f.contents() for name, f in reader.fields.items()}


def tensor_of(t) -> torch.Tensor:
    """A GGUF tensor as torch, in its own type and in torch's row-major shape (GGUF lists ne reversed)."""
    shape = [int(n) for n in reversed(t.shape.tolist())]
    data = np.array(t.data, copy=True)
    if t.tensor_type == GGMLQuantizationType.BF16:
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16).reshape(shape)
    return torch.from_numpy(data).reshape(shape)
