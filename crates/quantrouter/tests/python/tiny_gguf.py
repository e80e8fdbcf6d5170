"""Writes a tiny llama-architecture GGUF model for llama-server with PyPI's `gguf` package.

    python tiny_gguf.py OUT.gguf

Random weights, one token per printable ASCII character (a byte-level BPE vocabulary
without merges, so a text tokenizes back to the very tokens that produced it) and a ChatML
template. Its transformer block adds nothing to the residual stream (zero output
projections), so the next token depends on the last one alone: greedy decoding walks
printable ASCII, and a text continued from any of its prefixes goes on exactly as it would
have, however the server batched or cached it.
"""

import sys

import gguf
import numpy as np

N_EMBD = 64
N_FF = 128
N_HEAD = 2
CONTEXT = 1024

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary():
    """Printable ASCII in GPT-2's byte-level spelling (a space is "Ġ", a newline "Ċ"),
    then the two control tokens."""
    text = [" " if c == 0x20 else chr(c) for c in range(0x20, 0x7F)]
    tokens = ["\u0120" if t == " " else t for t in text] + ["\u010a"]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += ["<|im_start|>", "<|im_end|>"]
    types += [gguf.TokenType.CONTROL] * 2
    return tokens, types


def main(path):
    tokens, types = vocabulary()
    n_vocab = len(tokens)
    printable = 0x7F - 0x20
    rng = np.random.default_rng(7)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-bigram")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(1)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # A merge of two bytes no printable text holds: the table must not be empty.
    writer.add_token_merges(["\u0100 \u0101"])
    writer.add_bos_token_id(n_vocab - 2)
    writer.add_eos_token_id(n_vocab - 1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    f32 = np.float32
    embeddings = rng.standard_normal((n_vocab, N_EMBD)).astype(f32)
    # Token t's logit peaks at the printable character after it (after anything else: "a").
    successor = [(t + 1) % printable if t < printable else ord("a") - 0x20 for t in range(n_vocab)]
    output = np.zeros((n_vocab, N_EMBD), dtype=f32)
    for t in range(n_vocab):
        output[successor[t]] += embeddings[t] * 4.0
    writer.add_tensor("token_embd.weight", embeddings)
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=f32))
    writer.add_tensor("output.weight", output)
    square = (N_EMBD, N_EMBD)
    for name, shape, scale in [
        ("attn_norm", (N_EMBD,), None),
        ("attn_q", square, 0.1),
        ("attn_k", square, 0.1),
        ("attn_v", square, 0.1),
        ("attn_output", square, 0.0),
        ("ffn_norm", (N_EMBD,), None),
        ("ffn_gate", (N_FF, N_EMBD), 0.1),
        ("ffn_up", (N_FF, N_EMBD), 0.1),
        ("ffn_down", (N_EMBD, N_FF), 0.0),
    ]:
        weights = np.ones(shape, dtype=f32) if scale is None else (
            rng.standard_normal(shape).astype(f32) * scale)
        writer.add_tensor(f"blk.0.{name}.weight", weights)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(f"usage: {sys.argv[0]} OUT.gguf", file=sys.stderr)
        sys.exit(2)
    main(sys.argv[1])
