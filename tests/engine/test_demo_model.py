"""The demo checkpoint: deterministic, in the exact layout transformers reads, with an MTP head."""

import subprocess
import sys

import torch

from engine import SamplingParams
from engine.checkpoint import CheckpointReader
from engine.demo_model import LABEL, write_demo_model


def test_written_twice_byte_identical(tmp_path):
    a, b = write_demo_model(tmp_path / "a"), write_demo_model(tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= set(files)
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert LABEL in (a / "config.json").read_text()


def test_layout_has_per_expert_and_mtp_tensors(demo_dir):
    names = CheckpointReader(demo_dir).names()
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names
    assert {"mtp.fc.weight", "mtp.layers.0.mlp.experts.0.gate_proj.weight", "mtp.norm.weight"} <= names


def test_transformers_reads_it_and_agrees(demo_dir, demo_engine):
    from transformers import AutoTokenizer, Qwen3_5MoeForCausalLM

    ref = Qwen3_5MoeForCausalLM.from_pretrained(
        demo_dir, dtype=torch.float32, experts_implementation="eager"
    ).eval()
    tok = AutoTokenizer.from_pretrained(demo_dir)
    messages = [{"role": "user", "content": "Summarise the discharge note."}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(prompt)["input_ids"]
    out = demo_engine.chat(messages, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert out.token_ids == expected[0, len(ids) :].tolist()
    assert demo_engine.has_mtp


def test_cli_writes_and_reports_errors(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "engine.demo_model", str(tmp_path / "m")], capture_output=True, text=True
    )
    assert ok.returncode == 0 and (tmp_path / "m" / "model.safetensors").exists()
    (tmp_path / "file").write_text("x")
    bad = subprocess.run(
        [sys.executable, "-m", "engine.demo_model", str(tmp_path / "file")], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
