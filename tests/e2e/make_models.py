"""Writes tiny random-weight GGUF models for the end-to-end tests.

The models are gibberish generators, but they are real llama-architecture
models with a SentencePiece-style vocabulary (byte fallback), a ChatML chat
template and control tokens, so every llama-server code path runs for real:
the template, tokenization, the KV cache and its slots, streaming, and
embeddings (with `--embeddings --pooling mean`), and fill-in-the-middle
(`tiny-code`, whose vocabulary names its FIM tokens). Weights come from a seeded
generator: the same seed writes the same file, byte for byte, and greedy
decoding gives the same reply every time. A random model never chooses the
end-of-sequence token by itself; replies run to `max_tokens`.

    python make_models.py OUT_DIR        # writes tiny-chat.gguf, tiny-embed.gguf, tiny-code.gguf
"""

import sys
from pathlib import Path

import gguf
import numpy as np

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each about "
    "how up out them then she many some so these would other into has more her two like him see time "
    "could no make than first been its who now people my made over did down only way find use may water "
    "long little very after words called just where most know hello world story tell me please thanks"
).split()

SPACE = "\u2581"  # SentencePiece's word-boundary marker
# Fill-in-the-middle markers: prefix, suffix, middle.
FIM_MARKERS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def vocabulary(fim=False):
    """Tokens, scores and types: control tokens, 256 byte-fallback tokens,
    the ChatML markers, then characters and words (longer pieces score
    higher, so the tokenizer prefers them)."""
    tokens, scores, types = [], [], []

    def add(piece, score, kind):
        tokens.append(piece)
        scores.append(score)
        types.append(kind)

    add("<unk>", 0.0, gguf.TokenType.UNKNOWN)
    add("<s>", 0.0, gguf.TokenType.CONTROL)
    add("</s>", 0.0, gguf.TokenType.CONTROL)
    for byte in range(256):
        add(f"<0x{byte:02X}>", 0.0, gguf.TokenType.BYTE)
    add("<|im_start|>", 0.0, gguf.TokenType.CONTROL)
    add("<|im_end|>", 0.0, gguf.TokenType.CONTROL)
    # llama.cpp takes tokens spelled like these for FIM tokens even where
    # the model does not name them: only a code model has them.
    if fim:
        for marker in FIM_MARKERS:
            add(marker, 0.0, gguf.TokenType.CONTROL)
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    chars += [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    chars += list("0123456789.,!?'\"-:;()/") + [SPACE]
    seen = set(tokens)
    for ch in chars:
        if ch not in seen:
            add(ch, -10.0, gguf.TokenType.NORMAL)
            seen.add(ch)
    for ch in chars[:52]:
        piece = SPACE + ch
        if piece not in seen:
            add(piece, -5.0, gguf.TokenType.NORMAL)
            seen.add(piece)
    for word in WORDS:
        for piece in (SPACE + word, word):
            if piece not in seen:
                add(piece, -1.0 + 0.01 * len(piece), gguf.TokenType.NORMAL)
                seen.add(piece)
    return tokens, scores, types


def write_llama(path, name, seed, n_embd=64, n_layer=2, n_head=4, n_ff=128, n_ctx=2048, fim=False):
    tokens, scores, types = vocabulary(fim)
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weights(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_eot_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHATML)
    if fim:
        keys = (gguf.Keys.Tokenizer.FIM_PRE_ID, gguf.Keys.Tokenizer.FIM_SUF_ID, gguf.Keys.Tokenizer.FIM_MID_ID)
        for key, marker in zip(keys, FIM_MARKERS):
            writer.add_uint32(key, tokens.index(marker))

    # numpy shapes are ggml's dimensions reversed: (rows, columns).
    writer.add_tensor("token_embd.weight", weights(n_vocab, n_embd))
    for layer in range(n_layer):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for part in ("q", "k", "v", "output"):
            writer.add_tensor(f"{block}.attn_{part}.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weights(n_vocab, n_embd))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(out_dir):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_llama(out / "tiny-chat.gguf", "tiny-chat", seed=1)
    # The embedding model is a second llama-architecture model, served with
    # `--embeddings --pooling mean`: llama-server's embedding path runs for
    # real, mean pooling included.
    write_llama(out / "tiny-embed.gguf", "tiny-embed", seed=2)
    # A code model: it can fill in the middle.
    write_llama(out / "tiny-code.gguf", "tiny-code", seed=3, fim=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(main(sys.argv[1]))
