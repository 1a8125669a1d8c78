"""The GPU benchmark's plumbing on the CPU: a tiny run end to end, the byte count, the random weights."""

from __future__ import annotations

import json

import pytest
import torch

from engine import bench
from engine.bench.cli import parse_args
from engine.bench.presets import with_window
from engine.cache import block_bytes
from engine.config import config_from_dict
from engine.demo_model import demo_config

FULL = "qwen3.5-35b-a3b"


def preset(name: str):
    return config_from_dict(bench.PRESETS[name](), source=f"preset {name}")


def test_tiny_quick_run_writes_the_report(tmp_path):
    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--workloads", "a,b,f"]
    assert bench.main([*argv, "--max-seconds", "120", "--json", str(path)]) == 0

    report = json.loads(path.read_text())
    for key in ("date", "machine", "torch", "triton", "commit", "configuration", "expert_load"):
        assert key in report
    assert report["bandwidth"]["bytes_per_s"] > 0
    assert report["matmul"]["flop_per_s"] > 0
    assert report["configuration"]["dtype"] == "float32"
    assert set(report["workloads"]) == {"a", "b", "f"}
    points = [p for letter in "abf" for p in report["workloads"][letter]]
    assert not [p for p in points if "error" in p]
    measured = [p for p in points if "e2e" not in p["label"] and "row" not in p]  # no roofline: e2e, the fit
    for p in measured:
        assert p["tokens_per_s"] > 0 and not p["capped"]
        assert p["bytes_per_token"]["total"] > 0 and p["pct_of_roofline"] > 0

    (single,) = report["workloads"]["a"]
    assert single["batch"] == 1 and single["end_to_end_tokens_per_s"] > 0
    assert [p["batch"] for p in report["workloads"]["b"]] == [16, 64, 256]
    verify = {p["label"]: p for p in report["workloads"]["f"]}
    for k in (1, 2, 3):
        assert verify[f"verify k={k}"]["ratio_vs_plain"] > 0
        assert verify[f"MTP step k={k}"]["ratio_vs_plain"] > 0  # the tiny preset has an MTP head
        assert "drafting_ms_per_step" in verify[f"MTP step k={k}"]
    assert verify["e2e plain"]["tokens_per_s"] > 0
    assert set(verify["spec_costs.json row"]["row"]) == {"bytes_per_s", "step_s", "verify_s", "draft_s"}
    for k, length in ((1, 1.8), (2, 2.4), (3, 3.39)):
        point = verify[f"e2e AL {length} k={k}"]
        assert point["speedup_vs_plain"] > 0 and point["mean_accepted_length"] > 1
        assert point["accepted_drafts"] == point["leading_right_drafts"] > 0  # the controlled acceptance held


def test_repeat_runs_each_workload_again_in_the_same_process(tmp_path):
    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--workloads", "a"]
    assert bench.main([*argv, "--repeat", "2", "--max-seconds", "60", "--json", str(path)]) == 0

    report = json.loads(path.read_text())
    first, second = report["workloads"]["a"]
    assert first["label"].endswith("[run 1]") and second["label"].endswith("[run 2]")
    assert first["label"].removesuffix(" [run 1]") == second["label"].removesuffix(" [run 2]")
    assert first["tokens_per_s"] > 0 and second["tokens_per_s"] > 0
    assert report["configuration"]["repeat"] == 2


def recorded_cores(monkeypatch) -> list:
    """Every engine core the bench's workloads build, in order."""
    import engine.bench.harness as harness

    cores = []
    real = harness.build_core

    def recording(*args, **kwargs):
        cores.append(real(*args, **kwargs))
        return cores[-1]

    monkeypatch.setattr(harness, "build_core", recording)
    return cores


def test_block_size_reaches_every_engine(monkeypatch, tmp_path):
    """--block-size sets the KV block size of the workloads' engines (issue 19: 64-position blocks)."""
    cores = recorded_cores(monkeypatch)
    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--workloads", "a,b"]
    assert bench.main([*argv, "--block-size", "64", "--max-seconds", "60", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["configuration"]["block_size"] == 64
    assert cores and {core.cache.block_size for core in cores} == {64}
    assert not [p for p in report["workloads"]["b"] if "error" in p]


def test_draft_head_reaches_the_speculating_engines(monkeypatch, tmp_path):
    """--draft-head fp8: (f)'s MTP steps score drafts with the e4m3 copy (issue 18: its cost measured)."""
    cores = recorded_cores(monkeypatch)
    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--workloads", "f"]
    assert bench.main([*argv, "--draft-head", "fp8", "--max-seconds", "60", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["configuration"]["settings"]["draft_head"] == "fp8"
    speculating = [core for core in cores if core.runner.k]
    assert speculating and all(core.runner.model.draft_head is not None for core in speculating)


def test_fp8_kv_cache_runs_batch_decode_and_documents(tmp_path):
    """--kv-cache-dtype fp8 reaches every workload's engine and the byte count (e4m3 plus scales)."""
    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--workloads", "b,d"]
    assert bench.main([*argv, "--kv-cache-dtype", "fp8", "--max-seconds", "60", "--json", str(path)]) == 0

    report = json.loads(path.read_text())
    assert report["configuration"]["kv_cache_dtype"] == "fp8"
    assert report["configuration"]["settings"]["kv_cache_dtype"] == "fp8"
    points = report["workloads"]["b"] + report["workloads"]["d"]
    assert points and not [p for p in points if "error" in p]
    config = preset("tiny")
    row = config.head_dim + 4  # e4m3 bytes and the fp32 scale of one (position, kv head)
    per_position = (config.layer_types.count("full_attention")) * 2 * config.num_key_value_heads * row
    b16 = report["workloads"]["b"][0]
    kv = b16["bytes_per_token"]["kv"] * b16["batch"]  # one step's KV bytes over its batch's sequences
    assert kv == pytest.approx(b16["batch"] * (b16["mean_context"] + 1) * per_position, rel=1e-6)


def test_kv_accuracy_prints_the_table_and_writes_json(tmp_path, capsys):
    from engine.bench import kv_accuracy

    path = tmp_path / "kv.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--seqs", "2", "--prompt-len", "24", "--tokens", "8"]
    assert kv_accuracy.main([*argv, "--json", str(path)]) == 0
    assert "greedy agreement (teacher-forced)" in capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["tokens"] == 8 and report["seqs"] == 2 and len(report["first_divergence"]) == 2
    assert 0.0 <= report["greedy_agreement"] <= 1.0 and report["max_logit_error"] >= 0.0


def test_cli_passes_its_arguments_to_the_benchmark(monkeypatch, tmp_path):
    from pipeline import cli

    monkeypatch.setenv("ENCLAVE_HOME", str(tmp_path))
    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "--quick", "--workloads", "a", "--help"]) == 0
    assert seen == [["--quick", "--workloads", "a", "--help"]]


def test_full_preset_reads_about_2_95_billion_parameters_per_token():
    config = preset(FULL)
    counts = bench.param_counts(config)  # built on the meta device: nothing allocated
    assert counts.active(1) == pytest.approx(2.95e9, rel=0.01)
    assert counts.total - counts.mtp == pytest.approx(34.7e9, rel=0.01)

    one = bench.step_bytes(counts, config, torch.bfloat16, seqs=1, context=0)
    assert one.weights == 2 * counts.active(1)
    # The single-stream bound: weights only, at 4.3 TB/s.
    assert 4.3e12 / one.weights == pytest.approx(729, rel=0.01)
    # Each layer's DeltaNet state (fp32) is read and written once per step: 30 x 2 MiB, twice.
    assert one.state == pytest.approx(2 * 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2))

    sixty_four = bench.step_bytes(counts, config, torch.bfloat16, seqs=64, context=512)
    assert sixty_four.weights < 64 * one.weights
    assert sixty_four.kv == 64 * 513 * 10 * 2 * 2 * 256 * 2  # 10 attention layers, K and V, 2 heads of 256


def test_fp8_counts_one_byte_for_the_projections_and_experts_it_stores():
    config = preset(FULL)
    plain, fp8 = bench.param_counts(config), bench.param_counts(config, "fp8")
    assert plain.fp8_dense == 0 and not plain.fp8_experts
    assert fp8.active(1) == plain.active(1)  # the same parameters, fewer bytes
    for tokens in (1, 64):
        experts = plain.moe_layers * bench.expected_experts(tokens, 256, 8) * plain.expert
        expected = 2 * plain.active(tokens) - fp8.fp8_dense - experts
        assert fp8.active_bytes(tokens, 2) == pytest.approx(expected)
    # At batch 1 the routed experts and the dense projections drop to one byte, the lm_head (1 GB), the
    # embedding row, router and in_proj_ba do not: 3.5 GB instead of 5.9.
    assert 0.35 < fp8.active_bytes(1, 2) / plain.active_bytes(1, 2) < 0.75
    assert fp8.fp8_dense < plain.dense


@pytest.mark.parametrize("tokens", [1, 3, 17, 63, 500, 100_000])
def test_expected_experts_is_top_k_for_one_token_and_bounded(tokens):
    touched = bench.expected_experts(tokens, 256, 8)
    assert 8 <= touched <= min(256, 8 * tokens)
    if tokens == 1:
        assert touched == pytest.approx(8)
    if tokens == 100_000:
        assert touched == pytest.approx(256)


def test_random_weights_are_seeded_finite_and_shaped_for_the_model():
    config = preset("tiny")
    model = bench.random_model(config, torch.device("cpu"), torch.float32, seed=3)
    again = bench.random_model(config, torch.device("cpu"), torch.float32, seed=3)
    for (name, p), (_, q) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.isfinite(p).all(), name
        assert torch.equal(p, q), name
    layer = model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.zeros(config.hidden_size))  # zero-centred: 1 + w
    assert torch.equal(layer.linear_attn.norm_weight, torch.ones(config.linear_value_head_dim))
    assert (layer.linear_attn.A_log.exp() >= 1).all() and (layer.linear_attn.A_log.exp() <= 16).all()
    router_norms = layer.mlp.gate.weight.norm(dim=-1)
    assert torch.allclose(router_norms, torch.full_like(router_norms, bench.ROUTER_LOGIT_STD))


def test_router_init_spreads_tokens_evenly_over_the_experts():
    model = bench.random_model(preset("tiny"), torch.device("cpu"), torch.float32, seed=0)
    spread = bench.expert_load(model, seqs=4, tokens_per_seq=64)
    assert spread["tokens"] == 256 and spread["layers"] == 4
    assert spread["unused_fraction"] == 0
    # 8 experts, top-2 of 256 tokens: 64 per expert on average; random routing gives about 1.2x at most.
    assert spread["max_over_mean"] < 1.5
    assert spread["max_over_mean"] < spread["uniform_random"]["max_over_mean"] + 0.25


def test_fp8_quantisation_of_a_built_model(tmp_path):
    """--quantization fp8 turns the dense projections of the random preset into block-FP8 linears."""
    import json

    from engine.bench import main

    out = tmp_path / "fp8.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--workloads", "a"]
    assert main([*argv, "--quantization", "fp8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["configuration"]["quantization"] == "fp8"


def test_quantize_model_converts_the_dense_projections():
    from engine.bench.presets import PRESETS, random_model
    from engine.config import config_from_dict
    from engine.model.fp8_linear import FP8_PROJECTIONS, Fp8Linear, quantize_model_

    config = config_from_dict(PRESETS["tiny"](), source="tiny")
    model = random_model(config, torch.device("cpu"), torch.float32, seed=0)
    dense = {n: m for n, m in model.named_modules() if n.endswith(FP8_PROJECTIONS)}
    x = {
        n: torch.randn(5, m.in_features, generator=torch.Generator().manual_seed(1)) for n, m in dense.items()
    }
    before = {n: m(x[n]) for n, m in dense.items()}
    assert quantize_model_(model) == len(dense) > 0
    for name, expected in before.items():
        module = model.get_submodule(name)
        assert isinstance(module, Fp8Linear) and module.weight.dtype == torch.float8_e4m3fn
        # e4m3 weights and per-token-group e4m3 activations: a few percent relative error per projection.
        err = ((module(x[name]) - expected).norm() / expected.norm()).item()
        assert 0 < err < 0.06, (name, err)


def test_peer_shaped_workloads_run_quick_and_their_tokens_add_up(tmp_path, capsys):
    from engine.bench.serving import PEERS
    from engine.bench.settings import QUICK

    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--workloads", "h,i,j"]
    assert bench.main([*argv, "--max-seconds", "120", "--json", str(path)]) == 0

    report = json.loads(path.read_text())
    assert set(report["workloads"]) == {"h", "i", "j"}
    figures = {
        "h": ("tokens_per_s", 50_465),
        "i": ("tokens_per_s", 56_424),
        "j": ("output_tokens_per_s", 8_146),
    }
    for letter, (metric, figure) in figures.items():
        (p,) = report["workloads"][letter]
        shape = getattr(QUICK, PEERS[letter][0])
        assert "error" not in p and not p["capped"], p
        assert p["requests"] == p["submitted"] == p["completed"] == shape.requests
        assert (p["prompt_len"], p["max_tokens"], p["concurrency"]) == (
            shape.prompt_len,
            shape.new,
            shape.concurrency,
        )
        # ignore_eos: every request generates its full length.
        assert p["prompt_tokens"] == shape.requests * shape.prompt_len
        assert p["output_tokens"] == shape.requests * shape.new
        assert p["total_tokens"] == p["prompt_tokens"] + p["output_tokens"]
        # No preemption in a cache this size: the engine computed exactly these tokens.
        assert p["preemptions"] == 0
        assert (p["computed_prompt_tokens"], p["computed_output_tokens"]) == (
            p["prompt_tokens"],
            p["output_tokens"],
        )
        assert p["tokens_per_s"] == pytest.approx(p["total_tokens"] / p["wall_s"])
        assert p["output_tokens_per_s"] == pytest.approx(p["output_tokens"] / p["wall_s"])
        assert p["vllm"]["metric"] == metric and p["vllm"]["figure"] == figure
        assert p["vs_vllm"] == pytest.approx(p[metric] / figure)
        # (h) and (j): the engine runs as many as the client keeps in flight; (i): the CPU's default.
        assert p["max_num_seqs"] == (shape.concurrency or 64)
    assert report["configuration"]["sizes"]["peer_h"] == {
        "requests": QUICK.peer_h.requests,
        "prompt_len": QUICK.peer_h.prompt_len,
        "new": QUICK.peer_h.new,
        "concurrency": QUICK.peer_h.concurrency,
    }
    table = capsys.readouterr().out
    assert "total tok/s" in table and "output tok/s" in table and "vs vLLM" in table
    assert f"(h) {report['workloads']['h'][0]['label']}" in table and "50,465 total" in table
    assert "8,146 output" in table


class SlowEngine:
    """Stands in for `Engine.submit`: finishes requests in order on its own thread (or never), counting
    those in flight."""

    def __init__(self, finish: bool = True) -> None:
        import queue
        import threading

        self.lock = threading.Lock()
        self.in_flight = self.most = self.submitted = 0
        self.queue: queue.Queue = queue.Queue()
        if finish:
            threading.Thread(target=self._finish, daemon=True).start()

    def submit(self, prompt, params):
        from concurrent.futures import Future

        future = Future()
        with self.lock:
            self.in_flight += 1
            self.submitted += 1
            self.most = max(self.most, self.in_flight)
        self.queue.put((prompt, future))
        return future

    def _finish(self) -> None:
        import time

        while True:
            prompt, future = self.queue.get()
            time.sleep(0.005)
            with self.lock:
                self.in_flight -= 1
            future.set_result(prompt)


@pytest.mark.parametrize(("requests", "concurrency"), [(30, 1), (40, 7), (5, 8)])
def test_submit_all_keeps_at_most_the_concurrency_in_flight(requests, concurrency):
    import time
    from concurrent.futures import wait

    from engine.bench.serving import submit_all

    engine = SlowEngine()
    prompts = [[i] for i in range(requests)]
    futures = submit_all(engine, prompts, None, concurrency, time.perf_counter() + 60)
    wait(futures, timeout=60)
    assert [f.result() for f in futures] == prompts
    assert engine.most <= concurrency


@pytest.mark.parametrize(("concurrency", "submitted"), [(3, 3), (None, 20)])
def test_submit_all_stops_at_the_deadline_with_the_concurrency_in_flight(concurrency, submitted):
    import time

    from engine.bench.serving import submit_all

    engine = SlowEngine(finish=False)  # nothing ever finishes: only a limit holds requests back
    futures = submit_all(engine, [[i] for i in range(20)], None, concurrency, time.perf_counter() + 0.2)
    assert len(futures) == engine.submitted == submitted


def test_synthetic_tokenizer_has_the_models_vocabulary_and_round_trips_json():
    from engine.bench.constrained import synthetic_tokenizer

    backend = synthetic_tokenizer(248_320).backend
    assert backend.get_vocab_size() == 248_320
    text = '{"patient_id": "AB123456", "age": 42, "diagnoses": [{"code": "J45", "confirmed": true}]}'
    ids = backend.encode(text).ids
    assert backend.decode(ids) == text and len(ids) < 0.6 * len(text)  # merged tokens, not bytes
    with pytest.raises(ValueError):
        synthetic_tokenizer(100)


def test_every_preset_names_its_end_token_as_constrained_output_needs():
    from engine.bench.presets import PRESETS
    from engine.config import config_from_dict

    for name, raw in PRESETS.items():  # (k) on the 35B preset once failed: llguidance needs an eos token
        assert config_from_dict(raw()).eos_token_ids, name


@pytest.mark.parametrize(
    "fill_args", [[], ["--fill-pool", "python", "--fill-threads", "2"]], ids=["default", "python"]
)
def test_constrained_workload_runs_plain_and_held_to_the_schema(tmp_path, fill_args):
    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--workloads", "k"]
    argv += fill_args
    assert bench.main([*argv, "--batches", "4", "--max-seconds", "60", "--json", str(path)]) == 0
    points = json.loads(path.read_text())["workloads"]["k"]
    assert [p["batch"] for p in points] == [1, 4]
    for p in points:
        assert "error" not in p, p
        assert p["plain"]["decode_steps"] > 0 and p["constrained"]["decode_steps"] > 0
        assert p["constrained"]["batch"] == p["plain"]["batch"] == p["batch"]  # none finished early
        # the comparator: the held run's tokens replayed through one-token masks, none taken off the record
        assert p["replay"]["decode_steps"] > 0 and p["replay"]["batch"] == p["batch"]
        assert p["replay"]["mismatches"] == 0
        assert p["overhead"] == p["ms_per_step"] / p["replay_ms_per_step"] - 1
        # the host's mask fills of the held run: one per step that samples, each over that step's rows
        fill = p["fill"]
        assert fill["calls"] >= p["constrained"]["decode_steps"] and 1 <= fill["mean_rows"] <= p["batch"]
        assert 0 < fill["mean_ms"] <= fill["max_ms"] and fill["threads"] >= 1
        assert (fill["pool"], fill["threads"]) == (("python", 2) if fill_args else ("llguidance", 1))


def test_long_prompts_run_past_the_presets_window_with_yarn(monkeypatch, tmp_path, capsys):
    # The tiny preset with a 256-position window: 300 tokens need YaRN (factor 4: 1,024), as 1M does on
    # Qwen3.6 (factor 4 over 262,144).
    monkeypatch.setitem(bench.PRESETS, "tiny", lambda: demo_config(1024) | {"max_position_embeddings": 256})
    path = tmp_path / "bench.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--workloads", "e"]
    argv += ["--long-prompt", "100,300", "--max-num-batched-tokens", "64", "--long-prefill-chunk", "128"]
    assert bench.main([*argv, "--max-seconds", "60", "--json", str(path)]) == 0

    report = json.loads(path.read_text())
    assert report["configuration"]["rope"] == "yarn x4, window 1,024"
    points = {p["label"]: p for p in report["workloads"]["e"]}
    assert list(points) == ["prefill 100", "decode at 100", "prefill 300", "decode at 300"]
    for length in (100, 300):
        prefill, decode = points[f"prefill {length}"], points[f"decode at {length}"]
        assert prefill["prompt_len"] == decode["prompt_len"] == length and not prefill["capped"]
        assert prefill["prefill_s"] > 0 and prefill["tokens_per_s"] > 0 and prefill["chunk"] == 128
        assert prefill["steps"] == -(-length // 128)  # alone: chunks of 128, not of 64
        assert prefill["flops"] > prefill["attention_flops"] > 0 and prefill["pct_of_matmul_rate"] > 0
        assert decode["tokens_per_s"] > 0 and decode["mean_context"] >= length
        # The decode roofline counts the KV cache read at that context.
        assert decode["bytes_per_token"]["kv"] >= length * block_bytes(preset("tiny"), torch.float32, 1, 0)
        assert decode["pct_of_roofline"] > 0
    # Causal attention's work grows with the square of the prompt.
    assert points["prefill 300"]["attention_flops"] == 9 * points["prefill 100"]["attention_flops"]
    table = capsys.readouterr().out
    assert "(e) prefill 300" in table and "(e) decode at 300" in table


@pytest.mark.parametrize(
    ("text", "lengths"),
    [
        ("131072,262144,1000000", (131072, 262144, 1000000)),
        ("131k, 262k ,1M", (131000, 262000, 1000000)),
        ("128Ki,256ki,1Mi", (131072, 262144, 1048576)),
    ],
)
def test_long_prompt_lengths_take_suffixes(text, lengths):
    assert parse_args(["--long-prompt", text]).long_prompt == lengths


@pytest.mark.parametrize("text", ["", "0", "12kk", "Mi", "1.5M", "-3"])
def test_bad_long_prompt_lengths_are_refused(text, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--long-prompt", text])
    assert "--long-prompt" in capsys.readouterr().err


def test_a_window_is_widened_with_qwen36s_yarn_only_when_needed():
    raw = bench.PRESETS[FULL]()
    assert with_window(raw, 262144) is raw
    wide = config_from_dict(with_window(raw, 1_000_035))
    assert wide.rope.rope_type == "yarn" and wide.rope.factor == 4.0 and wide.max_model_len == 1 << 20
    assert wide.rope.original_max_position_embeddings == 262144 and wide.rope.theta == 1e7
    assert config_from_dict(with_window(raw, 1_500_000)).max_model_len == 1 << 21


def test_replay_masks_allow_exactly_the_recorded_token():
    # The (k) comparator's one-token masks, read by the engine's own bitmask kernel (the torch reference)
    import torch

    from engine.bench.constrained import ReplayCompiler
    from engine.grammar import allocate_bitmask, apply_bitmask

    vocab = 100
    replayer = ReplayCompiler([99])
    states = [replayer.state([3, 31, 32]), replayer.state([63, 0]), replayer.state([])]
    states[1].accept(63)  # the second is one token on: 0 next
    bitmask = allocate_bitmask(4, vocab, pin=False)
    bitmask[:] = 0
    replayer.fill(states, bitmask, [0, 2, 3])
    logits = torch.zeros(4, vocab)
    apply_bitmask(logits, bitmask, [0, 2, 3])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3]
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [0]
    assert torch.isfinite(logits[3]).all() and torch.isfinite(logits[1]).all()  # past its record; unmasked
    for taken, token in ((3, 31), (31, 32)):  # bit 31 (the int32 sign bit), then the next word's bit 0
        states[0].accept(taken)
        bitmask[:] = 0
        replayer.fill(states[:1], bitmask, [0])
        logits = torch.zeros(4, vocab)
        apply_bitmask(logits, bitmask, [0])
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [token]
    assert states[0].matcher.mismatches == 0 and states[1].matcher.mismatches == 0


def test_a_long_prefill_reports_when_it_reached_each_mark():
    # (e) at 1M reports the time to 131k, 262k and 524k positions: a 262k prompt's own prefill (same chunks)
    from engine.bench.workloads import reached

    chunk = 32768
    trace = [(chunk * (i + 1), 2.0 * (i + 1)) for i in range(31)] + [(1_000_000, 63.0)]
    assert reached(trace, 1_000_000) == {131072: 8.0, 262144: 16.0, 524288: 32.0}
    assert reached(trace[:9], 300_000) == {131072: 8.0, 262144: 16.0}  # 524,288 is past the prompt
    assert reached(trace[:3], 1_000_000) == {}  # capped before the first mark: none reported
    assert reached([], 100) == {}
