"""Plain-torch grammar mask: logits of tokens a row's bitmask refuses set to -inf."""

import torch

ROW_CHUNK = 32  # rows unpacked at once: bounds the temporary [rows, V] byte tensor


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    # logits [R, V]; bitmask [>= R, W] int32, bit t % 32 of word t // 32 is token t (little-endian bytes,
    # so byte t // 8 holds it at bit t % 8); rows [n] int64: the rows to mask, each by its own bitmask row.
    vocab = logits.shape[-1]
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    for start in range(0, rows.shape[0], ROW_CHUNK):
        index = rows[start : start + ROW_CHUNK]
        data = bitmask[index].contiguous().view(torch.uint8)  # [r, 4W]
        allowed = ((data.unsqueeze(-1) >> shifts) & 1).reshape(index.shape[0], -1)[:, :vocab]  # [r, V] 0/1
        logits[index] = logits[index].masked_fill(allowed == 0, float("-inf"))
