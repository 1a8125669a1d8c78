"""Plain-torch gated delta rule: a per-token recurrence and an equivalent chunked (WY) form.

Per value head, with state S [dk, dv], decay g (log space, <= 0), write strength beta and l2-normalised q, k:
    S <- exp(g) * S
    S <- S + k (beta * (v - S^T k))^T
    o  = S^T q / sqrt(dk)
"""

import torch

from engine.kernels.layout import SeqLayout

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    layout: SeqLayout,
) -> torch.Tensor:
    # q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [S, Hv, dk, dv], updated in place: fp32, or a
    # 16-bit dtype the recurrence rounds to after every token (the chunked form once, at the end).
    ratio = v.shape[1] // q.shape[1]
    scale = q.shape[-1] ** -0.5
    # Value head j reads key head j // ratio.
    qf = (l2norm(q.float()) * scale).repeat_interleave(ratio, dim=1)
    kf = l2norm(k.float()).repeat_interleave(ratio, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    if layout.short_seqs:
        _short(qf, kf, vf, gf, bf, state, layout, out)
    for i in layout.long_seqs:
        if layout.keeps_states(i):
            raise ValueError("per-position states are only kept for short (verify) steps")
        start, slot, ctx = layout.cu_seqlens[i], layout.slots[i], layout.context_lens[i]
        sl = slice(start, start + layout.query_lens[i])
        s0 = state[slot].float() if ctx > 0 else vf.new_zeros(state.shape[1:])
        o, s = chunked(qf[sl], kf[sl], vf[sl], gf[sl], bf[sl], s0)
        out[sl] = o.to(v.dtype)
        state[slot] = s.to(state.dtype)
    return out


def _short(q, k, v, g, beta, state, layout: SeqLayout, out: torch.Tensor) -> None:
    """Short sequences token by token, all at once: padded to B x n, a finished sequence's state is held."""
    seqs = layout.short_seqs
    dev = q.device
    n_max = max(layout.query_lens[i] for i in seqs)
    lens = torch.tensor([layout.query_lens[i] for i in seqs], device=dev)
    slots = torch.tensor([layout.slots[i] for i in seqs], device=dev)
    starts = torch.tensor([layout.cu_seqlens[i] for i in seqs], device=dev)
    has_state = torch.tensor([layout.context_lens[i] > 0 for i in seqs], device=dev)[:, None, None, None]
    s = torch.where(has_state, state[slots].float(), 0.0)  # a fresh slot may hold garbage
    keep = torch.tensor([layout.keeps_states(i) for i in seqs], device=dev)
    for j in range(n_max):
        live = j < lens  # [B]
        idx = torch.where(live, starts + j, starts)  # padding rows re-read a real token, then are dropped
        o, stepped = recurrent_step(q[idx], k[idx], v[idx], g[idx], beta[idx], s, state.dtype)
        s = torch.where(live[:, None, None, None], stepped, s)
        out[idx[live]] = o[live].to(out.dtype)
        if keep.any():
            write = live & keep
            targets = torch.tensor(
                [
                    layout.state_out[i][min(j, layout.query_lens[i] - 1)] if layout.keeps_states(i) else 0
                    for i in seqs
                ],
                device=dev,
            )
            state[targets[write]] = s[write].to(state.dtype)
    final = ~keep
    state[slots[final]] = s[final].to(state.dtype)


def recurrent_step(q, k, v, g, beta, s, stored: torch.dtype = torch.float32):
    """One token for a batch of sequences: q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H]; s [B, H, dk, dv]
    fp32, rounded to the `stored` dtype after the update (the state as a cache of that dtype holds it)."""
    s = s * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, s)
    delta = (v - predicted) * beta[..., None]
    s = (s + k[..., :, None] * delta[..., None, :]).to(stored).to(s.dtype)
    return torch.einsum("bhk,bhkv->bhv", q, s), s


def recurrent(q, k, v, g, beta, s0):
    """Token-by-token over one sequence: q, k [n, H, dk]; v [n, H, dv]; g, beta [n, H]; s0 [H, dk, dv]."""
    s = s0[None]
    outs = []
    for t in range(q.shape[0]):
        o, s = recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
        outs.append(o)
    return torch.cat(outs), s[0]


def chunked(q, k, v, g, beta, s0, chunk: int = CHUNK):
    """The same recurrence over one sequence, `chunk` tokens at a time with the WY representation.

    Inside a chunk with cumulative log decay c_i, the written values u_i solve the unit lower-triangular
    system (I + A) U = beta*V - (beta*exp(c)*K) S0, where A_ij = beta_i exp(c_i - c_j) k_i.k_j for j < i.
    """
    n, h, _dk = q.shape
    dv = v.shape[-1]
    pad = (-n) % chunk
    # [H, N, C, d] after padding: padded tokens have q = k = v = beta = 0 and g = 0, so they change nothing.
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))
    g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (g, beta))
    num_chunks = (n + pad) // chunk
    q, k, v = (x.reshape(h, num_chunks, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(h, num_chunks, chunk) for x in (g, beta))

    c = g.cumsum(-1)  # [H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    strict = lower.clone().fill_diagonal_(False)
    diff = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # [H, N, C, C]: exp(c_i - c_j) for j <= i, else 0
    kb = k * beta[..., None]
    a = (kb @ k.transpose(-1, -2) * decay).masked_fill(~strict, 0.0)
    system = a + torch.eye(chunk, dtype=q.dtype, device=q.device)
    w = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    kd = torch.linalg.solve_triangular(system, kb * c.exp()[..., None], upper=False, unitriangular=True)
    intra = q @ k.transpose(-1, -2) * decay  # [H, N, C, C]
    q_decayed = q * c.exp()[..., None]
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]
    chunk_decay = c[..., -1].exp()  # [H, N]

    s = s0
    out = q.new_empty(h, num_chunks, chunk, dv)
    for i in range(num_chunks):
        u = w[:, i] - kd[:, i] @ s  # [H, C, dv]
        out[:, i] = q_decayed[:, i] @ s + intra[:, i] @ u
        s = s * chunk_decay[:, i, None, None] + k_to_end[:, i].transpose(-1, -2) @ u
    out = out.reshape(h, num_chunks * chunk, dv)[:, :n].transpose(0, 1)
    return out, s
