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
    # q, k [T, Hk, dk]; v [T, Hv, dv]; g, beta [T, Hv]; state [S, Hv, dk, dv] (fp32), updated in place.
    ratio = v.shape[1] // q.shape[1]
    scale = q.shape[-1] ** -0.5
    # Value head j reads key head j // ratio.
    qf = (l2norm(q.float()) * scale).repeat_interleave(ratio, dim=1)
    kf = l2norm(k.float()).repeat_interleave(ratio, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    if layout.is_decode:
        slots = layout.slot_tensor(q.device)
        has_state = (layout.context_tensor(q.device) > 0)[:, None, None, None]
        s = torch.where(has_state, state[slots].float(), 0.0)  # a fresh slot may hold garbage
        o, s = recurrent_step(qf, kf, vf, gf, bf, s)
        state[slots] = s.to(state.dtype)
        return o.to(v.dtype)
    out = torch.empty_like(v)
    for i, (start, slot, ctx) in enumerate(
        zip(layout.cu_seqlens, layout.slots, layout.context_lens, strict=False)
    ):
        sl = slice(start, start + layout.query_lens[i])
        s0 = state[slot].float() if ctx > 0 else vf.new_zeros(state.shape[1:])
        o, s = chunked(qf[sl], kf[sl], vf[sl], gf[sl], bf[sl], s0)
        out[sl] = o.to(v.dtype)
        state[slot] = s.to(state.dtype)
    return out


def recurrent_step(q, k, v, g, beta, s):
    """One token for a batch of sequences: q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H]; s [B, H, dk, dv]."""
    s = s * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, s)
    delta = (v - predicted) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
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
