"""YaRN exactly as Qwen3.6 states it for a 1M-token window, against transformers' rotary embedding.

Qwen3.6-35B-A3B's native window is 262,144 positions; Qwen documents 1M by setting the text config's
`rope_parameters` to YaRN with factor 4 over 262,144 (the M-RoPE fields stay and text ignores them).
"""

import copy
import math

import pytest
import torch

from engine import kernels
from engine.config import config_from_dict
from engine.model.model import CausalLM
from engine.model.rotary import rope_parameters
from tests.engine.test_config import QWEN35_35B_A3B

QWEN36_YARN = {
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
    "rope_type": "yarn",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
    "factor": 4.0,
    "original_max_position_embeddings": 262144,
}
ONE_M = 1 << 20
# Both sides of the native window's end, the 1M window's last position, and a spread in between.
EDGES = [0, 1, 2, 4095, 131071, 262143, 262144, 262145, 524288, ONE_M - 2, ONE_M - 1]
POSITIONS = sorted(
    set(EDGES) | set(torch.randint(0, ONE_M, (300,), generator=torch.Generator().manual_seed(3)).tolist())
)


def qwen36(spelling: str = "rope_parameters", nested: bool = True) -> dict:
    """Qwen3.6-35B-A3B's config.json with the 1M-context rope block Qwen documents, in either spelling."""
    raw = copy.deepcopy(QWEN35_35B_A3B)
    text = raw["text_config"]
    if spelling == "rope_parameters":
        text["rope_parameters"] = dict(QWEN36_YARN)
    elif spelling == "rope_scaling":  # the older key, which transformers 5 still reads
        text["rope_scaling"] = dict(QWEN36_YARN)
        del text["rope_parameters"]
    else:  # "added": the release's block kept, YaRN added in the older spelling
        text["rope_scaling"] = {
            k: QWEN36_YARN[k] for k in ("rope_type", "factor", "original_max_position_embeddings")
        }
    return raw if nested else text


def theirs(text: dict):
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    keys = ("max_position_embeddings", "head_dim", "rope_parameters", "rope_scaling")
    config = Qwen3_5MoeTextConfig(**{k: copy.deepcopy(text[k]) for k in keys if k in text})
    return Qwen3_5MoeTextRotaryEmbedding(config)


def tiny_model(raw: dict) -> CausalLM:
    """A small model with the config's rope (and head dim): the rotary tables depend on nothing else."""
    text = copy.deepcopy(raw["text_config"])
    small = {
        "vocab_size": 32,
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_experts": 4,
        "num_attention_heads": 2,
    }
    small |= {"num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8}
    small |= {"linear_num_key_heads": 1, "linear_num_value_heads": 1, "linear_key_head_dim": 8}
    small |= {"linear_value_head_dim": 8, "mtp_num_hidden_layers": 0, "num_key_value_heads": 1}
    text.update(small, layer_types=["linear_attention"] * 3 + ["full_attention"])
    return CausalLM(config_from_dict(text)).eval()


def test_the_published_config_gives_a_1m_window():
    c = config_from_dict(qwen36())
    assert c.rope.rope_type == "yarn" and c.rope.factor == 4.0
    assert c.rope.original_max_position_embeddings == 262144 and c.rope.rotary_dim == 64
    assert c.rope.theta == 1e7 and c.max_position_embeddings == 262144
    assert c.max_model_len == 1_048_576
    # Without the YaRN block the window is the native one.
    assert config_from_dict(QWEN35_35B_A3B).max_model_len == 262144


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_frequencies_and_scaling_equal_transformers_to_the_bit(spelling):
    raw = qwen36(spelling)
    inv_freq, scale = rope_parameters(config_from_dict(raw))
    ref = theirs(raw["text_config"])
    assert ref.rope_type == "yarn"
    # Bitwise: at position 1,048,575 a one-ulp difference in a frequency moves its angle by up to 0.06 rad.
    assert torch.equal(inv_freq, ref.inv_freq.float())
    assert scale == ref.attention_scaling
    assert math.isclose(scale, 0.1 * math.log(4.0) + 1.0)
    # The low frequencies are interpolated (divided by 4), the highest kept as they are.
    plain, _ = rope_parameters(config_from_dict(QWEN35_35B_A3B))
    torch.testing.assert_close(inv_freq[-1], plain[-1] / 4)
    assert inv_freq[0] == plain[0]


def test_every_spelling_reads_the_same():
    published = config_from_dict(qwen36())
    for other in (qwen36(nested=False), qwen36("rope_scaling"), qwen36("added")):
        c = config_from_dict(other)
        assert c.rope == published.rope and c.max_model_len == 1_048_576
    # "added": transformers lets rope_scaling replace rope_parameters whole, so its theta falls back to
    # 10,000; ours keeps the release's 1e7, as the model was trained with.
    assert published.rope.theta == 1e7


@torch.no_grad()
def test_cos_sin_and_rotated_qk_equal_transformers_up_to_1m():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm, apply_rotary_pos_emb

    raw = qwen36()
    model = tiny_model(raw)
    positions = torch.tensor(POSITIONS)
    cos, sin = model.rotary(positions)  # [T, 64] fp32: what every full-attention layer applies
    x = torch.zeros(1, len(POSITIONS), 4, dtype=torch.float32)
    ref_cos, ref_sin = theirs(raw["text_config"])(x, positions[None])  # [1, T, 64]
    # Same fp32 products and the same cos/sin: equal, not merely close.
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])

    g = torch.Generator().manual_seed(0)
    t, d = len(POSITIONS), 256
    q, k = torch.randn(t, 16, d, generator=g), torch.randn(t, 2, d, generator=g)
    q_w, k_w = 0.1 * torch.randn(d, generator=g), 0.1 * torch.randn(d, generator=g)
    ours_q, ours_k = kernels.qk_norm_rotary(q, k, q_w, k_w, cos, sin, 1e-6)
    q_norm, k_norm = Qwen3_5MoeRMSNorm(d, 1e-6), Qwen3_5MoeRMSNorm(d, 1e-6)
    q_norm.weight.copy_(q_w)
    k_norm.weight.copy_(k_w)
    # transformers' layout: [1, H, T, D] with cos [1, T, rd]
    ref_q, ref_k = apply_rotary_pos_emb(
        q_norm(q).transpose(0, 1)[None], k_norm(k).transpose(0, 1)[None], ref_cos, ref_sin
    )
    # fp32 norms computed in a different order: a few ulps of O(1) values.
    torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    # YaRN matters here: past the native window the plain rope's tables differ.
    plain, _ = rope_parameters(config_from_dict(QWEN35_35B_A3B))
    assert not torch.allclose(kernels.rotary_cos_sin(positions, plain, 1.0)[0], cos, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_cuda_tables_equal_the_cpus_up_to_1m():
    """The Triton tables (libdevice's cos/sin, full range reduction) at angles up to ~1e6 rad."""
    inv_freq, scale = rope_parameters(config_from_dict(qwen36()))
    positions = torch.tensor(POSITIONS)
    cos, sin = kernels.rotary_cos_sin(positions, inv_freq, scale)
    gpu_cos, gpu_sin = kernels.rotary_cos_sin(positions.cuda(), inv_freq.cuda(), scale)
    # The same fp32 angles; cos and sin within an ulp or two of each other's (values <= 1.14).
    torch.testing.assert_close(gpu_cos.cpu(), cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(gpu_sin.cpu(), sin, rtol=0, atol=1e-6)
