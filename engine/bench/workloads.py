"""Workloads (a)-(f): single stream, batch decode, prefill, documents, long context and MTP verify (the
fourth through `Engine.submit`, with the peer-shaped (h)-(j), in `serving`; speculation end to end with
controlled acceptance, in (f) and `--speculative` (b), in `speculation`)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from engine.bench.constrained import constrained
from engine.bench.device import free
from engine.bench.harness import Bench, decode_point
from engine.bench.measure import guarded
from engine.bench.serving import documents, peer
from engine.bench.settings import WARMUP_STEPS, Sizes
from engine.bench.speculation import fit_costs, speculative_points
from engine.bench.traffic import prefill_bytes, roofline, step_bytes
from engine.cache import slot_bytes
from engine.runner import Drafter
from engine.sequence import Sequence
from engine.spec_cost import DeviceCosts, ModelBytes, StepCost


def single_stream(b: Bench) -> list[dict[str, Any]]:
    """(a) one prompt; decode tok/s over the timed steps, and the whole request end to end."""
    s = b.sizes

    def measure() -> dict[str, Any]:
        b.warm_up(s.single_prompt)
        point = decode_point(b, 1, s.single_prompt, max(1, s.single_new - 1 - WARMUP_STEPS))
        if point.get("decode_steps"):
            # WARMUP_STEPS decode steps ran untimed; count them at the timed steps' rate.
            total_s = point["prefill_s"] + point["decode_s"] * (1 + WARMUP_STEPS / point["decode_steps"])
            point["end_to_end_tokens_per_s"] = s.single_new / total_s
            point["note"] = (
                f"{point['ms_per_step']:.1f} ms/step; prefill {s.single_prompt} in "
                f"{point['prefill_s']:.2f} s; {s.single_new} tokens end to end "
                f"{point['end_to_end_tokens_per_s']:.1f} tok/s"
            )
        return point

    return [guarded(f"1 x {s.single_prompt}+{s.single_new}", measure)]


def batch_decode(b: Bench) -> list[dict[str, Any]]:
    """(b) decode at each batch size: time after prefill only."""
    s = b.sizes

    def measure(batch: int) -> dict[str, Any]:
        point = decode_point(b, batch, s.batch_prompt, s.batch_steps)
        if point.get("decode_steps"):
            point["note"] = f"{point['ms_per_step']:.1f} ms/step at context {point['mean_context']:.0f}"
        return point

    points = []
    for n in s.batches:
        points.append(guarded(f"batch {n}", lambda n=n: measure(n)))
        if b.settings.speculative:  # plain against speculative at each target AL, to the same tokens
            points += speculative_points(b, n, s.batch_prompt, s.speculative_new, f"batch {n} e2e")
    return points


def prefill(b: Bench) -> list[dict[str, Any]]:
    """(c) prompts only (one token each); tokens/s, and FLOP/s as % of the matrix rate."""
    s = b.sizes
    n, length = s.prefill_seqs, s.prefill_len

    def measure() -> dict[str, Any]:
        # The same prefill once untimed first: its steps (several sequences' chunks in one step) compile
        # Triton variants that a one-request warm-up does not, ~0.5 s inside a ~1 s measurement otherwise.
        warm = b.core(n, length + 8)
        b.prefill(warm, b.add(warm, n, length, 1, length + 8), b.deadline())
        del warm
        free(b.device)
        deadline = b.deadline()
        core = b.core(n, length + 8)
        seqs = b.add(core, n, length, 1, length + 8)
        spent, steps, done = b.prefill(core, seqs, deadline)
        tokens = core.prompt_tokens
        tokens_per_s = tokens / spent if spent else None
        # 2 FLOPs per multiply-add: every token through the dense and top-k expert weights, lm_head once per
        # prompt (attention's quadratic term and the delta rule are left out: a lower bound on the work).
        flops = 2 * tokens * b.counts.matmul_params() + 2 * n * b.counts.lm_head
        point = {
            "seqs": n,
            "prompt_len": length,
            "prefill_s": spent,
            "steps": steps,
            "prompt_tokens": tokens,
            "tokens_per_s": tokens_per_s,
            "flops": flops,
            "flop_per_s": flops / spent if spent else None,
            "pct_of_matmul_rate": 100.0 * flops / spent / b.matmul if spent else None,
            "capped": not done,
        }
        bytes_ = prefill_bytes(
            b.counts,
            b.config,
            b.dtype,
            seqs=n,
            prompt_len=length,
            chunk=b.settings.max_num_batched_tokens,
            kv_dtype=b.kv_dtype,
            state_dtype=b.state_dtype,
        )
        point |= roofline(bytes_, n * length, tokens_per_s, b.bandwidth)
        if spent:
            point["note"] = f"{point['pct_of_matmul_rate']:.1f}% of the matrix rate; {spent:.2f} s"
        return point

    return [guarded(f"{n} x {length}", measure)]


def long_positions(sizes: Sizes, prompt_len: int) -> int:
    """Positions (e) needs for a prompt of `prompt_len`: the prompt, its timed and untimed decode steps."""
    return prompt_len + sizes.long_steps + WARMUP_STEPS + 16


def long_prefill_flops(b: Bench, length: int, spent: float) -> dict[str, Any]:
    """A long prompt's FLOPs: (c)'s weights term plus causal attention's, which grows with the square of the
    length (QK^T and PV over the causal half: 2 x length^2 x head_dim per query head and full-attention
    layer) and outweighs the weights' past ~60k tokens on Qwen3.5/3.6; the delta rule's linear work is left
    out."""
    c = b.config
    attention = 2 * length**2 * c.num_attention_heads * c.head_dim * len(c.full_attention_layers)
    flops = 2 * length * b.counts.matmul_params() + 2 * b.counts.lm_head + attention
    return {
        "flops": flops,
        "attention_flops": attention,
        "flop_per_s": flops / spent if spent else None,
        "pct_of_matmul_rate": 100.0 * flops / spent / b.matmul if spent else None,
    }


MARKS = (131072, 262144, 524288)  # positions at which (e) reports a longer prompt's prefill time so far


def reached(trace: list[tuple[int, float]], length: int) -> dict[int, float]:
    """Seconds into a prefill at which it had computed each of MARKS' positions (those up to `length`). With
    lone chunks of a size dividing the mark (32,768 on CUDA), a longer prompt has done exactly a prompt of
    that length's work there: causal attention never looks ahead. Positions computed only (steps of which
    the last one crossed a mark are counted whole)."""
    marks: dict[int, float] = {}
    for mark in MARKS:
        if mark > length:
            break
        marks[mark] = next((t for computed, t in trace if computed >= mark), None)
        if marks[mark] is None:
            del marks[mark]
    return marks


def long_context(b: Bench) -> list[dict[str, Any]]:
    """(e) each very long prompt (--long-prompt, else one of `long_prompt`): its prefill, in lone chunks
    (`long_prefill_chunk`), then decode steps at that context, against the roofline with the KV read."""
    s = b.sizes
    points: list[dict[str, Any]] = []
    for wanted in s.long_prompts or (s.long_prompt,):
        length = min(wanted, b.config.max_model_len - long_positions(s, 0))
        points += _long_context(b, length, wanted)
        free(b.device)
    return points


def _long_context(b: Bench, length: int, wanted: int) -> list[dict[str, Any]]:
    s = b.sizes
    max_len = long_positions(s, length)
    chunk = b.step_tokens()
    state: dict[str, Any] = {}

    def measure_prefill() -> dict[str, Any]:
        b.warm_up(length)
        deadline = b.deadline()
        core = b.core(1, max_len)
        seqs = b.add(core, 1, length, s.long_steps + WARMUP_STEPS + 1, max_len)
        trace: list[tuple[int, float]] = []
        spent, steps, done = b.prefill(core, seqs, deadline, trace)
        state.update(core=core, seqs=seqs, done=done)
        tokens_per_s = core.prompt_tokens / spent if spent else None
        point = {"prompt_len": length, "prefill_s": spent, "steps": steps, "tokens_per_s": tokens_per_s}
        point["reached_s"] = reached(trace, length)
        point |= {"chunk": chunk, "capped": not done}
        point |= long_prefill_flops(b, length, spent)
        bytes_ = prefill_bytes(
            b.counts,
            b.config,
            b.dtype,
            seqs=1,
            prompt_len=length,
            chunk=chunk,
            kv_dtype=b.kv_dtype,
            state_dtype=b.state_dtype,
        )
        point["note"] = f"prefill {spent:.1f} s in {steps} steps" + ("" if done else " (time cap)")
        if spent:
            point["note"] += f"; {point['pct_of_matmul_rate']:.1f}% of the matrix rate"
        marks = [f"{mark // 1024}k in {t:.1f} s" for mark, t in point["reached_s"].items() if mark < length]
        if marks:
            point["note"] += f" ({', '.join(marks)})"
        if length < wanted:
            point["note"] += f"; {wanted} asked, the model's window is {b.config.max_model_len}"
        return point | roofline(bytes_, length, tokens_per_s, b.bandwidth)

    def measure_decode() -> dict[str, Any]:
        if not state.get("done"):
            return {"prompt_len": length, "skipped": "the prefill did not finish"}
        run = b.decode(state["core"], state["seqs"], s.long_steps, b.deadline())
        run["prompt_len"] = length
        if run["decode_steps"]:
            # The roofline counts the KV cache each step reads (20 KiB a position on Qwen3.5/3.6 in bf16).
            bytes_ = step_bytes(
                b.counts,
                b.config,
                b.dtype,
                seqs=1,
                context=run["mean_context"],
                kv_dtype=b.kv_dtype,
                state_dtype=b.state_dtype,
            )
            run |= roofline(bytes_, 1, run["tokens_per_s"], b.bandwidth)
            run["note"] = f"{run['ms_per_step']:.1f} ms/step at context {run['mean_context']:,.0f}"
        return run

    points = [guarded(f"prefill {length}", measure_prefill), guarded(f"decode at {length}", measure_decode)]
    state.clear()
    return points


def repeat_last_drafter(seq: Sequence, count: int) -> list[int]:
    """Drafts without the MTP head, so a step times the verify pass alone."""
    return [seq.token_ids[-1]] * count


def mtp_verify(b: Bench) -> list[dict[str, Any]]:
    """(f) batch-1 step time verifying k drafts (k+1 positions) against a plain decode step; then one
    request decoded end to end plainly and with speculation at each target mean accepted length."""
    s = b.sizes

    def measure(k: int, drafter: Drafter | None) -> dict[str, Any]:
        deadline = b.deadline()
        max_tokens = (k + 1) * (WARMUP_STEPS + s.verify_steps + 2)
        max_len = s.verify_prompt + max_tokens + 2 * k + 8
        # Synchronous like the verify steps (speculation needs the tokens at once): a step against a step.
        core = b.core(1, max_len, k, drafter, asynchronous=False)
        seqs = b.add(core, 1, s.verify_prompt, max_tokens, max_len)
        _, _, done = b.prefill(core, seqs, deadline)
        if not done:
            return {"k": k, "capped": True, "note": "time cap reached during prefill"}
        run = b.decode(core, seqs, s.verify_steps, deadline)
        accepted = seqs[0].metrics.accepted_lengths
        run |= {"k": k, "mean_accepted": statistics.fmean(accepted) if accepted else None}
        if run["decode_steps"]:
            bytes_ = step_bytes(
                b.counts,
                b.config,
                b.dtype,
                seqs=1,
                tokens_per_seq=k + 1,
                context=run["mean_context"],
                state_writes=k + 1,
                kv_dtype=b.kv_dtype,
                state_dtype=b.state_dtype,
            )
            run["step_bytes"] = bytes_.total
            tokens_per_step = run["decode_tokens"] / run["decode_steps"]
            run |= roofline(bytes_, tokens_per_step, run["tokens_per_s"], b.bandwidth)
        return run

    plain = guarded("plain decode step", lambda: measure(0, None))
    points = [plain]
    for k in (1, 2, 3):
        points.append(guarded(f"verify k={k}", lambda k=k: measure(k, repeat_last_drafter)))
        if b.model.mtp is not None:
            points.append(guarded(f"MTP step k={k}", lambda k=k: measure(k, None)))
    base_ms, base_bytes = plain.get("ms_per_step"), plain.get("step_bytes")
    for point in points:
        if point is plain or not point.get("ms_per_step") or not base_ms:
            continue
        point["ratio_vs_plain"] = point["ms_per_step"] / base_ms
        point["roofline_ratio"] = point["step_bytes"] / base_bytes
        point["note"] = (
            f"{point['ratio_vs_plain']:.2f}x a plain step ({point['ms_per_step']:.1f} vs {base_ms:.1f} ms); "
            f"bytes {point['roofline_ratio']:.2f}x"
        )
    if base_ms:
        plain["note"] = f"{base_ms:.1f} ms/step"
    by_label = {point["label"]: point for point in points}
    for k in (1, 2, 3):  # the MTP head's drafting alone: an MTP step less a verify step of the same k
        mtp, verify = by_label.get(f"MTP step k={k}", {}), by_label.get(f"verify k={k}", {})
        if mtp.get("ms_per_step") and verify.get("ms_per_step"):
            mtp["drafting_ms_per_step"] = mtp["ms_per_step"] - verify["ms_per_step"]
            mtp["note"] += f"; drafting {mtp['drafting_ms_per_step']:.2f} ms"
    if b.model.mtp is not None:  # the step-cost table's row these measurements give (engine/spec_costs.json)
        model_bytes = ModelBytes.of(b.model, b.dtype.itemsize, slot_bytes(b.config, b.dtype, b.state_dtype))
        row = fit_costs(points, StepCost(model_bytes, DeviceCosts(b.bandwidth)))
        if row is not None:
            note = ", ".join(f"{k} {row[k] * 1e3:.3f} ms" for k in ("step_s", "verify_s", "draft_s"))
            points.append({"label": "spec_costs.json row", "row": row, "note": note})
    return points + speculative_points(b, 1, s.verify_prompt, s.speculative_new, "e2e")


RUNNERS: dict[str, tuple[str, Callable[[Bench], list[dict[str, Any]]]]] = {
    "a": ("single stream", single_stream),
    "b": ("batch decode", batch_decode),
    "c": ("prefill", prefill),
    "d": ("documents", documents),
    "e": ("long context", long_context),
    "f": ("MTP verify vs plain step", mtp_verify),
    "h": ("vLLM's 1,024 in / 128 out at 512 concurrent", peer("h")),
    "i": ("vLLM's 32,000 in / 100 out", peer("i")),
    "j": ("vLLM's 1,000 in / 2,000 out at 200 concurrent", peer("j")),
    "k": ("constrained decoding: (b) with and without a mid-size JSON schema", constrained),
}
