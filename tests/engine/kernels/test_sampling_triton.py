"""The Triton sampling op (temperature, top-k, top-p, exponential race) against the torch reference.

The kernel and the reference rank the same way (value descending, then index: a stable sort), so the ids
must be identical, except where an fp32 rounding decides: a top-p cut whose running mass is within ~1e-6 of
top_p (the two sum in different orders), or a race whose best two p / E are within ~1e-6 (other roundings
of exp). `clear_of_roundings` moves such rows' top_p or noise a little, so the data keeps ties of logits,
also at the cuts, but no decision hangs on a rounding.
"""

import itertools
import random

import pytest
import torch

from engine.env import reset_engine_env
from engine.kernels.sampling import reference
from engine.kernels.sampling.triton import sample_filtered
from engine.sampler import draw_rows
from engine.sampling import SamplingParams
from tests.engine.kernels.cases import crossed

# Under the interpreter on a CPU-only machine (conftest.py), on the GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TEMPERATURES = (0.3, 1.0, 2.0)
TOP_P = (0.1, 0.5, 0.9, 1.0)
MARGIN = 1e-4  # relative distance of any mass or race decision from its rounding


def top_ks(vocab: int) -> tuple[int, ...]:
    return (0, 1, 3, 50, vocab, vocab + 7)


def make_inputs(batch, vocab, dtype=torch.float32, ties=False, seed=0, device=DEVICE):
    """logits [B, V] (`ties`: on a coarse grid, so values repeat, also at the cuts), each row's temperature,
    top_k and top_p a different combination of the test values (shuffled by seed), and Exp(1) race noise."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g) * 3
    if ties:
        logits = (logits * 2).round() / 2
    rng = random.Random(seed)
    combos = list(itertools.product(TEMPERATURES, top_ks(vocab), TOP_P))
    rng.shuffle(combos)
    temperature, top_k, top_p = (torch.tensor(c) for c in zip(*combos[:batch], strict=True))
    race = torch.empty(batch, vocab).exponential_(generator=g)
    inputs = clear_of_roundings(logits.to(dtype), temperature, top_k, top_p, race)
    return tuple(t.to(device) for t in inputs)


def clear_of_roundings(logits, temperature, top_k, top_p, race, seed=0):
    """Nudge each row's top_p until no running mass (in the reference's order) lies within MARGIN of it,
    and redraw its noise until the race's best two differ by more than MARGIN."""
    g = torch.Generator().manual_seed(seed)
    top_p = top_p.clone()
    for row in range(logits.shape[0]):
        while (
            top_p[row] < 1.0 and _mass_margin(logits[row], temperature[row], top_k[row], top_p[row]) < MARGIN
        ):
            top_p[row] = min(1.0, float(top_p[row]) + 3e-3)
        while _race_margin(logits[row], temperature[row], top_k[row], top_p[row], race[row]) < MARGIN:
            race[row].exponential_(generator=g)
    return logits, temperature, top_k, top_p, race


def _mass_margin(logits, temperature, top_k, top_p):
    x = logits.float() / temperature
    vocab = x.numel()
    k = int(top_k) if 0 < int(top_k) < vocab else vocab
    ranked = torch.sort(x, descending=True, stable=True).values
    kept = ranked[ranked >= ranked[k - 1]]
    probs = torch.softmax(kept, dim=-1)
    return float(((probs.cumsum(-1) - probs) - top_p).abs().min())


def _race_margin(logits, temperature, top_k, top_p, race):
    probs = reference.filtered_probs(logits[None], temperature[None], top_k[None], top_p[None])[0]
    if probs.numel() < 2:
        return 1.0
    best = torch.topk(probs / race, 2).values
    return float((best[0] - best[1]) / best[0])


def check(logits, temperature, top_k, top_p, race, **tiles):
    ids = sample_filtered(logits, temperature, top_k, top_p, race, **tiles)
    expected = reference.sample_filtered(logits, temperature, top_k, top_p, race)
    assert ids.dtype == torch.int64 and ids.shape == (logits.shape[0],)
    assert ids.tolist() == expected.tolist()


# (vocab, batch): odd vocabularies, batches of 1 to 5 rows, each row its own temperature, top-k and top-p.
SHAPES = [(1, 3), (7, 5), (100, 4), (1000, 2), (5000, 1), (1000, 5)]


# Every shape in both dtypes, with and without ties in turn, every pair of values meeting (cases.crossed).
@pytest.mark.parametrize("shape, dtype, ties", crossed(SHAPES, [torch.float32, torch.float16], [False, True]))
def test_matches_reference(shape, dtype, ties):
    vocab, batch = shape
    check(*make_inputs(batch, vocab, dtype, ties, seed=vocab + batch))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(("vocab", "batch"), [(100, 5), (1000, 4), (5000, 3)])
def test_matches_reference_through_narrow_bands(vocab, batch, ties):
    # 16-token bands, 64-token tiles, 16 histogram bins: most rows settle through several scans (the
    # bracket split in value, then in the integer image) instead of the first guess.
    inputs = make_inputs(batch, vocab, torch.float32, ties, seed=7 * vocab + batch)
    check(*inputs, cap=16, chunk=64, bins=16)


def test_masked_logits_and_large_tie_groups():
    # -inf logits (a masked vocabulary) and a tie group larger than the band, cut by top-k and top-p.
    vocab = 600
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    logits[:, ::3] = float("-inf")
    logits[1, 100:300] = 2.0
    logits[2, :] = 0.5
    logits[3, 10:400] = 1.25
    temperature = torch.tensor([1.0, 0.7, 1.0, 2.0])
    top_k = torch.tensor([40, 150, 17, 0])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.3])
    race = torch.empty(4, vocab).exponential_(generator=torch.Generator().manual_seed(4))
    inputs = [t.to(DEVICE) for t in clear_of_roundings(logits, temperature, top_k, top_p, race)]
    check(*inputs, cap=32, chunk=64)
    check(*inputs)


def test_top_k_draws_stay_in_the_top_two():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.9, 0.5, 1.0, -0.2, 1.5]).repeat(64, 1)
    race = torch.empty(64, 8).exponential_(generator=torch.Generator().manual_seed(5))
    ids = sample_filtered(
        logits.to(DEVICE),
        torch.full((64,), 1.5, device=DEVICE),
        torch.full((64,), 2, device=DEVICE),
        torch.ones(64, device=DEVICE),
        race.to(DEVICE),
    )
    assert set(ids.tolist()) == {1, 3}


def test_reference_draw_frequencies():
    # 2000 draws from a 4-token distribution, unrestricted and with top-p 0.65 (keeps 0.4 and 0.3): each
    # count within 4 standard deviations of its binomial mean.
    n = 2000
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    race = torch.empty(n, 4).exponential_(generator=torch.Generator().manual_seed(6))
    for top_p, expected in ((1.0, probs), (0.65, torch.tensor([0.0, 0.0, 3 / 7, 4 / 7]))):
        ids = reference.sample_filtered(
            probs.log().repeat(n, 1),
            torch.ones(n),
            torch.zeros(n, dtype=torch.int64),
            torch.full((n,), top_p),
            race,
        )
        counts = torch.bincount(ids, minlength=4).float()
        sigma = (n * expected * (1 - expected)).sqrt()
        assert ((counts - n * expected).abs() <= 4 * sigma + 1e-6).all(), (top_p, counts)


def test_draw_rows_runs_the_kernel_when_asked(monkeypatch):
    # The sampler's draw goes through the dispatch: the Triton op (here in the interpreter) and the
    # reference draw the same tokens from the same generators.
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(8)) * 2
    params = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(top_p=0.9), SamplingParams(top_k=5)]

    def draw(backend):
        monkeypatch.setenv("ENCLAVE_KERNELS", backend)
        reset_engine_env()  # the engine reads its variables once
        generators = [torch.Generator().manual_seed(10 + i) for i in range(3)]
        return draw_rows(logits.to(DEVICE), params, generators).tolist()

    assert draw("triton") == draw("torch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_real_vocabulary_bf16(batch):
    # Qwen3.5's 248,320-token vocabulary, bf16 logits (so values repeat: ties at the cuts are the rule),
    # the usual request settings plus wide top-k / top-p sets that take the kernel's longer paths.
    vocab = 248320
    settings = [
        (0.7, 20, 0.8),
        (1.0, 0, 0.95),
        (0.6, 20, 0.95),
        (1.0, 0, 1.0),
        (2.0, 50, 1.0),
        (1.0, 0, 0.5),
        (1.0, 1000, 0.9),
        (0.3, 5000, 1.0),
        (1.5, 0, 0.99),
        (1.0, 100000, 1.0),
    ]
    rows = [settings[i % len(settings)] for i in range(batch)]
    g = torch.Generator(device="cuda").manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=g, device="cuda") * 2.5).bfloat16()
    temperature, top_k, top_p = (torch.tensor(c, device="cuda") for c in zip(*rows, strict=True))
    race = torch.empty(batch, vocab, device="cuda").exponential_(generator=g)
    ids = sample_filtered(logits, temperature.float(), top_k, top_p.float(), race)
    expected = reference.sample_filtered(logits, temperature.float(), top_k, top_p.float(), race)
    # Without `clear_of_roundings` (too slow at this size) a row may hang on an fp32 rounding, with odds
    # around 1e-5 a row; allow one such row per 64.
    differ = (ids != expected).sum().item()
    assert differ <= batch // 64, f"{differ} of {batch} rows differ"
