"""Chat templates written for the tests in the shapes real models ship, and model folders
that carry them (the demo model's weights and tokenizer, another template).

HOSTILE is ChatML that misbehaves when the last turn says so ('loop', 'bomb', 'recurse'),
so that it passes the frontend's start-up test and hurts only the requests that ask;
LOOPS_ALWAYS never finishes. HERMES_THINKING is ChatML the way Qwen3's template writes it: the tools in the system
turn inside <tools></tools>, an assistant's calls as <tool_call> blocks, tool results as
<tool_response> blocks in a user turn, and a generation prompt that opens the thought
(``<think>\\n``) unless ``enable_thinking`` is false, when it writes a closed, empty one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERMES_THINKING = """{{- bos_token }}
{%- if tools %}
{{- '<|im_start|>system\\nYou may call functions. <tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nFor each call write <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}
{{- call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}
{{- '<think>\\n' }}
{%- endif %}
{%- endif %}
"""


CHATML = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_NESTED_RANGES = "{%- for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOSTILE = (
    "{%- macro deeper(n) %}{{ deeper(n + 1) }}{% endmacro %}"
    "{%- set last = messages[-1]['content'] %}"
    f"{{%- if last == 'loop' %}}{_NESTED_RANGES}{{% endif %}}"
    "{%- if last == 'bomb' %}{{ 'a' * 300000000 }}{% endif %}"
    "{%- if last == 'recurse' %}{{ deeper(0) }}{% endif %}" + CHATML
)
LOOPS_ALWAYS = _NESTED_RANGES + CHATML


def model_with_template(demo_model_dir: Path, out: Path, template: str) -> Path:
    """A copy of the demo model whose chat template is ``template``."""
    shutil.copytree(demo_model_dir, out)
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out
