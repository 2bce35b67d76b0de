"""Tiny GGUF files written with the ``gguf`` package, for tests of GGUF inspection and conversion.

A two-layer Llama with a 91-token SentencePiece-style vocabulary (which transformers' GGUF
tokenizer converter accepts), its matrices Q8_0-quantized so that loading really dequantizes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
TOKENS = ["<unk>", "<s>", "</s>"] + [f"▁w{i}" for i in range(61)] + [chr(c) for c in range(97, 123)] + ["▁"]


def write_tiny_gguf(
    path: Path, *, seed: int = 0, architecture: str = "llama", with_tokenizer: bool = True
) -> Path:
    """Write a tiny Llama GGUF (``architecture`` names it in the header: another name makes a
    file of an unsupported architecture) and return its path."""
    import gguf

    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    if with_tokenizer:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(TOKENS)
        writer.add_token_scores([0.0] * 3 + [-float(index) for index in range(len(TOKENS) - 3)])
        writer.add_token_types([2, 3, 3] + [1] * (len(TOKENS) - 3))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)

    def tensor(name: str, shape: tuple[int, ...], *, quantized: bool = True) -> None:
        data = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if quantized:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, data)

    vocab, head_dim = len(TOKENS), HIDDEN // HEADS
    tensor("token_embd.weight", (vocab, HIDDEN))
    tensor("output_norm.weight", (HIDDEN,), quantized=False)
    tensor("output.weight", (vocab, HIDDEN))
    for layer in range(LAYERS):
        tensor(f"blk.{layer}.attn_norm.weight", (HIDDEN,), quantized=False)
        tensor(f"blk.{layer}.ffn_norm.weight", (HIDDEN,), quantized=False)
        tensor(f"blk.{layer}.attn_q.weight", (HIDDEN, HIDDEN))
        tensor(f"blk.{layer}.attn_k.weight", (KV_HEADS * head_dim, HIDDEN))
        tensor(f"blk.{layer}.attn_v.weight", (KV_HEADS * head_dim, HIDDEN))
        tensor(f"blk.{layer}.attn_output.weight", (HIDDEN, HIDDEN))
        tensor(f"blk.{layer}.ffn_gate.weight", (FFN, HIDDEN))
        tensor(f"blk.{layer}.ffn_up.weight", (FFN, HIDDEN))
        tensor(f"blk.{layer}.ffn_down.weight", (HIDDEN, FFN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
