"""The dispatch: the backend from ENCLAVE_KERNELS (read once), the implementation each op last ran
(`usage()`), and every fallback of a Triton entry point to the torch reference, logged once with the op, the
inputs' shapes and dtypes, and the reason."""

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from engine import kernels
from engine.cache import ModelCache
from engine.config import config_from_dict
from engine.env import EnvError, reset_engine_env
from engine.kernels import SeqLayout, dispatch
from engine.kernels.fp8 import triton as fp8_triton
from engine.kernels.linear import triton as linear_triton
from engine.kernels.moe import align, gemv
from engine.kernels.moe import align_block_size as moe_align_block_size
from engine.kernels.moe import fp8 as moe_fp8
from engine.kernels.moe import triton as moe_triton
from engine.kernels.norm import triton as norm_triton
from engine.kernels.swiglu import swiglu
from engine.model.deltanet import GatedDeltaNet
from engine.model.moe import SparseMoe
from tests.engine.factories import text_config

LOGGER = "engine.kernels.dispatch"


@pytest.fixture(autouse=True)
def _fresh_usage(monkeypatch):
    """Each test starts with nothing recorded or logged, every op on its Triton entry point."""
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    dispatch.reset_usage()
    yield
    dispatch.reset_usage()


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def fp8_weight(*shape, block):
    return kernels.quantize_block_fp8_weight(rand(*shape, seed=1) * 0.1, block)


def fp8_experts_args(t, x_dtype=torch.float32, block=(16, 16), e=4, h=32, i=16):
    w13, s13 = fp8_weight(e, 2 * i, h, block=block)
    w2, s2 = fp8_weight(e, h, i, block=block)
    ids = torch.stack([torch.arange(t) % e, (torch.arange(t) + 1) % e], dim=1)
    return rand(t, h, dtype=x_dtype), w13, s13, w2, s2, torch.full((t, 2), 0.5), ids, block


def experts_args(t, dtype=torch.float32, e=4, h=8, i=4):
    ids = torch.stack([torch.arange(t) % e, (torch.arange(t) + 1) % e], dim=1)
    return (
        rand(t, h, dtype=dtype),
        rand(e, 2 * i, h, dtype=dtype),
        rand(e, h, i, dtype=dtype),
        rand(t, 2),
        ids,
    )


def fp32_as_fp8_args():
    # fp32 expert weights where e4m3 ones belong; one scale block per gate half, up half and down.
    x, w13, w2, weights, ids = experts_args(3)
    return x, w13, torch.ones(4, 2, 1), w2, torch.ones(4, 1, 1), weights, ids, (16, 16)


def long_attention():
    # One sequence of 9 new tokens (past SHORT_QUERY: the prefill path only), Hq 2, Hkv 1, D 16.
    layout = SeqLayout((9,), (0,), (0,), block_tables=((0, 1, 2),), block_size=4)
    q, k, v = rand(9, 2, 16), rand(9, 1, 16, seed=1), rand(9, 1, 16, seed=2)
    caches = torch.zeros(3, 4, 1, 16), torch.zeros(3, 4, 1, 16)
    return kernels.attention(q, k, v, *caches, layout, 0.25)


def long_delta_rule():
    # One sequence of 65 tokens (past MAX_RECURRENT: the chunked path only), Hk 1, Hv 2, dk = dv = 16.
    layout = SeqLayout((65,), (0,), (0,))
    q, k, v = rand(65, 1, 16), rand(65, 1, 16, seed=1), rand(65, 2, 16, seed=2)
    g, beta = -rand(65, 2, seed=3).abs(), torch.sigmoid(rand(65, 2, seed=4))
    return kernels.gated_delta_rule(q, k, v, g, beta, torch.zeros(1, 2, 16, 16), layout)


def wide_conv():
    # A kernel of width 34: 33 cached inputs, past the kernel's MAX_TILE of 32.
    layout = SeqLayout((3,), (0,), (0,))
    return kernels.causal_conv1d(rand(3, 4), rand(4, 34), torch.zeros(1, 4, 33), layout)


def raising(run, error=RuntimeError):
    """`run`, which the reference answers with an error (as it would without the Triton entry point)."""

    def call():
        with pytest.raises(error):
            run()

    return call


W = norm_triton.MAX_DIM + 1  # channels past what one norm program holds
INT = torch.int64
WARN, INFO = logging.WARNING, logging.INFO


@dataclass(frozen=True)
class Fallback:
    """One way into the reference: the op, a call that takes it, what its message names, and how loud."""

    op: str
    call: Callable[[], object]
    words: tuple[str, ...]
    level: int = WARN
    impl: str = "torch"


FALLBACKS = {
    "rms_norm-wide": Fallback(
        "rms_norm",
        lambda: kernels.rms_norm(rand(2, W), torch.zeros(W), 1e-6),
        (f"x [2, {W}] float32", "16384 channels"),
    ),
    "add_rms_norm-wide": Fallback(
        "add_rms_norm",
        lambda: kernels.add_rms_norm(rand(1, W), rand(1, W), torch.zeros(W), 1e-6),
        (f"x [1, {W}] float32", "16384 channels"),
    ),
    "add_rms_norm-dtype": Fallback(
        "add_rms_norm",
        lambda: kernels.add_rms_norm(rand(2, 8), rand(2, 8, dtype=torch.float16), torch.zeros(8), 1e-6),
        ("residual [2, 8] float16", "residual's shape or dtype differs"),
    ),
    "gated_rms_norm-broadcast": Fallback(
        "gated_rms_norm",
        lambda: kernels.gated_rms_norm(rand(2, 3, 8), rand(2, 1, 8), torch.ones(8), 1e-6),
        ("gate [2, 1, 8] float32", "broadcast"),
    ),
    "gated_rms_norm-wide": Fallback(
        "gated_rms_norm",
        lambda: kernels.gated_rms_norm(rand(1, W), rand(1, W), torch.ones(W), 1e-6),
        (f"x [1, {W}]", "16384 channels"),
    ),
    "add_rms_norm_fp8-wide": Fallback(
        "add_rms_norm_fp8",
        lambda: kernels.add_rms_norm_fp8(rand(1, W), rand(1, W), torch.zeros(W), 1e-6, 128),
        (f"x [1, {W}] float32", "16384 channels"),
    ),
    "add_rms_norm_fp8-dtype": Fallback(
        "add_rms_norm_fp8",
        lambda: kernels.add_rms_norm_fp8(
            rand(2, 8), rand(2, 8, dtype=torch.float16), torch.zeros(8), 1e-6, 8
        ),
        ("residual [2, 8] float16", "residual's shape or dtype differs"),
    ),
    "add_rms_norm_fp8-group": Fallback(
        "add_rms_norm_fp8",
        lambda: kernels.add_rms_norm_fp8(rand(2, 12), rand(2, 12), torch.zeros(12), 1e-6, 12),
        ("x [2, 12] float32", "group is not a power of two"),
    ),
    "gated_rms_norm_fp8-broadcast": Fallback(
        "gated_rms_norm_fp8",
        lambda: kernels.gated_rms_norm_fp8(rand(2, 3, 8), rand(2, 1, 8), torch.ones(8), 1e-6, 8),
        ("gate [2, 1, 8] float32", "broadcast"),
    ),
    "gated_rms_norm_fp8-group": Fallback(
        "gated_rms_norm_fp8",
        lambda: kernels.gated_rms_norm_fp8(rand(2, 3, 12), rand(2, 3, 12), torch.ones(12), 1e-6, 12),
        ("x [2, 3, 12] float32", "group is not a power of two"),
    ),
    "qk_norm_rotary-wide": Fallback(
        "qk_norm_rotary",
        lambda: kernels.qk_norm_rotary(
            rand(1, 1, 4097),
            rand(1, 1, 4097),
            torch.zeros(4097),
            torch.zeros(4097),
            torch.ones(1, 2),
            torch.zeros(1, 2),
            1e-6,
        ),
        ("q [1, 1, 4097] float32", "head dim over 4096"),
    ),
    "swiglu-odd": Fallback(
        "swiglu", raising(lambda: swiglu(rand(2, 7))), ("x [2, 7] float32", "odd last dim")
    ),
    "swiglu-empty": Fallback("swiglu", lambda: swiglu(rand(0, 8)), ("x [0, 8] float32", "empty batch"), INFO),
    "causal_conv1d-width": Fallback(
        "causal_conv1d", wide_conv, ("weight [4, 34] float32", "kernel width over 33")
    ),
    "linear-strided": Fallback(
        "linear",
        lambda: kernels.linear(rand(2, 8), rand(8, 4).T),
        ("weight [4, 8] float32 strided", "contiguous along K"),
    ),
    "linear-dtype": Fallback(
        "linear",
        raising(lambda: kernels.linear(rand(2, 8), rand(4, 8, dtype=torch.float16))),
        ("weight [4, 8] float16", "dtype differs from x's"),
    ),
    "linear-empty": Fallback(
        "linear", lambda: kernels.linear(rand(0, 8), rand(4, 8)), ("x [0, 8] float32", "empty batch"), INFO
    ),
    "moe_route-experts": Fallback(
        "moe_route",
        lambda: kernels.moe_route(rand(2, 8193), 2, True),
        ("router_logits [2, 8193] float32", "more than 8192 experts"),
    ),
    "moe_route-top_k": Fallback(
        "moe_route",
        raising(lambda: kernels.moe_route(rand(2, 4), 5, True)),
        ("router_logits [2, 4] float32", "top_k not in 1..E"),
    ),
    "moe_route-empty": Fallback(
        "moe_route",
        lambda: kernels.moe_route(rand(0, 8), 2, True),
        ("router_logits [0, 8]", "empty batch"),
        INFO,
    ),
    "moe_experts-dtype": Fallback(
        "moe_experts",
        lambda: kernels.moe_experts(*experts_args(3, torch.float64)),
        ("x [3, 8] float64", "w13 [4, 8, 8] float64", "not fp16, bf16 or fp32"),
    ),
    "moe_experts-shared-stride": Fallback(
        "moe_experts",
        lambda: kernels.moe_experts(*experts_args(3), rand(8, 4).T, rand(8, 2)),  # [2Is, H] strided along H
        ("x [3, 8] float32", "shared expert's K stride"),
    ),
    "moe_experts-empty": Fallback(
        "moe_experts",
        lambda: kernels.moe_experts(*experts_args(0)),
        ("x [0, 8] float32", "empty batch"),
        INFO,
    ),
    "moe_experts-gemv-dtype": Fallback(
        "moe_experts",
        lambda: gemv.experts(*experts_args(3, torch.float64)),
        ("x [3, 8] float64", "not fp16, bf16 or fp32"),
    ),
    "moe_experts_fp8-dtype": Fallback(
        "moe_experts_fp8",
        lambda: kernels.moe_experts_fp8(*fp8_experts_args(3, torch.float64)),
        ("x [3, 32] float64", "w13 [4, 32, 32] float8_e4m3fn", "not fp16, bf16 or fp32"),
    ),
    "moe_experts_fp8-weights": Fallback(
        "moe_experts_fp8",
        lambda: kernels.moe_experts_fp8(*fp32_as_fp8_args()),
        ("w13 [4, 8, 8] float32", "not float8_e4m3fn"),
    ),
    "moe_experts_fp8-block": Fallback(
        "moe_experts_fp8",
        lambda: kernels.moe_experts_fp8(*fp8_experts_args(73, block=(16, 24))),  # past gemv.MAX_PAIRS
        ("x [73, 32] float32", "scale block K is not a power of two"),
    ),
    "moe_experts_fp8-empty": Fallback(
        "moe_experts_fp8",
        lambda: kernels.moe_experts_fp8(*fp8_experts_args(0)),
        ("x [0, 32] float32", "empty batch"),
        INFO,
    ),
    "moe_align-experts": Fallback(
        "moe_align_block_size",
        lambda: moe_align_block_size(torch.zeros(2, 2, dtype=INT), 8193, 16),
        ("ids [2, 2] int64", "more than 8192 experts"),
    ),
    "moe_align-empty": Fallback(
        "moe_align_block_size",
        lambda: align.align_block_size(torch.zeros(0, 2, dtype=INT), 4, 16),
        ("ids [0, 2] int64", "empty batch"),
        INFO,
    ),
    "fp8_block_linear-block": Fallback(
        "fp8_block_linear",
        lambda: kernels.fp8_block_linear(rand(2, 48), *fp8_weight(16, 48, block=(16, 24)), None, (16, 24)),
        ("x [2, 48] float32", "weight_scale_inv [1, 2] float32", "scale block K is not a power of two"),
    ),
    "attention-prefill-off": Fallback(
        "attention",
        long_attention,
        ("q [9, 2, 16] float32", "ENCLAVE_TRITON_PREFILL=0"),
        INFO,
        "triton+torch-prefill",
    ),
    "gated_delta_rule-prefill-off": Fallback(
        "gated_delta_rule",
        long_delta_rule,
        ("q [65, 1, 16] float32", "ENCLAVE_TRITON_PREFILL=0"),
        INFO,
        "triton+torch-prefill",
    ),
}


def dispatch_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize("name", FALLBACKS)
def test_each_fallback_is_logged_once_with_its_reason(name, caplog, monkeypatch):
    op, call, words, level, impl = dataclasses.astuple(FALLBACKS[name])
    monkeypatch.setenv("ENCLAVE_TRITON_PREFILL", "0")  # read by the two prefill cases only
    with caplog.at_level(logging.INFO, logger=LOGGER):
        call()
        call()
    records = dispatch_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert records[0].levelno == level
    assert f"kernel op {op} falls back to {impl}" in message
    for word in words:
        assert word in message
    assert dispatch.usage()[op] == impl


def test_fp8_dot_before_sm89_is_logged_once(caplog, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        # Uncached: the real function keeps one answer per device for the process.
        assert not fp8_triton.has_fp8_dot.__wrapped__(torch.device("cuda", 0))
        assert not fp8_triton.has_fp8_dot.__wrapped__(torch.device("cuda", 0))
    (record,) = dispatch_records(caplog)
    assert record.levelno == logging.WARNING
    assert "fp8_dot falls back to fp16" in record.getMessage() and "sm_89" in record.getMessage()
    assert dispatch.usage() == {"fp8_dot": "fp16"}


def test_a_second_reason_is_logged_and_reset_forgets(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        dispatch.fallback("op_a", "reason one", x=torch.zeros(2))
        dispatch.fallback("op_a", "reason one", x=torch.zeros(3))  # same cause: not again
        dispatch.fallback("op_a", "reason two", "other", x=torch.zeros(2))
        dispatch.fallback("op_b", "reason one")
        assert len(dispatch_records(caplog)) == 3
        assert dispatch.usage() == {"op_a": "other", "op_b": "torch"}
        dispatch.reset_usage()
        assert dispatch.usage() == {}
        dispatch.fallback("op_a", "reason one")
    assert len(dispatch_records(caplog)) == 4
    assert "op_b falls back to torch for these inputs: reason one" in dispatch_records(caplog)[2].getMessage()


def test_usage_is_a_copy():
    dispatch.choose("op_a", "triton-gemv")
    dispatch.usage()["op_a"] = "changed"
    assert dispatch.usage() == {"op_a": "triton-gemv"}


def test_choices_by_design_are_recorded_not_logged(caplog, monkeypatch):
    stub = torch.zeros(1)
    stubbed = [(gemv, "experts"), (moe_triton, "fused_experts"), (gemv, "experts_fp8")]
    stubbed += [(moe_fp8, "fused_experts"), (linear_triton, "fp8_linear")]
    for module, name in stubbed:  # the kernels themselves: only the choice is under test
        monkeypatch.setattr(module, name, lambda *a, **kw: stub)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert kernels.moe_experts(*experts_args(3)) is stub
        assert dispatch.usage()["moe_experts"] == "triton-gemv"
        assert kernels.moe_experts(*experts_args(gemv.MAX_PAIRS // 2 + 1)) is stub
        assert dispatch.usage()["moe_experts"] == "triton-grouped"
        assert kernels.moe_experts_fp8(*fp8_experts_args(3)) is stub
        assert dispatch.usage()["moe_experts_fp8"] == "triton-gemv"
        assert kernels.moe_experts_fp8(*fp8_experts_args(gemv.MAX_PAIRS // 2 + 1)) is stub
        assert dispatch.usage()["moe_experts_fp8"] == "triton-grouped"
        assert (
            kernels.fp8_block_linear(rand(1, 32), *fp8_weight(16, 32, block=(16, 16)), None, (16, 16)) is stub
        )
        assert dispatch.usage()["fp8_block_linear"] == "triton-gemv"
        rows = linear_triton.MAX_ROWS + 1  # cuBLAS from here on, by design
        assert kernels.linear(rand(rows, 8), rand(4, 8)).shape == (rows, 4)
        assert dispatch.usage()["linear"] == "torch"
    assert dispatch_records(caplog) == []


def test_auto_takes_the_reference_for_cpu_tensors_without_a_log(caplog, monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", "auto")
    x = rand(2, 8)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert kernels.rms_norm(x, torch.zeros(8), 1e-6).shape == x.shape
    assert dispatch.usage() == {"rms_norm": "torch"}
    assert dispatch_records(caplog) == []


def test_backend_from_the_environment_read_once(monkeypatch):
    x = rand(2, 8)
    monkeypatch.setenv("ENCLAVE_KERNELS", "torch")
    reset_engine_env()
    assert dispatch.backend() == "torch"
    assert dispatch.pick("rms_norm", x) is dispatch.implementation("rms_norm", "torch")
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    assert dispatch.backend() == "torch"  # read once: a change needs reset_engine_env()
    reset_engine_env()
    assert dispatch.pick("rms_norm", x) is norm_triton.rms_norm
    assert dispatch.usage() == {"rms_norm": "triton"}
    dispatch.register("test_torch_only_op", torch=lambda t: t)
    with pytest.raises(ValueError, match="no Triton implementation"):
        dispatch.pick("test_torch_only_op", x)
    monkeypatch.setenv("ENCLAVE_KERNELS", "Torch ")  # case and spaces do not matter
    reset_engine_env()
    assert dispatch.backend() == "torch"


@pytest.mark.parametrize("value", ["cuda-magic", "tritonn"])
def test_a_bad_backend_is_one_line_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv("ENCLAVE_KERNELS", value)
    reset_engine_env()
    with pytest.raises(EnvError, match="ENCLAVE_KERNELS must be one of auto, torch, triton") as raised:
        dispatch.pick("rms_norm", rand(2, 8))
    assert "\n" not in str(raised.value)


def test_prefill_switch_is_read_through_the_engine_env(monkeypatch):
    assert dispatch.prefill_kernels_enabled("attention")
    monkeypatch.setenv("ENCLAVE_TRITON_PREFILL", "0")
    assert dispatch.prefill_kernels_enabled("attention")  # the value read first is kept
    reset_engine_env()
    assert not dispatch.prefill_kernels_enabled("attention")
    monkeypatch.setenv("ENCLAVE_TRITON_PREFILL", "no")
    reset_engine_env()
    with pytest.raises(EnvError, match="ENCLAVE_TRITON_PREFILL must be 0 or 1"):
        dispatch.prefill_kernels_enabled("attention")


def test_the_model_records_its_own_choices(monkeypatch):
    # The MoE block's shared expert (fused as expert E, or run on its own) and the DeltaNet layer's fused
    # step (short steps) or op chain (prefill); on the torch references, which is all the choices need.
    monkeypatch.setenv("ENCLAVE_KERNELS", "torch")
    shapes = dict(hidden_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    config = config_from_dict(text_config(**shapes, shared_expert_intermediate_size=16).to_dict())
    moe, x = SparseMoe(config).eval(), rand(3, 32)
    with torch.no_grad():
        moe(x)
        assert dispatch.usage()["moe_shared_expert"] == "fused"
        moe.shared_expert.register_forward_hook(lambda *a: None)  # hooked: run as itself (engine.bench)
        moe(x)
        assert dispatch.usage()["moe_shared_expert"] == "separate"

    layer = GatedDeltaNet(config).eval()
    state = ModelCache(config, 2, 1, 4, "cpu", torch.float32).linear_states()[0]
    with torch.no_grad():
        layer(rand(9, config.hidden_size), state, SeqLayout((9,), (0,), (0,)))
        assert dispatch.usage()["deltanet_layer"] == "unfused"
        layer(rand(1, config.hidden_size), state, SeqLayout((1,), (9,), (0,)))
        assert dispatch.usage()["deltanet_layer"] == "fused"


def test_a_kernel_not_yet_run_on_a_gpu_is_held_back_from_cuda_under_auto(monkeypatch):
    """`register(..., on_cuda_by_default=False)`: under ENCLAVE_KERNELS=auto a CUDA tensor takes the
    reference (recorded as a choice), ENCLAVE_KERNELS=triton still runs the kernel; an op registered
    without the flag takes Triton on CUDA."""
    cuda_like = torch.zeros(2)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setenv("ENCLAVE_KERNELS", "auto")
    reset_engine_env()
    monkeypatch.setattr(dispatch, "_IMPLEMENTATIONS", dict(dispatch._IMPLEMENTATIONS))  # probes undone after
    monkeypatch.setattr(dispatch, "_HELD_BACK", set(dispatch._HELD_BACK))
    dispatch.register("held_back_probe", on_cuda_by_default=False, torch=len, triton=abs)
    dispatch.register("graduated_probe", torch=len, triton=abs)
    assert dispatch.pick("held_back_probe", cuda_like) is len
    assert dispatch.usage()["held_back_probe"] == "torch"
    assert dispatch.pick("graduated_probe", cuda_like) is abs
    monkeypatch.setenv("ENCLAVE_KERNELS", "triton")
    reset_engine_env()
    assert dispatch.pick("held_back_probe", cuda_like) is abs
    monkeypatch.undo()
    reset_engine_env()
