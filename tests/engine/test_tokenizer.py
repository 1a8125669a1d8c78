"""Tokenizer and chat template against transformers' AutoTokenizer on the same files."""

import json

import pytest

from engine import RequestError
from engine.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Summarise: patient stable, ünïcödé ✓"},
    {"role": "assistant", "content": "Stable."},
    {"role": "user", "content": "And the plan?"},
]


def test_encode_decode_and_template_match_transformers(demo_dir):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_dir(demo_dir)
    theirs = AutoTokenizer.from_pretrained(demo_dir)
    text = "def main():\n    return 42  # ünïcödé ✓ <|im_end|>"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    for gen in (True, False):
        expected = theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=gen) == expected


def test_eos_ids_from_generation_config(demo_dir):
    tok = Tokenizer.from_dir(demo_dir)
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) <= set(tok.eos_token_ids)
    assert tok.backend.token_to_id("<|im_end|>") in tok.eos_token_ids


def test_chat_template_jinja_file_wins(demo_dir, tmp_path):
    for f in demo_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '[user]"é"[assistant]'


def test_template_errors_are_request_errors(demo_dir, tmp_path):
    for f in demo_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    tok = Tokenizer.from_dir(tmp_path)
    with pytest.raises(RequestError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(RequestError, match="role"):
        tok.apply_chat_template(["not a message"])


def test_no_tokenizer_json_means_no_tokenizer(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None
