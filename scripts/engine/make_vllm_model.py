#!/usr/bin/env python3
"""Writes a tiny random-weight Llama in Hugging Face's format, for real vLLM in
the tests and `demo --engine vllm`.

No download (HF_HUB_OFFLINE): a 2-layer Llama (hidden 256) with random weights,
a byte-level BPE tokenizer of 4,096 tokens trained here on generated text, and
a ChatML chat template. The text it writes is gibberish; the engine does all the
real work a served model does: tokenising, prefill, paged KV cache, prefix
caching, decoding, and its KV-cache events. The same seed writes the same model.
"""
import argparse
import json
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus(seed):
    """Generated English-like lines: the tokenizer's training text."""
    rng = random.Random(seed)
    words = ("the of and to in is you that it he was for on are as with his they at be "
             "this have from or one had by word but not what all were we when your can said "
             "there use an each which she do how their if will up other about out many then "
             "them these so some her would make like him into time has look two more write "
             "go see number no way could people my than first water been call who oil its "
             "now find long down day did get come made may part agent tool call result file "
             "code test error function return value session turn user assistant system "
             "prompt cache model token request response json data list read edit run").split()
    for _ in range(4000):
        n = rng.randint(4, 16)
        yield " ".join(rng.choice(words) for _ in range(n)) + rng.choice([".", ",", "?", "!", ":"])
    for c in range(32, 127):
        yield chr(c) * 3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory to write the model into")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(a.out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(a.seed), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(a.out)

    torch.manual_seed(a.seed)
    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16384,
        bos_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.convert_tokens_to_ids("<|endoftext|>"),
        tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(a.out, safe_serialization=True)
    with open(os.path.join(a.out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": cfg.eos_token_id, "bos_token_id": cfg.bos_token_id}, f)
    print(a.out)


if __name__ == "__main__":
    main()
