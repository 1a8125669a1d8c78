"""Qwen's tool calls in a model's answer, parsed into OpenAI `tool_calls`.

Qwen3.5 (and Qwen3-Coder) write each call as XML-like blocks, one parameter per block, values as plain text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Qwen3 and Qwen2.5 write a JSON object instead: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
Both are read. A parameter's text is typed by the tool's JSON Schema where it names the type (else read as
JSON when it parses, else kept as text), as vLLM's qwen3_coder parser does. Text outside the blocks is the
message content. A block that cannot be read stays in the content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of an answer; content None when nothing but calls was written."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    calls, kept, last = [], [], 0
    for block in _BLOCK.finditer(text):
        call = _read_call(block.group(1), schemas)
        if call is None:
            continue
        kept.append(text[last : block.start()])
        last = block.end()
        calls.append(call)
    content = ("".join(kept) + text[last:]).strip() if calls else text
    return (content or None), calls


def _read_call(body: str, schemas: dict[str, dict]) -> dict[str, Any] | None:
    function = _FUNCTION.search(body)
    if function is not None:
        name = function.group(1).strip()
        properties = schemas.get(name, {}).get("properties") or {}
        arguments = {
            p.group(1).strip(): _typed(p.group(2), properties.get(p.group(1).strip()))
            for p in _PARAMETER.finditer(function.group(2))
        }
    else:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
            return None
        name, arguments = value["name"], value.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
    if name not in schemas:
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _typed(text: str, schema: dict[str, Any] | None) -> Any:
    declared = (schema or {}).get("type")
    if declared == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
