"""Engine options: one dataclass per concern, checked when made, the only way options reach the engine; the
flat view that settings files, the environment and command lines use; the `ENCLAVE_*` switches as defaults."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from engine import Engine, EngineError
from engine.graphs import graphs_wanted
from engine.options import (
    MAX_SPECULATIVE_TOKENS,
    CacheOptions,
    EngineOptions,
    KernelOptions,
    LoadOptions,
    OptionError,
    ServingOptions,
    SpeculationOptions,
)

CONCERNS = (LoadOptions, ServingOptions, CacheOptions, KernelOptions, SpeculationOptions)
ENGINE_OPTIONS = {  # what Engine took as keywords before the options existed: each one is an option now
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_speculative_tokens",
    "max_model_len",
    "kv_cache_memory",
    "gpu_memory_utilization",
    "block_size",
    "max_prefixes",
    "mtp_hidden",
    "cuda_graphs",
    "graph_capture_len",  # and three added since
    "warm_up",
    "long_prefill_chunk",
    "async_scheduling",
    "device",
    "dtype",
    "quantization",
    "kv_cache_dtype",  # issue 19
    "state_dtype",  # issue 13
    "draft_head",  # issue 18
    "draft_vocab",
}


def test_importing_the_options_does_not_import_torch():
    code = "import sys, engine.options, engine.errors; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_option_is_flat_named_once_and_documented():
    fields = EngineOptions.flat_fields()
    names = [f.name for f in fields]
    assert len(names) == len(set(names)) == sum(len(dataclasses.fields(c)) for c in CONCERNS)
    assert set(names) == ENGINE_OPTIONS
    for f in fields:
        assert f.doc and "\n" not in f.doc and f.type, f
    defaults = EngineOptions().to_flat()
    assert {f.name: f.default for f in fields} == defaults
    assert defaults["max_num_batched_tokens"] == 8192 and defaults["quantization"] == "none"


def test_text_values_convert():
    options = EngineOptions.from_flat(
        {
            "max_num_seqs": " 64 ",
            "gpu_memory_utilization": "0.5",
            "cuda_graphs": "false",
            "async_scheduling": "1",
            "quantization": "FP8",
            "dtype": "BF16",
            "device": "cuda:1",
            "max_model_len": "auto",
            "kv_cache_dtype": " FP8",
        }
    )
    assert options.serving.max_num_seqs == 64 and options.cache.gpu_memory_utilization == 0.5
    assert options.kernels.cuda_graphs is False and options.serving.async_scheduling is True
    assert options.load == LoadOptions(device="cuda:1", dtype="bf16", quantization="fp8")
    assert options.serving.max_model_len is None
    assert options.cache.kv_cache_dtype == "fp8"


def test_flat_round_trip_and_overrides_keep_the_rest():
    options = EngineOptions.from_flat({"max_num_seqs": 8, "block_size": 8, "num_speculative_tokens": 2})
    assert EngineOptions.from_flat(options.to_flat()) == options
    changed = options.with_flat({"block_size": 32})
    assert changed.cache.block_size == 32 and changed.serving.max_num_seqs == 8
    assert changed.speculation.num_speculative_tokens == 2 and options.cache.block_size == 8


@pytest.mark.parametrize(
    ("flat", "needle"),
    [
        (
            {"max_num_seqs": "0"},
            "ENCLAVE_MAX_NUM_SEQS must be a whole number between 1 and 4096, or auto, got '0'",
        ),
        ({"max_num_seqs": "1e12"}, "ENCLAVE_MAX_NUM_SEQS must be a whole number"),
        ({"max_num_seqs": "9" * 5000}, "ENCLAVE_MAX_NUM_SEQS must be a whole number"),
        ({"max_num_seqs": True}, "got True"),  # a boolean is not a number
        ({"block_size": 2.0}, "ENCLAVE_BLOCK_SIZE must be a whole number"),
        (
            {"gpu_memory_utilization": "nan"},
            "ENCLAVE_GPU_MEMORY_UTILIZATION must be a number between 0.01 and 1",
        ),
        ({"gpu_memory_utilization": 1.5}, "got 1.5"),
        ({"cuda_graphs": "maybe"}, "ENCLAVE_CUDA_GRAPHS must be true or false, or auto, got 'maybe'"),
        ({"quantization": 8}, "ENCLAVE_QUANTIZATION must be one of none, fp8, got 8"),
        ({"mtp_hidden": "deep"}, "ENCLAVE_MTP_HIDDEN must be one of normed, raw"),
        ({"kv_cache_dtype": "int8"}, "ENCLAVE_KV_CACHE_DTYPE must be one of auto, fp8, got 'int8'"),
        ({"num_speculative_tokens": MAX_SPECULATIVE_TOKENS + 1}, f"between 0 and {MAX_SPECULATIVE_TOKENS}"),
        ({"device": "the gpu"}, "ENCLAVE_DEVICE must be a device such as cuda"),
        ({"dtype": None}, "ENCLAVE_DTYPE must be one of auto, float32"),  # only unset-able options take None
        ({"beams": 4}, "unknown engine option ENCLAVE_BEAMS (known: device, dtype"),
    ],
)
def test_bad_values_are_one_line_naming_where_they_came_from(flat, needle):
    with pytest.raises(OptionError) as info:
        EngineOptions.from_flat(flat, source=lambda name: "ENCLAVE_" + name.upper())
    message = str(info.value)
    # 400: an unknown option's message lists every known name, a list that grows with the options.
    assert needle in message and "\n" not in message and len(message) < 400, message
    assert isinstance(info.value, EngineError) and isinstance(info.value, ValueError)


def test_each_concern_checks_itself():
    with pytest.raises(
        OptionError, match=r"^max_prefixes must be a whole number between 0 and 1024, got -1$"
    ):
        CacheOptions(max_prefixes=-1)
    with pytest.raises(OptionError, match=r"^max_num_batched_tokens must"):
        ServingOptions(max_num_batched_tokens=0)
    with pytest.raises(OptionError, match=r"^mtp_hidden must be one of normed, raw"):
        SpeculationOptions(mtp_hidden="deep")
    with pytest.raises(OptionError, match=r"^kv_cache_dtype must be one of auto, fp8, got 'e5m2'$"):
        CacheOptions(kv_cache_dtype="e5m2")
    with pytest.raises(OptionError, match="engine options' cache must be a CacheOptions"):
        EngineOptions(cache=ServingOptions())
    assert LoadOptions(quantization=" FP8 ").quantization == "fp8"  # choices are normalised
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServingOptions().max_num_seqs = 3


# ---- the only way in


def test_from_pretrained_takes_options_and_flat_overrides(demo_dir):
    options = EngineOptions.from_flat(
        {"device": "cpu", "dtype": "float32", "max_num_seqs": 3, "block_size": 8}
    )
    with Engine.from_pretrained(demo_dir, options, max_prefixes=0, max_num_batched_tokens=32) as e:
        assert e.core.scheduler.max_num_seqs == e.max_num_seqs == 3
        assert e.plan.block_size == 8 and e.plan.num_slots == 3  # no prefix slots
        assert e.core.scheduler.max_num_batched_tokens == 32
        assert e.options.serving.max_num_seqs == 3 and e.options.cache.max_prefixes == 0
        assert e.dtype == torch.float32 and e.device == torch.device("cpu")


def test_the_engine_records_the_options_it_worked_out(demo_engine):
    served = demo_engine.options
    assert served.load.device == "cpu" and served.load.dtype == "float32"
    assert served.serving.max_num_seqs == demo_engine.max_num_seqs == 64  # CPU_MAX_NUM_SEQS
    assert served.serving.max_model_len == demo_engine.max_model_len == demo_engine.config.max_model_len
    assert demo_engine.core.options == served


def test_from_pretrained_keeps_its_keywords_and_refuses_unknown_ones(demo_dir):
    with Engine.from_pretrained(demo_dir, device=torch.device("cpu"), dtype=torch.float32) as e:
        assert e.dtype == torch.float32
    with pytest.raises(OptionError, match="unknown engine option beams"):
        Engine.from_pretrained(demo_dir, device="cpu", beams=4)
    with pytest.raises(OptionError, match="max_num_seqs must be"):
        Engine.from_pretrained(demo_dir, device="cpu", max_num_seqs=0)
    with pytest.raises(EngineError, match="keywords"):
        Engine.from_pretrained(demo_dir, "cpu")
    with pytest.raises(EngineError, match="unsupported dtype"):
        Engine.from_pretrained(demo_dir, device="cpu", dtype=torch.int8)


def test_speculation_without_an_mtp_head_is_refused(tmp_path):
    from tests.engine.factories import save_text_model

    save_text_model(tmp_path, seed=1)
    with pytest.raises(EngineError, match="needs an MTP head"):
        Engine.from_pretrained(tmp_path, device="cpu", num_speculative_tokens=2)


# ---- the variables give defaults, the options decide


@pytest.mark.parametrize(
    ("env", "requested", "expected"),
    [
        ({}, None, True),
        ({"ENCLAVE_CUDA_GRAPHS": "0"}, None, False),
        ({"ENCLAVE_CUDA_GRAPHS": "0"}, True, True),
        ({}, False, False),
        ({"ENCLAVE_KERNELS": "torch"}, True, False),  # the references sync with the host: never captured
    ],
)
def test_cuda_graphs_option_over_its_variable(monkeypatch, env, requested, expected):
    for name in ("ENCLAVE_CUDA_GRAPHS", "ENCLAVE_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert graphs_wanted(torch.device("cuda"), requested) is expected
    assert not graphs_wanted(torch.device("cpu"), True)
