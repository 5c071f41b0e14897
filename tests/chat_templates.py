"""Chat templates written for the tests in the shapes real models ship, and model folders
that carry them (the demo model's weights and tokenizer, another template).

HERMES_THINKING is ChatML the way Qwen3's template writes it: the tools in the system
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


def model_with_template(demo_model_dir: Path, out: Path, template: str) -> Path:
    """A copy of the demo model whose chat template is ``template``."""
    shutil.copytree(demo_model_dir, out)
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out
