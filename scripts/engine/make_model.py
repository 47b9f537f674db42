#!/usr/bin/env python3
"""Writes a tiny random-weight llama model as GGUF, for tests and the demo.

No download: the architecture, a SentencePiece-style vocabulary and a ChatML
template are generated here, byte-identical for a given seed. The weights are
random, so the text is gibberish, but the engine does all the real work a
served model does: tokenising, prefill, KV cache, prefix reuse, decoding.

Random weights would sample raw byte tokens (invalid UTF-8, which the server's
chat parser answers with 500) and control tokens. One hidden dimension, `GUARD`,
is kept constant by construction (every token embeds it as 1.0 and no layer
writes to it), so after the final norm it is always positive; the output rows of
tokens that must never be sampled weigh it by a large negative number, and the
end-of-turn token gets a fixed, moderate logit from it.
"""
import argparse

import numpy as np
from gguf import GGUFWriter, TokenType

GUARD = 0  # the hidden dimension no layer writes to


def vocabulary():
    """(pieces, scores, types): control tokens, 256 byte tokens, ASCII, words."""
    pieces = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL,
             TokenType.CONTROL, TokenType.CONTROL]
    scores = [0.0] * len(pieces)
    for b in range(256):
        pieces.append(f"<0x{b:02X}>")
        types.append(TokenType.BYTE)
        scores.append(0.0)
    # Single characters cover any ASCII text without byte fallback.
    chars = [chr(c) for c in range(33, 127)] + ["\u2581", "\n"]
    for ch in chars:
        pieces.append(ch)
        types.append(TokenType.NORMAL)
        scores.append(-1000.0)
    words = """the of and to in is you that it he was for on are as with his they at be
    this have from or one had by word but not what all were we when your can said there
    use an each which she do how their if will up other about out many then them these so
    some her would make like him into time has look two more write go see number no way
    could people my than first water been call who oil its now find long down day did get
    come made may part session agent tool call result system user assistant cache prefix
    token model turn plan file code read edit test run build error fix review summary""".split()
    seen = set(pieces)
    for i, w in enumerate(words):
        for piece in ("\u2581" + w, w):
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
                types.append(TokenType.NORMAL)
                # SentencePiece merges prefer higher scores: longer pieces first.
                scores.append(-float(i) / 1000.0 + len(piece))
    return pieces, scores, types


CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    rng = np.random.default_rng(a.seed)
    pieces, scores, types = vocabulary()
    n_vocab, d, head_dim = len(pieces), a.width, a.width // a.heads

    w = GGUFWriter(a.out, "llama")
    w.add_name("agent-gateway-tiny")
    w.add_context_length(a.context)
    w.add_embedding_length(d)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ffn)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(1)  # mostly f16
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)  # <|im_end|> ends a chat turn
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    def rand(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float16)

    embd = rand(n_vocab, d, scale=0.5)
    embd[:, GUARD] = 1.0
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    out = rand(n_vocab, d, scale=0.2)
    out[:, GUARD] = 0.0
    never = [i for i, t in enumerate(types) if t in (TokenType.BYTE, TokenType.UNKNOWN, TokenType.CONTROL)]
    out[never, :] = 0.0
    out[never, GUARD] = -60.0
    out[4, :] = 0.0
    out[4, GUARD] = 0.02  # end of turn: a fixed logit a little above the mean
    w.add_tensor("output.weight", out)
    for i in range(a.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", rand(d, d, scale=d ** -0.5))
        w.add_tensor(p + "attn_k.weight", rand(d, d, scale=d ** -0.5))
        w.add_tensor(p + "attn_v.weight", rand(d, d, scale=d ** -0.5))
        wo = rand(d, d, scale=d ** -0.5)
        wo[GUARD, :] = 0.0  # no layer writes the guard dimension
        w.add_tensor(p + "attn_output.weight", wo)
        w.add_tensor(p + "ffn_gate.weight", rand(a.ffn, d, scale=d ** -0.5))
        w.add_tensor(p + "ffn_up.weight", rand(a.ffn, d, scale=d ** -0.5))
        down = rand(d, a.ffn, scale=a.ffn ** -0.5)
        down[GUARD, :] = 0.0
        w.add_tensor(p + "ffn_down.weight", down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
