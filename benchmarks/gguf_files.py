"""Random-weight Llama GGUF files for the benchmarks, laid out as llama.cpp's converter lays a model out.

Names from gguf's tensor-name map, norms in F32, every 2-d weight quantized by gguf's own quantizer,
written one tensor at a time (never whole in memory), and a header as a real chat model's: its
counts, a byte-level BPE vocabulary of the model's size with its merges (synthetic: each merge joins
a token to a byte symbol), SmolLM2's special tokens and chat template.

    write_llama_gguf(path, "Q4_1", **SMOLLM)
"""

from __future__ import annotations

from pathlib import Path

SMOLLM = dict(layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152, tie=True, context=8192,
              rope_base=100000.0, name="SmolLM2 135M Instruct")
"""SmolLM2-135M-Instruct's shapes and header fields (its Q4_1 file is about 90 MiB); litgpt knows its config."""
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")


def tensor_shapes(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int,
                  tie: bool = False, **_: object) -> dict[str, tuple[int, ...]]:
    """GGUF name -> shape in torch's order (out, in), in llama.cpp's order of writing."""
    kv = hidden // heads * kv_heads
    out = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        out |= {f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.attn_q.weight": (hidden, hidden),
                f"blk.{i}.attn_k.weight": (kv, hidden), f"blk.{i}.attn_v.weight": (kv, hidden),
                f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_norm.weight": (hidden,),
                f"blk.{i}.ffn_gate.weight": (intermediate, hidden), f"blk.{i}.ffn_up.weight": (intermediate, hidden),
                f"blk.{i}.ffn_down.weight": (hidden, intermediate)}
    out["output_norm.weight"] = (hidden,)
    return out if tie else out | {"output.weight": (vocab, hidden)}


def bpe_vocabulary(size: int) -> tuple[list[str], list[str]]:
    """``(tokens, merges)``: 3 special tokens, the 256 byte-level symbols, then tokens each made by one merge of an
    earlier token with a byte symbol, ``size`` tokens in all."""
    from tokenizers.pre_tokenizers import ByteLevel

    symbols = sorted(ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *symbols]
    known, merges = set(tokens), []
    step = 0
    while len(tokens) < size:
        step += 1
        pair = (tokens[3 + (step * 31) % (len(tokens) - 3)], symbols[step % len(symbols)])
        if pair[0] + pair[1] in known:
            continue
        known.add(pair[0] + pair[1])
        tokens.append(pair[0] + pair[1])
        merges.append(" ".join(pair))
    return tokens, merges


def write_llama_gguf(path: Path, kind: str, *, layers: int, hidden: int, intermediate: int, heads: int,
                     kv_heads: int, vocab: int, tie: bool = False, context: int = 2048, rope_base: float = 10000.0,
                     name: str = "bench-llama") -> Path:
    """A random-weight Llama (N(0, 0.02) weights, norms of ones) as a GGUF file of ``kind`` (Q8_0, Q4_0, Q4_1,
    ...), written once (kept when ``path`` exists)."""
    import gguf
    import numpy as np

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    qtype, rng = gguf.GGMLQuantizationType[kind], np.random.default_rng(0)
    tensors = tensor_shapes(layers, hidden, intermediate, heads, kv_heads, vocab, tie)
    tokens, merges = bpe_vocabulary(vocab)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    for add, value in [("add_name", name), ("add_context_length", context), ("add_embedding_length", hidden),
                       ("add_block_count", layers), ("add_feed_forward_length", intermediate),
                       ("add_rope_dimension_count", hidden // heads), ("add_head_count", heads),
                       ("add_head_count_kv", kv_heads), ("add_layer_norm_rms_eps", 1e-5),
                       ("add_rope_freq_base", rope_base), ("add_vocab_size", vocab),
                       ("add_file_type", getattr(gguf.LlamaFileType, "MOSTLY_" + kind)),
                       ("add_tokenizer_model", "gpt2"), ("add_token_list", tokens), ("add_token_merges", merges),
                       ("add_bos_token_id", 1), ("add_eos_token_id", 2), ("add_add_bos_token", False),
                       ("add_chat_template", CHAT_TEMPLATE)]:
        getattr(writer, add)(value)
    for tensor, shape in tensors.items():
        t = qtype if len(shape) == 2 else gguf.GGMLQuantizationType.F32
        block, size = gguf.GGML_QUANT_SIZES[t]
        writer.add_tensor_info(tensor, shape, np.dtype(np.float32), int(np.prod(shape)) // block * size, raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for shape in tensors.values():
        data = (rng.standard_normal(shape, dtype=np.float32) * 0.02) if len(shape) == 2 else np.ones(shape, np.float32)
        writer.write_tensor_data(gguf.quants.quantize(data, qtype) if len(shape) == 2 else data)
    writer.close()
    tmp.rename(path)
    return path
