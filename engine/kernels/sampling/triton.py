"""Triton sampling (temperature, top-k, top-p, exponential race) with no sort of the vocabulary.

One program per row; it reads the row in CHUNK-token tiles. The kept tokens are a prefix of the row in the
reference's order (logit descending, then index), so the work is to find where that prefix ends, the cut:

  1. pass: the row's max m and min, and each tile's max (so later passes skip tiles they need not read);
  2. pass (rows with top-k or top-p): Z = sum exp((l - m) / T) and a histogram of m - l in NB bins over the
     span where the cut can lie;
  3. scans: the exact count N(v) = #{l >= v} and mass M(v) = sum exp((l - m) / T) over l >= v at NPIV
     pivots narrow a bracket lo <= cut < hi, and a scan gathers the indices of the band [lo, hi) into a
     scratch row once it holds at most CAP tokens. The first scan takes its pivots from the histogram and
     gathers the band it predicts, which settles the cut in that one scan unless the prediction is off;
     later ones split the bracket evenly in value, then in fp32's order-preserving integer image (which
     ends: 32 bits, 3 per scan);
  4. the band is sorted in registers (logit descending, index ascending) and the cut found on it exactly:
     top-k at the k-th value (ties stay), top-p at the first token whose running mass reaches top_p * (the
     mass top-k kept);
  5. the race, argmax of p / E over the kept tokens: in registers when they all lie in the band (top-k sets,
     top-p sets of up to CAP tokens), else one more pass (E read only where kept).

Top-k is found first (by count); a band that holds all of top-k's set also settles top-p, otherwise top-p
runs its own scans over the tokens >= the k-th value. So a row reads its logits 2 times plus 1 scan (which
skips the tiles below the band: most of them for a peaked row) plus the race pass when its kept set is
large; 2 times for a row with no limit (the max, then the race).

Exactness, against `reference.sample_filtered`: the order, the top-k cut and the ties are the reference's
(its sort is stable, and a top-p cut inside a group of equal logits keeps the lowest indices, here as
there). Masses are fp32 sums in another order, so a top-p cut whose running mass is within ~1e-6 (relative)
of top_p may move by one token. The race compares exp(l / T - m / T) / E computed to ~2 ulp, where torch's
softmax rounds otherwise: two candidates within ~1e-6 of each other may swap. Ties are judged on the logits
(fp32 logits that only the division by T makes equal are distinct here). T must be > 0; NaN logits and
rows of -inf are undefined.
"""

import torch
import triton
import triton.language as tl

CHUNK = 4096  # tile of a row read per step (and skipped or not by its max)
SUB = 1024  # slice of a tile that a scan counts above the pivots at once
CAP = 4096  # the most tokens sorted in registers
SMALL = 256  # a band this short takes a shorter sort
BINS = 1024  # histogram bins
PIVOTS = 8  # pivots counted per scan
LOG2E = tl.constexpr(1.4426950408889634)
LOG2E_LO = tl.constexpr(1.925963001e-08)  # log2(e) - fp32(log2(e))
LN2 = tl.constexpr(0.6931471805599453)
TINY = tl.constexpr(1e-30)  # smallest top-p target mass (top_p * Z can underflow)
INT_MAX = tl.constexpr(0x7FFFFFFF)
MAX_STEPS = tl.constexpr(64)  # a guard against a bug turning into a hang: rows take at most ~35 scans


@triton.jit
def _exp(d):
    # exp(d) for the race to ~2 ulp (the hardware ex2 of a rounded d * log2(e) is off by ~|d| ulp): the
    # product's rounding error, and log2(e)'s beyond fp32, go back in as a first-order correction.
    p = d * LOG2E
    err = tl.fma(d, LOG2E, -p) + d * LOG2E_LO
    return tl.exp2(p) * (1.0 + tl.where(d > float("-inf"), err, 0.0) * LN2)


@triton.jit
def _key(v):
    # fp32 -> int32 in the same order (-0 below +0, so callers add 0.0 first)
    b = v.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unkey(k):
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)


@triton.jit
def _load(row, offs, V):
    # [N] logits as fp32, -inf past the end
    return tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)


@triton.jit
def _max_min(row, tile_max, V, CHUNK: tl.constexpr):
    """The row's max and min; each tile's max into tile_max, so that later passes skip tiles unread. The
    next tile's load is issued before this one is reduced (a row is one program's: hide the latency)."""
    o = tl.arange(0, CHUNK)
    hi = tl.full([CHUNK], float("-inf"), tl.float32)
    lo = tl.full([CHUNK], float("inf"), tl.float32)
    l = _load(row, o, V)
    for start in range(0, V, CHUNK):
        next_l = _load(row, start + CHUNK + o, V)
        tl.store(tile_max + start // CHUNK, tl.max(l, 0))
        hi = tl.maximum(hi, l)
        lo = tl.minimum(lo, tl.where(start + o < V, l, float("inf")))
        l = next_l
    tl.debug_barrier()  # the tile maxima, before other threads read them
    return tl.max(hi, 0), tl.min(lo, 0)


@triton.jit
def _mass_histogram(row, tile_max, V, m, scale2, span, inv_width, CHUNK: tl.constexpr, NB: tl.constexpr):
    # Z = sum exp2((l - m) * scale2) over the row; counts of bin floor((m - l) / width) for m - l < span.
    o = tl.arange(0, CHUNK)
    z = tl.zeros([CHUNK], tl.float32)
    hist = tl.zeros([NB], tl.int32)
    l = _load(row, o, V)
    for start in range(0, V, CHUNK):
        next_l = _load(row, start + CHUNK + o, V)  # in flight during this tile's histogram
        z += tl.exp2((l - m) * scale2)
        if tl.load(tile_max + start // CHUNK) > m - span:
            d = m - l  # >= 0; inf past the end
            hist += tl.histogram(tl.minimum(d * inv_width, NB - 1).to(tl.int32), NB, mask=d < span)
        l = next_l
    return tl.sum(z, 0), hist


@triton.jit
def _guess(
    hist, m, width, scale2, target, by_mass, lo, NB: tl.constexpr, NPIV: tl.constexpr, CAP: tl.constexpr
):
    """The first scan's pivots and gather [g_lo, g_hi), from the histogram. Bin b holds about
    m - (b + 1) * width <= l < m - b * width, so the count (top-k) or the mass (top-p: bounded by each bin's
    edges) of the bins <= b reaches the target in one of the bins b_a..b_b (one bin for counts). NPIV - 2
    pivots are bin edges from b_b's lower edge up past b_a; the gather takes every token from b_b's lower
    edge up when the histogram says they fit in CAP, else up to CAP tokens of bins around b_m, where an
    estimate of the mass (the mean of exp over each bin) reaches the target, bounded by the other two
    pivots."""
    b = tl.arange(0, NB)
    count = tl.cumsum(hist, 0)  # tokens in bins <= b
    before = count - hist  # tokens in bins < b
    w2 = width * scale2  # a bin's width in log2 units of mass
    upper = tl.cumsum(hist.to(tl.float32) * tl.exp2(-b.to(tl.float32) * w2), 0)
    mean = upper * ((1.0 - tl.exp2(-w2)) / tl.maximum(w2 * LN2, 1e-30))
    n = count.to(tl.float32)
    b_a = _first(tl.where(by_mass, upper, n) >= target, NB)
    b_b = _first(tl.where(by_mass, upper * tl.exp2(-w2), n) >= tl.where(by_mass, target * 1.0001, target), NB)
    b_m = _first(tl.where(by_mass, mean, n) >= target, NB)
    half = CAP // 2  # tokens on each side of b_m
    b_1 = tl.min(tl.where((b <= b_m) & (b >= b_a) & (_pick(count, b_m, NB) - before <= half), b, b_m), 0)
    b_2 = tl.max(tl.where((b >= b_m) & (b <= b_b) & (count - _pick(before, b_m, NB) <= half), b, b_m), 0)
    j = tl.arange(0, NPIV)
    stride = tl.maximum((b_b - b_a + NPIV - 3) // (NPIV - 3), 1)
    edge_bin = tl.where(j < NPIV - 2, b_b - j * stride, tl.where(j == NPIV - 2, b_2, b_1 - 1))
    piv = m - (edge_bin + 1).to(tl.float32) * width  # pivot j is the lower edge of bin edge_bin
    fits_all = _pick(count, b_b, NB) <= CAP
    fits_band = _pick(count, b_2, NB) - _pick(before, b_1, NB) <= CAP
    g_lo = tl.where(fits_all, _pick(piv, 0, NPIV), _pick(piv, NPIV - 2, NPIV))
    g_lo = tl.where(fits_all | fits_band, tl.maximum(g_lo, lo), float("inf"))
    g_hi = tl.where(fits_all, float("inf"), _pick(piv, NPIV - 1, NPIV))
    return piv, g_lo, g_hi


@triton.jit
def _first(hit, NB: tl.constexpr):
    # the first bin where hit holds (the last bin when none does)
    return tl.min(tl.where(hit, tl.arange(0, NB), NB - 1), 0)


@triton.jit
def _pick(values, i, N: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, N) == i, values, 0), 0)


@triton.jit
def _at(piv, values, v, NPIV: tl.constexpr):
    # values at the first pivot equal to v
    j = tl.arange(0, NPIV)
    return tl.sum(tl.where(j == tl.min(tl.where(piv == v, j, NPIV), 0), values, 0), 0)


@triton.jit
def _scan(
    row,
    tile_max,
    scratch,
    V,
    m,
    scale2,
    piv,
    g_lo,
    g_hi,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    NPIV: tl.constexpr,
    CAP: tl.constexpr,
):
    """N(v), M(v) at the pivots piv [NPIV]; the indices of g_lo <= l < g_hi into scratch (the first CAP,
    in index order) and how many there are. Tiles below the pivots and g_lo are skipped unread; the others
    go by SUB-token slices, summed per lane (one reduction at the end)."""
    o = tl.arange(0, SUB)
    count = tl.zeros([SUB, NPIV], tl.int32)
    mass = tl.zeros([SUB, NPIV], tl.float32)
    n_band = 0
    floor = tl.minimum(tl.min(piv, 0), g_lo)
    for start in range(0, V, CHUNK):
        peak = tl.load(tile_max + start // CHUNK)
        if peak >= g_lo:  # the band may lie here
            for u in tl.static_range(CHUNK // SUB):
                offs = start + u * SUB + o
                l = _load(row, offs, V)
                count, mass = _above(l, piv, m, scale2, count, mass)
                band = (offs < V) & (l >= g_lo) & (l < g_hi)
                slot = n_band + tl.cumsum(band.to(tl.int32), 0) - 1
                tl.store(scratch + slot, offs, mask=band & (slot < CAP))
                n_band += tl.sum(band.to(tl.int32), 0)
        elif peak >= floor:
            for u in tl.static_range(CHUNK // SUB):
                count, mass = _above(_load(row, start + u * SUB + o, V), piv, m, scale2, count, mass)
    return tl.sum(count, 0), tl.sum(mass, 0), n_band


@triton.jit
def _above(l, piv, m, scale2, count, mass):
    # count [SUB, NPIV] and mass [SUB, NPIV] plus the slice l [SUB]'s tokens >= each pivot
    above = l[:, None] >= piv[None, :]
    e = tl.exp2((l - m) * scale2)
    return count + above.to(tl.int32), mass + tl.where(above, e[:, None], 0.0)


@triton.jit
def _resolve(
    row,
    race_row,
    scratch,
    n_band,
    n_hi,
    m_hi,
    open_top,
    phase,
    k,
    p,
    use_p,
    target,
    m,
    T,
    SIZE: tl.constexpr,
):
    """The cut, on the band gathered in scratch: n_band <= SIZE tokens, below n_hi tokens of mass m_hi
    (none when open_top). Phase 0 finds top-k's k-th value, and top-p's cut too when the band holds all of
    top-k's set; phase 1 finds top-p's cut (target mass). Returns the last kept value t, how many tokens
    equal to t are kept (q, lowest indices first) and exist (g), the count and mass of l >= t, whether
    top-p is settled, and the race's winner when every kept token is in the band (else -1)."""
    o = tl.arange(0, SIZE)
    valid = o < n_band
    idx = tl.load(scratch + o, mask=valid, other=0)
    l = tl.load(row + idx, mask=valid, other=float("-inf")).to(tl.float32) + 0.0  # -0 -> +0
    packed = (_key(l).to(tl.int64) << 32) | (idx ^ INT_MAX).to(tl.int64)
    packed = tl.sort(tl.where(valid, packed, -INT_MAX - 1 << 32), descending=True)
    l = _unkey((packed >> 32).to(tl.int32))
    idx = (packed & INT_MAX).to(tl.int32) ^ INT_MAX
    x = tl.math.div_rn(l, T)  # as the reference: exp(l / T - m / T)
    x_max = tl.max(tl.math.div_rn(tl.zeros_like(l) + m, T), 0)
    e = tl.where(valid, _exp(x - x_max), 0.0)
    # top-k: the band's (k - n_hi)-th value is the row's k-th; its ties stay.
    t_k = tl.sum(tl.where(o == k - n_hi - 1, l, 0.0), 0)
    keep = valid & (l >= tl.where(phase == 1, float("-inf"), t_k))  # a prefix
    n_ge = n_hi + tl.sum(keep.to(tl.int32), 0)
    m_ge = m_hi + tl.sum(tl.where(keep, e, 0.0), 0)
    # top-p: keep up to the first token whose running mass (from the top of the row) reaches the target.
    do_p = (phase == 1) | (use_p & open_top)
    need = tl.where(phase == 0, tl.maximum(p * m_ge, TINY), target)
    reach = m_hi + tl.cumsum(tl.where(keep, e, 0.0), 0)
    last = tl.sum(keep.to(tl.int32), 0) - 1
    cut = tl.minimum(tl.min(tl.where(keep & (reach >= need), o, SIZE), 0), last)
    keep = keep & (o <= tl.where(do_p, cut, SIZE))
    n_keep = tl.sum(keep.to(tl.int32), 0)
    t = tl.sum(tl.where(o == n_keep - 1, l, 0.0), 0)
    q = tl.sum((keep & (l == t)).to(tl.int32), 0)
    g = tl.sum((valid & (l == t)).to(tl.int32), 0)
    winner = tl.full([], -1, tl.int32)
    if open_top & (do_p | (use_p == 0)):
        big_e = tl.load(race_row + idx, mask=keep, other=1.0)
        s = tl.where(keep, tl.math.div_rn(e, big_e), -1.0)
        best = tl.max(s, 0)
        winner = tl.min(tl.where(keep & (s == best), idx, INT_MAX), 0)
    return t, q, g, n_ge, m_ge, do_p, winner


@triton.jit
def _race(row, race_row, tile_max, V, m, T, t, q, g, CHUNK: tl.constexpr):
    """argmax of p / E over the kept tokens: l > t, and the first q (by index) of the g equal to t. Tiles
    whose max is below t are not read; the next needed tile's logits load while this one races. Each lane
    keeps its best (its first on a tie); at the end the best, then the lowest index, as torch.argmax."""
    o = tl.arange(0, CHUNK)
    x_max = tl.max(tl.math.div_rn(tl.full([CHUNK], m, tl.float32), T), 0)
    ranked = q < g
    seen = 0
    best = tl.full([CHUNK], -1.0, tl.float32)
    arg = tl.zeros([CHUNK], tl.int32)
    need = tl.load(tile_max) >= t
    l = _load(row, o, tl.where(need, V, 0))
    for start in range(0, V, CHUNK):
        offs = start + o
        valid = offs < V
        next_need = tl.load(tile_max + start // CHUNK + 1, mask=start + CHUNK < V, other=float("-inf")) >= t
        next_offs = offs + CHUNK
        next_l = _load(row, next_offs, tl.where(next_need, V, 0))  # nothing read when not needed
        if need:
            keep = valid & (l >= t)
            if ranked:
                tie = valid & (l == t)
                keep = valid & ((l > t) | (tie & (seen + tl.cumsum(tie.to(tl.int32), 0) <= q)))
                seen += tl.sum(tie.to(tl.int32), 0)
            big_e = tl.load(race_row + offs, mask=keep, other=1.0)
            s = tl.where(keep, tl.math.div_rn(_exp(tl.math.div_rn(l, T) - x_max), big_e), -1.0)
            better = s > best
            best = tl.where(better, s, best)
            arg = tl.where(better, offs, arg)
        need = next_need
        l = next_l
    top = tl.max(best, 0)
    return tl.min(tl.where(best == top, arg, INT_MAX), 0)


@triton.jit
def _top(lo, hi, m):
    # the largest value a token in [lo, hi) can have (below +0 is -2^-149: -0 is the same value)
    below = _key(hi + 0.0) - 1
    below = tl.where(below == -1, -2, below)
    return tl.minimum(tl.where(hi == float("inf"), m, _unkey(below)), m)


@triton.jit
def _pivots(lo, hi, m, step, NPIV: tl.constexpr):
    """NPIV ascending pivots in (lo, top], top the largest value below hi (m when hi is +inf): evenly
    spaced in value for the first steps (dense rows), then in the integer image (which always ends)."""
    top = _top(lo, hi, m)
    j = tl.arange(0, NPIV)
    frac = (j + 1).to(tl.float32) / (NPIV + 1)
    floor = tl.maximum(lo, -3.0e38)  # no NaN from -inf where the values are not used
    by_value = floor + (top - floor) * frac
    k_lo = _key(lo + 0.0).to(tl.int64)
    span = _key(top + 0.0).to(tl.int64) - k_lo
    by_key = _unkey((k_lo + tl.maximum(span * (j + 1) // (NPIV + 1), 1)).to(tl.int32))
    use_value = (step < 4) & (lo > float("-inf")) & (by_value > lo) & (by_value <= top)
    return tl.where(use_value, by_value, by_key)


@triton.jit
def _sample_kernel(
    logits,  # [B, V], last dim contiguous
    race,  # [B, V] fp32, last dim contiguous
    temperature,  # [B] fp32
    top_k,  # [B] int32/int64
    top_p,  # [B] fp32
    out,  # [B] int64
    scratch,  # [B, CAP] int32
    tile_max,  # [B, cdiv(V, CHUNK)] fp32
    V,
    stride_lb,
    stride_rb,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    CAP: tl.constexpr,
    SMALL: tl.constexpr,
    NB: tl.constexpr,
    NPIV: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    row = logits + i_b * stride_lb
    race_row = race + i_b * stride_rb
    scratch_row = scratch + i_b * CAP
    tile_max_row = tile_max + i_b * tl.cdiv(V, CHUNK)
    T = tl.load(temperature + i_b)
    k_in = tl.load(top_k + i_b)
    p = tl.load(top_p + i_b)
    use_k = (k_in > 0) & (k_in < V)
    use_p = p < 1.0
    k = tl.where(use_k, k_in, V).to(tl.int32)
    m, l_min = _max_min(row, tile_max_row, V, CHUNK)
    t = tl.full([], float("-inf"), tl.float32)  # no limit: every token races
    q = tl.full([], 0, tl.int32)
    g = tl.full([], 0, tl.int32)
    winner = tl.full([], -1, tl.int32)
    if use_k | use_p:
        scale2 = LOG2E / T
        # The histogram's span below m: where the k-th value usually lies, or past which top-p surely cuts
        # (the tokens below m - T ln(V / (1 - p)) hold at most 1 - p of the mass).
        span_x = tl.where(
            use_k, tl.minimum(32.0, (m - l_min) / T), tl.log(V / tl.maximum(1.0 - p, 1e-30)) + 1.0
        )
        span = tl.maximum(span_x * T, 1e-30)
        z, hist = _mass_histogram(row, tile_max_row, V, m, scale2, span, NB / span, CHUNK, NB)
        width = span / NB
        # Phase 0 finds top-k's cut (by count), phase 1 top-p's (by mass), each in a bracket lo <= cut < hi
        # with the exact count and mass of the tokens >= lo and >= hi.
        phase = tl.where(use_k, 0, 1)
        target = tl.where(use_k, k.to(tl.float32), tl.maximum(p * z, TINY))
        lo = l_min
        n_lo = V
        m_lo = z
        hi = tl.full([], float("inf"), tl.float32)
        n_hi = tl.full([], 0, tl.int32)
        m_hi = tl.full([], 0.0, tl.float32)
        piv, g_lo, g_hi = _guess(hist, m, width, scale2, target, phase == 1, lo, NB, NPIV, CAP)
        step = 0  # scans in this phase
        steps = 0
        done = 0
        while (done == 0) & (steps < MAX_STEPS):
            count, mass, n_band = _scan(
                row, tile_max_row, scratch_row, V, m, scale2, piv, g_lo, g_hi, CHUNK, SUB, NPIV, CAP
            )
            # count and mass of the tokens >= g_hi, the top of the gather: the bracket's or a pivot
            n_top = tl.where(g_hi == hi, n_hi, _at(piv, count, g_hi, NPIV))
            m_top = tl.where(g_hi == hi, m_hi, _at(piv, mass, g_hi, NPIV))
            # Narrow the bracket with the pivots inside it.
            reach = tl.where(phase == 0, count.to(tl.float32), mass)
            inside = (piv > lo) & (piv < hi)
            j = tl.arange(0, NPIV)
            new_lo = tl.max(tl.where(inside & (reach >= target), piv, float("-inf")), 0)
            j_lo = tl.min(tl.where(inside & (piv == new_lo), j, NPIV), 0)
            if new_lo > lo:
                lo = new_lo
                n_lo = tl.sum(tl.where(j == j_lo, count, 0), 0)
                m_lo = tl.sum(tl.where(j == j_lo, mass, 0.0), 0)
            new_hi = tl.min(tl.where(inside & (reach < target), piv, float("inf")), 0)
            j_hi = tl.min(tl.where(inside & (piv == new_hi), j, NPIV), 0)
            if new_hi < hi:
                hi = new_hi
                n_hi = tl.sum(tl.where(j == j_hi, count, 0), 0)
                m_hi = tl.sum(tl.where(j == j_hi, mass, 0.0), 0)
            # The band gathered holds the cut (g_lo <= lo, hi <= g_hi) and all its tokens: settle on it.
            settle = (g_lo < float("inf")) & (n_band <= CAP) & (lo >= g_lo) & (hi <= g_hi)
            # A bracket of one value (a tie group of more than CAP tokens) settles without a sort.
            top = _top(lo, hi, m)
            single = (settle == 0) & (_key(lo + 0.0) >= _key(top + 0.0))
            t_ge = lo
            n_ge = n_lo
            m_ge = m_lo
            p_done = phase == 1
            if settle:
                tl.debug_barrier()  # the gather's stores, before other threads load them
                args = (row, race_row, scratch_row, n_band, n_top, m_top, g_hi == float("inf"), phase)
                if n_band <= SMALL:  # most rows: a short sort
                    t, q, g, n_ge, m_ge, p_done, winner = _resolve(*args, k, p, use_p, target, m, T, SMALL)
                else:
                    t, q, g, n_ge, m_ge, p_done, winner = _resolve(*args, k, p, use_p, target, m, T, CAP)
                t_ge = t
                tl.debug_barrier()  # every thread done with scratch before a next phase's scan rewrites it
            if single:
                t = lo
                g = n_lo - n_hi
                q = g
                if phase == 1:  # the ties kept: while the mass above them stays below the target
                    e_t = tl.exp2((lo - m) * scale2)
                    fit = tl.ceil(tl.minimum((target - m_hi) / e_t, g.to(tl.float32)))  # e_t may be 0
                    q = tl.maximum(fit, 1.0).to(tl.int32)
            if settle | single:
                if (phase == 0) & use_p & (p_done == 0):
                    # top-p on the tokens >= the k-th value: Z is their mass
                    phase = 1
                    target = tl.maximum(p * m_ge, TINY)
                    lo = t_ge
                    n_lo = n_ge
                    m_lo = m_ge
                    hi = tl.full([], float("inf"), tl.float32)
                    n_hi = tl.full([], 0, tl.int32)
                    m_hi = tl.full([], 0.0, tl.float32)
                    piv, g_lo, g_hi = _guess(hist, m, width, scale2, target, True, lo, NB, NPIV, CAP)
                    step = -1  # the new phase's first scan is its step 0
                else:
                    done = 1
            else:
                if n_lo - n_hi <= CAP:  # gather the band
                    piv = tl.full([NPIV], float("inf"), tl.float32)
                    g_lo = lo
                    g_hi = hi
                else:
                    piv = _pivots(lo, hi, m, step, NPIV)
                    g_lo = tl.full([], float("inf"), tl.float32)
            step += 1
            steps += 1
    if winner < 0:
        winner = _race(row, race_row, tile_max_row, V, m, T, t, q, g, CHUNK)
    tl.store(out + i_b, winner.to(tl.int64))


def sample_filtered(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    race: torch.Tensor,
    *,
    chunk: int = CHUNK,
    cap: int = CAP,
    bins: int = BINS,
    num_warps: int = 8,
) -> torch.Tensor:
    # ids [B] int64; chunk, cap and bins (powers of two) are for tests that want small tiles or bands,
    # num_warps for the benchmark.
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    race = race.float()
    race = race if race.stride(-1) == 1 else race.contiguous()
    chunk = max(16, min(chunk, triton.next_power_of_2(v)))
    cap = max(16, min(cap, triton.next_power_of_2(v)))
    scratch = torch.empty(b, cap, dtype=torch.int32, device=logits.device)
    tile_max = torch.empty(b, triton.cdiv(v, chunk), dtype=torch.float32, device=logits.device)
    _sample_kernel[(b,)](
        logits,
        race,
        temperature.float().contiguous(),
        top_k.contiguous(),
        top_p.float().contiguous(),
        out,
        scratch,
        tile_max,
        v,
        logits.stride(0),
        race.stride(0),
        CHUNK=chunk,
        SUB=min(SUB, chunk),
        CAP=cap,
        SMALL=min(SMALL, cap),
        NB=bins,
        NPIV=PIVOTS,
        num_warps=num_warps,
    )
    return out
