"""A chat template that behaves like Qwen3.5's where it matters to Enclave, for tests on the demo model.

Like Qwen3.5's: the generation prompt opens `<think>` unless `enable_thinking` is false, in which case it
holds an empty, closed block; past assistant turns keep only their answer; `tools` are listed in the system
turn with the instruction to answer in Qwen's XML tool-call format (`<tool_call><function=NAME>
<parameter=ARG>VALUE</parameter></function></tool_call>`); tool results come back in user turns as
`<tool_response>` blocks. It is our own, written for the tests, not Qwen's file.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.demo_model import write_demo_model

QWEN_LIKE_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, reply with:\\n<tool_call>\\n<function=NAME>\\n' }}
{{- '<parameter=ARG>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""


def write_qwen_like_model(path: str | Path) -> Path:
    """The random demo checkpoint with QWEN_LIKE_TEMPLATE as its chat template."""
    path = write_demo_model(path)
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = QWEN_LIKE_TEMPLATE
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return Path(path)
