"""Tokenizer and chat template of a checkpoint directory.

`tokenizer.json` is read with the `tokenizers` library; the chat template comes from `chat_template.jinja`,
`chat_template.json` or `tokenizer_config.json` and is rendered with jinja2 in a sandbox, the way
Hugging Face renders it. EOS ids come from `generation_config.json`, `config.json` and the tokenizer.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ConfigError, RequestError


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}
        self.eos_token_ids = eos_token_ids
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when it has no `tokenizer.json`."""
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            return None
        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise ConfigError(f"cannot read {file}: {str(exc).splitlines()[0]}") from None
        config = _read_json(path / "tokenizer_config.json")
        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        eos: list[int] = []
        for source in (_read_json(path / "generation_config.json"), _read_json(path / "config.json")):
            eos += _ids(source.get("eos_token_id"))
            eos += _ids((source.get("text_config") or {}).get("eos_token_id"))
        if "eos_token" in special and (token := backend.token_to_id(special["eos_token"])) is not None:
            eos.append(token)
        return cls(backend, _chat_template(path, config), special, tuple(dict.fromkeys(eos)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with the checkpoint's chat template into the prompt text."""
        if self.chat_template is None:
            raise RequestError(
                "this checkpoint has no chat template (tokenizer_config.json or chat_template.jinja)"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise RequestError("a conversation must be a list of messages, each an object with a 'role'")
        if self._template is None:
            self._template = _environment().from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat template failed: {exc}") from None


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
    ):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    template = _read_json(path / "chat_template.json").get("chat_template") or tokenizer_config.get(
        "chat_template"
    )
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _read_json(file: Path) -> dict[str, Any]:
    if not file.exists():
        return {}
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {file}: {exc}") from None
    return value if isinstance(value, dict) else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value]
    return []
