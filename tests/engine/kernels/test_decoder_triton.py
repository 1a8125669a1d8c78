"""The decoder layers' non-MoE part on the Triton kernels (the interpreter on a CPU) against the same
layers on the torch references: the fused residual add + norm, the DeltaNet gate kernel, the q/k norm +
rotary, the output gate and the cos/sin tables, over a prefill step and the decode step after it, the
DeltaNet state and KV cache included.
"""

import pytest
import torch
from torch import nn

from engine import kernels
from engine.bench.presets import init_parameter_
from engine.cache import ModelCache
from engine.config import config_from_dict
from engine.env import reset_engine_env
from engine.model.decoder import DecoderLayer
from engine.model.rotary import rope_parameters
from tests.engine.factories import dense_layout, text_config

# Under the interpreter on a CPU-only machine (conftest.py), on the GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 both ways; the kernels sum the norms' squares (and the attention) in other orders.
TOL = dict(rtol=1e-4, atol=1e-5)


def layer_and_cache(kind: str, seed: int):
    config = config_from_dict(text_config().to_dict())
    layer = DecoderLayer(config, kind, moe=True)
    layer.mlp = nn.Identity()  # the MoE has its own tests
    layer.to(DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            init_parameter_(name, p, g)
            if p.ndim == 1 and "norm" in name:
                p.add_(
                    0.2 * torch.randn(p.shape, generator=g, device=DEVICE)
                )  # norm weights away from their neutral value
    cache = ModelCache(config, 3, 24, 4, DEVICE, torch.float32)
    for t in cache.tensors():
        t.fill_(float("nan"))  # slots without context must be ignored; unwritten KV rows stay NaN
    return config, layer.eval(), cache


def step(layer, config, cache, kind, layout, x, residual):
    inv_freq, scale = rope_parameters(config)
    cos, sin = kernels.rotary_cos_sin(
        layout.positions(DEVICE), inv_freq.to(DEVICE), scale
    )  # on the backend asked for
    state = cache.layers[config.layer_types.index(kind)]
    with torch.no_grad():
        return layer(x, residual, cos, sin, state, layout)


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_decoder_layer_triton_matches_torch(kind, monkeypatch):
    config, layer, cache = layer_and_cache(kind, seed=len(kind))
    _, _, ref_cache = layer_and_cache(kind, seed=len(kind))
    h = config.hidden_size
    g = torch.Generator().manual_seed(1)
    prefill = dense_layout((5, 3), (0, 0), (2, 0))
    decode = dense_layout((1, 1), (5, 3), (2, 0))
    x0, x1, r1 = (torch.randn(n, h, generator=g).to(DEVICE) for n in (8, 2, 2))
    outs = {}
    for backend, c in (("torch", ref_cache), ("triton", cache)):
        monkeypatch.setenv("ENCLAVE_KERNELS", backend)
        reset_engine_env()  # the engine reads its variables once
        first = step(layer, config, c, kind, prefill, x0, None)  # the first layer: x is the stream
        second = step(layer, config, c, kind, decode, x1, r1)  # a later layer: add, then norm
        outs[backend] = (*first, *second)
    for got, expected in zip(outs["triton"], outs["torch"], strict=True):
        torch.testing.assert_close(got, expected, **TOL)
    for got, expected in zip(cache.tensors(), ref_cache.tensors(), strict=True):
        torch.testing.assert_close(got, expected, **TOL, equal_nan=True)
