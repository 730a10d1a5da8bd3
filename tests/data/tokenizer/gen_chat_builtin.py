#!/usr/bin/env python3
"""Writes chat_builtin.json: what the official chat templates of the families src/chat.rs has
built-in templates for render, through jinja2 set up as transformers' apply_chat_template sets it
up (sandboxed, trim_blocks, lstrip_blocks, raise_exception), not through the crate under test.

Run from this folder: `pip install jinja2 && python3 gen_chat_builtin.py`.
"""
import json

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# google/gemma-3-1b-it (and every Gemma 3 -it), tokenizer_config.json "chat_template".
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# The ChatML template of transformers' chat-templating documentation.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# meta-llama/Meta-Llama-3-8B-Instruct.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# microsoft/Phi-3-mini-4k-instruct.
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
    "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)

FAMILIES = {
    "Gemma": (GEMMA3, "<bos>", "<eos>"),
    "ChatMl": (CHATML, "<|endoftext|>", "<|im_end|>"),
    "Llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "Phi3": (PHI3, "<s>", "<|endoftext|>"),
}

CONVERSATIONS = {
    "one_user_turn": [{"role": "user", "content": "What is the capital of France?"}],
    "system_then_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
    ],
    "multi_turn_with_system": [
        {"role": "system", "content": "Answer in French.\n"},
        {"role": "user", "content": "  Hello!  "},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?\n\n"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
}


def raise_exception(message):
    raise TemplateError(message)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
env.globals["raise_exception"] = raise_exception
cases = []
for family, (source, bos, eos) in FAMILIES.items():
    template = env.from_string(source)
    for name, messages in CONVERSATIONS.items():
        for add_generation_prompt in (True, False):
            text = template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=bos, eos_token=eos)
            cases.append({"family": family, "name": name, "messages": messages,
                          "add_generation_prompt": add_generation_prompt,
                          "bos_token": bos, "eos_token": eos, "text": text})

with open("chat_builtin.json", "w", encoding="utf-8") as f:
    json.dump({"description": "official templates rendered by gen_chat_builtin.py", "cases": cases}, f,
              ensure_ascii=False, indent=1)
    f.write("\n")
