"""The MTP head (`mtp.*`) is built from a checkpoint and computes what its tensors define.

transformers drops `mtp.*`, so the oracle here is an independent re-computation: transformers' own decoder
layer, norms and rotary, loaded with the same tensors, wired as the MTP head is specified:
    logits = lm_head(norm(layer(fc(concat(norm_e(embed(t+1)), norm_h(h_t))))))
"""

import pytest
import torch

from engine import Engine
from engine.kernels import SeqLayout
from tests.engine.factories import add_mtp, save_text_model, single_cache


def reference_mtp(config, head, ref, next_ids, hidden):
    """Re-compute the head with transformers modules: next_ids [T], hidden [T, H] -> logits [T, V]."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    t = next_ids.shape[0]
    e = ref.model.embed_tokens(next_ids)[None]
    x = torch.cat((head["pre_fc_norm_embedding"](e), head["pre_fc_norm_hidden"](hidden[None])), dim=-1)
    x = head["fc"](x)
    positions = torch.arange(t)[None]
    # [3, batch, T]: one stream per M-RoPE section, all equal for text (older releases need the 3-D form).
    cos_sin = Qwen3_5MoeTextRotaryEmbedding(config)(x, positions[None].expand(3, 1, t))
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    x = head["layers"][0](x, position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)
    return ref.lm_head(head["norm"](x))[0]


@pytest.fixture
def mtp_checkpoint(tmp_path):
    ref = save_text_model(tmp_path, seed=2)
    config, head = add_mtp(tmp_path, seed=9)
    head.eval()
    return tmp_path, ref, config, head


@torch.no_grad()
def test_mtp_head_matches_independent_recomputation(mtp_checkpoint):
    path, ref, config, head = mtp_checkpoint
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32")
    assert engine.has_mtp and len(engine.model.mtp.layers) == 1
    g = torch.Generator().manual_seed(0)
    t = 11
    next_ids = torch.randint(0, config.vocab_size, (t + 1,), generator=g)
    hidden = torch.randn(t + 1, config.hidden_size, generator=g)
    expected = reference_mtp(config, head, ref, next_ids, hidden)  # [t+1, V]

    cache, layout = single_cache(engine.config, 32, num_mtp_layers=1)
    # Prefill t positions, then one more position reading the cached keys and values.
    m = engine.model  # the runner's draft path: the head's normed output, then the shared logits
    got = m.logits(m.mtp_hidden(next_ids[:t], hidden[:t], layout(t), cache))
    step = m.logits(m.mtp_hidden(next_ids[t:], hidden[t:], layout(1, t), cache))
    torch.testing.assert_close(got, expected[:t], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(step, expected[t:], rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == expected[:t].argmax(-1)).all()


def test_checkpoint_without_mtp_has_no_head(tmp_path):
    save_text_model(tmp_path, seed=2)
    engine = Engine.from_pretrained(tmp_path, device="cpu", dtype="float32")
    assert not engine.has_mtp
    with pytest.raises(RuntimeError, match="no MTP head"):
        engine.model.mtp_hidden(torch.tensor([1]), torch.zeros(1, 48), SeqLayout((1,), (0,), (0,)), None)
