"""A byte-level tokenizer built in code, for presets that ship no vocabulary.

Every UTF-8 byte is one token, so any text round-trips offline; three ChatML special
tokens follow the 256 byte tokens, as in Qwen2's own vocabulary.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Qwen2's ChatML template, reduced to what a byte-level demo model needs.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3's reasoning and tool-call markers: one token each in its vocabulary (not special, so
# they stay in decoded text where the server finds them); the Qwen3 presets add them.
THINK_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# A template in Qwen3's chat format, for the Qwen3 presets (a real model's own template comes
# with its files): ChatML turns; tools listed in the system turn and calls written as
# <tool_call> JSON; tool results as <tool_response> in user turns; an assistant turn's
# reasoning (its reasoning_content, or the text before </think>) kept only in the turns after
# the last user message; `enable_thinking` false ends the generation prompt with an empty
# think block, so the model answers without reasoning.
QWEN3_TEMPLATE = (
    "{%- set last_user = namespace(i=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set last_user.i = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}"
    "{{- '# Tools\n\nFunctions you may call, as JSON signatures:\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\n' + (t | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools>\n\nTo call one, reply with <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n"
    "</tool_call><|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}"
    "{%- if not (tools and loop.first) -%}{{- '<|im_start|>system\n' + m['content'] + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- elif m['role'] == 'user' -%}"
    "{{- '<|im_start|>user\n' + m['content'] + '<|im_end|>\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}"
    "{%- set content = m['content'] or '' -%}{%- set reasoning = m.get('reasoning_content') or '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if loop.index0 > last_user.i and reasoning -%}{{- '<think>\n' + reasoning + '\n</think>\n\n' -}}{%- endif -%}"
    "{{- content -}}"
    "{%- for c in m.get('tool_calls') or [] -%}"
    "{%- set f = c['function'] if c['function'] is defined else c -%}"
    "{%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}"
    "{{- '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' -}}"
    "{{- (f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson)) + '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- elif m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\n<tool_response>\n' + m['content'] + '\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def byte_level_tokenizer(extra: tuple[str, ...] = ()) -> Tokenizer:
    """`extra`: added tokens that are not special (kept in decoded text), after the special ones."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Order the 256 byte symbols by byte value so token id == byte value.
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    if extra:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
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
