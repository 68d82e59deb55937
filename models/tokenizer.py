"""A byte-level tokenizer built in code, for presets that ship no vocabulary.

Every UTF-8 byte is one token, so any text round-trips offline; three ChatML special
tokens follow the 256 byte tokens, as in Qwen2's own vocabulary.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Qwen2's ChatML template, reduced to what a byte-level demo model needs.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_level_tokenizer() -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Order the 256 byte symbols by byte value so token id == byte value.
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def special_ids(tok: Tokenizer) -> tuple[int, list[int]]:
    """(bos id, eos ids) of the byte-level tokenizer."""
    return tok.token_to_id("<|endoftext|>"), [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for bytes, the mapping ByteLevel pre-tokenization uses.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
