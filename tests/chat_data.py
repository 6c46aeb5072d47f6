"""Conversations and chat tokenizers for the chat tests: a small byte-level BPE with the
special tokens of three template families, written with a ``tokenizer_config.json`` holding a
chat template, as a model folder ships them."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
"""The template SmolLM2-135M-Instruct's GGUF carries (``tokenizer.chat_template``)."""

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = "Cutting Knowledge Date: December 2023" %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant'] %}
        {{- raise_exception('Only user and assistant roles follow the system message') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
"""A Llama-3-style template: BOS, header tokens, trimmed contents, ``<|eot_id|>``."""

CHATML = """{%- set ns = namespace(system=false) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% set ns.system = true %}{% endif %}
{%- endfor %}
{%- if not ns.system %}
<|im_start|>system
You are a helpful assistant. Tools: {{ {"name": "calc", "args": ["a", "b"]} | tojson }}<|im_end|>
{% endif %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content }}<|im_end|>{% endgeneration %}

    {%- else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
    {%- endif %}
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
"""A Qwen/ChatML-style template using a namespace, ``tojson``, whitespace control and
transformers' ``{% generation %}`` block around each answer."""

TEMPLATES = {"smollm2": SMOLLM2, "llama3": LLAMA3, "chatml": CHATML}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
TOKENS = {"smollm2": ("<|im_start|>", "<|im_end|>"), "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
          "chatml": ("<|endoftext|>", "<|im_end|>")}
"""Each template's (bos_token, eos_token) in its tokenizer_config.json."""

WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def conversation(r: random.Random) -> list[dict[str, str]]:
    """A word-arithmetic exchange: one or two turns, sometimes with a system message."""
    a, b = r.randint(1, 5), r.randint(1, 5)
    messages = [{"role": "user", "content": f"What is {WORDS[a - 1]} plus {WORDS[b - 1]}?"},
                {"role": "assistant", "content": f"It is {WORDS[a + b - 1]}."}]
    if r.random() < 0.4:
        messages = [{"role": "system", "content": "Answer in words."}] + messages
    if r.random() < 0.4:
        messages += [{"role": "user", "content": "And twice that?"},
                     {"role": "assistant", "content": f"{2 * (a + b)} ☃"}]
    return messages


def write_conversations(path: Path, count: int, seed: int = 0) -> Path:
    r = random.Random(seed)
    path.write_text("".join(json.dumps({"messages": conversation(r)}) + "\n"
                            for _ in range(count)))
    return path


def chat_tokenizer(folder: Path, family: str = "smollm2", vocab: int = 400) -> Path:
    """``folder/tokenizer.json`` (a BPE trained on conversations) beside a
    ``tokenizer_config.json`` holding ``family``'s template; returns the tokenizer.json."""
    folder.mkdir(parents=True, exist_ok=True)
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    r = random.Random(1)
    text = [m["content"] for _ in range(300) for m in conversation(r)]
    hf.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(folder / "tokenizer.json"))
    bos, eos = TOKENS[family]
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "chat_template": TEMPLATES[family]}))
    return folder / "tokenizer.json"


def transformers_tokenizer(tokenizer_json: Path, family: str):
    """transformers' fast tokenizer of the same files, with the same template."""
    from transformers import PreTrainedTokenizerFast

    bos, eos = TOKENS[family]
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), bos_token=bos,
                                  eos_token=eos)
    tok.chat_template = TEMPLATES[family]
    return tok
