"""Workload (k): what constrained decoding costs. Batch decode as (b) at batch 1 and each of (b)'s sizes, run
three times in the same process: plain; with every request held to a mid-size JSON schema (`SCHEMA`); and
replayed, each request forced through the tokens the held run wrote by a one-token mask per step that costs
the host next to nothing (`ReplayCompiler`). The overhead is the held run's step time over the replay's
(issue 16: at most 10% at 64 and 256 on an H200): the two decode the same tokens, so they read the same
experts, and differ only by the grammar's host work and how the step waits for it. The plain run decodes
other tokens: on random weights a schema's forced punctuation sends many sequences through the same tokens
and so the same experts, which made held steps 8-12% faster than plain ones at batch 64 on an H100
(docs/PERFORMANCE.md); the plain time is reported beside, not divided by.

The bench's models have no tokenizer (random weights, random prompt ids), and a grammar needs every token's
bytes. `synthetic_tokenizer` builds a byte-level BPE of the model's full vocabulary (248,320 for Qwen3.5):
the 256 byte symbols, every pair of printable ASCII characters and the space, then three-character tokens,
so a mask is computed over a vocabulary of the real size whose tokens cover JSON's characters. Its tokens
are shorter than a trained tokenizer's (at most 3 bytes), so llguidance's mask work per token differs from
Qwen's; the note says so. Under the schema greedy decoding of random weights writes a valid prefix of it.
Its last field, an array of at least MIN_NOTES free strings, keeps every sequence from finishing inside the
timed steps: a note and its separator take at least two of these tokens.

That field was a string of exactly 4,096 characters until 2026-12-05. llguidance's masks inside a
length-bounded string cost more than in a free one (on this project's CPU about 80-200 us against 10-30 over
248,320 tokens, and about 1.1 ms near the end of `code`'s 8 characters, where tokens that close the string
must be checked against what follows it); a 4,096-character string is no mid-size schema's field, while the
bounded `code` and `medications` strings stay. `benchmarks/grammar_fill.py` measures the fill per schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.bench.harness import Bench, decode_point
from engine.bench.measure import guarded
from engine.constraints import Constraint
from engine.grammar import FillStats, GrammarCompiler, GrammarState

# '!'..'~' (JSON's punctuation, digits and letters) and the space, as the byte-level alphabet writes it
PRINTABLE = [chr(c) for c in range(0x21, 0x7F)] + ["\u0120"]
MIN_NOTES = 256  # items of the schema's last field: at least 512 tokens, more than any timed run's output
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "patient_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "sex": {"enum": ["female", "male", "other", "unknown"]},
        "diagnoses": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "code": {"type": "string", "maxLength": 8},
                    "severity": {"enum": ["mild", "moderate", "severe"]},
                    "confirmed": {"type": "boolean"},
                },
                "required": ["code", "severity", "confirmed"],
            },
            "maxItems": 4,
        },
        "medications": {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 6},
        "vitals": {
            "type": "object",
            "properties": {
                "systolic": {"type": "integer"},
                "diastolic": {"type": "integer"},
                "temperature_c": {"type": "number"},
            },
            "required": ["systolic", "diastolic", "temperature_c"],
        },
        "notes": {"type": "array", "items": {"type": "string"}, "minItems": MIN_NOTES},
    },
    "required": ["patient_id", "age", "sex", "diagnoses", "medications", "vitals", "notes"],
}


def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly `vocab_size` tokens (at least 256), for masks of the model's
    size; its merges make each multi-character token from two shorter ones, as BPE requires."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from engine.tokenizer import Tokenizer

    if vocab_size < 256:
        raise ValueError("a byte-level vocabulary needs at least 256 tokens")
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    merges: list[tuple[str, str]] = []

    def add(left: str, right: str) -> bool:
        if len(vocab) >= vocab_size:
            return False
        vocab[left + right] = len(vocab)
        merges.append((left, right))
        return True

    pairs = [a + b for a in PRINTABLE for b in PRINTABLE]
    for pair in pairs:
        if not add(pair[0], pair[1]):
            break
    for pair in pairs:
        for c in PRINTABLE:
            if not add(pair, c):
                break
        if len(vocab) >= vocab_size:
            break
    if len(vocab) < vocab_size:
        raise ValueError(f"the synthetic vocabulary stops at {len(vocab)} tokens")
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend)


@dataclass
class RecordingState(GrammarState):
    """A real matcher that also keeps the tokens it accepted, for the replay."""

    tokens: list[int] = field(default_factory=list)

    def accept(self, token: int) -> bool:
        ok = super().accept(token)
        if ok:
            self.tokens.append(token)
        return ok

    def rollback(self, count: int) -> None:
        super().rollback(count)
        if count:
            del self.tokens[-count:]


class ReplayMatcher:
    """Allows exactly the next token of a recorded run (every token once the record ends); never stops."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.at = 0
        self.mismatches = 0  # tokens taken that the record does not hold there (0 when the replay is exact)

    def try_consume_tokens(self, tokens: list[int]) -> int:
        expected = self.tokens[self.at : self.at + len(tokens)]
        self.mismatches += sum(a != b for a, b in zip(tokens, expected, strict=False))
        self.at += len(tokens)
        return len(tokens)

    def rollback(self, count: int) -> None:
        self.at -= count

    def is_stopped(self) -> bool:
        return False

    def next_token(self) -> int | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None


class ReplayCompiler:
    """Fills one-token masks for `ReplayMatcher`s with two indexed writes per step, whatever the batch."""

    def __init__(self, stop_ids: list[int]) -> None:
        self.stop_ids = sorted(stop_ids)
        self.fill_stats = FillStats()

    def state(self, tokens: list[int]) -> GrammarState:
        return GrammarState(ReplayMatcher(tokens), self)  # type: ignore[arg-type]

    def fill(self, states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]) -> None:
        forced = [(row, s.matcher.next_token()) for s, row in zip(states, rows, strict=True)]
        free = [row for row, token in forced if token is None]
        forced = [(row, token) for row, token in forced if token is not None]
        if free:
            bitmask[free] = -1
        if forced:
            at = torch.tensor([row for row, _ in forced])
            tokens = torch.tensor([token for _, token in forced])
            bitmask[at] = 0
            # bit t % 32 of word t // 32, as an int32 (bit 31 is the sign bit)
            bits = torch.bitwise_left_shift(torch.ones_like(tokens), tokens % 32)
            bitmask[at, tokens // 32] = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)


def constrained(b: Bench) -> list[dict[str, Any]]:
    """(k) decode steps with and without the schema, at batch 1 and (b)'s sizes."""
    s = b.sizes
    steps = min(s.batch_steps, MIN_NOTES)
    state: dict[str, Any] = {}

    def compiler() -> GrammarCompiler:
        if "compiler" not in state:
            tokenizer = synthetic_tokenizer(b.config.vocab_size)
            pool = {"pool": b.settings.fill_pool} if b.settings.fill_pool else {}
            threads = {"threads": b.settings.fill_threads} if b.settings.fill_threads else {}
            eos = list(b.config.eos_token_ids)
            state["compiler"] = GrammarCompiler(tokenizer, b.config.vocab_size, eos, **pool, **threads)
        return state["compiler"]

    def measure(batch: int) -> dict[str, Any]:
        plain = decode_point(b, batch, s.batch_prompt, steps)
        fills = FillStats()  # the host's mask fills over the held run
        compiler().fill_stats = fills
        recorded: list[RecordingState] = []

        def grammar() -> GrammarState:
            real = compiler().state(Constraint.json_schema(SCHEMA))
            recorded.append(RecordingState(real.matcher, real.compiler, real.group))
            return recorded[-1]

        held = decode_point(b, batch, s.batch_prompt, steps, grammar=grammar)
        replayer = ReplayCompiler(list(b.config.eos_token_ids))
        tokens = iter([r.tokens for r in recorded])  # the same prompts, in the same order
        replayed: list[GrammarState] = []

        def replay_state() -> GrammarState:
            replayed.append(replayer.state(next(tokens)))
            return replayed[-1]

        replay = decode_point(b, batch, s.batch_prompt, steps, grammar=replay_state)
        # Tokens the replay took off its record (it should take none: the comparison needs the same tokens)
        replay["mismatches"] = sum(r.matcher.mismatches for r in replayed)
        point = {"batch": batch, "plain": plain, "constrained": held, "replay": replay}
        if fills.calls:  # prefill steps' fills included
            point["fill"] = {
                "calls": fills.calls,
                "mean_rows": fills.rows / fills.calls,
                "mean_ms": 1e3 * fills.seconds / fills.calls,
                "max_ms": 1e3 * fills.max_seconds,
                "threads": compiler().threads,
                "pool": compiler().pool,
            }
        if replay.get("ms_per_step") and held.get("ms_per_step"):
            fill = point.get("fill")
            fill_text = ""
            if fill:
                fill_text = f"; mask fill {fill['mean_ms']:.2f} ms mean, {fill['max_ms']:.1f} max"
                fill_text += f" on {fill['threads']} threads ({fill['pool']})"
            host = held.get("host_ms_per_step")
            if host:  # where the held run's host time goes: a host-bound step is their sum
                fill_text += "; host " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()) + " ms/step"
            overhead = held["ms_per_step"] / replay["ms_per_step"] - 1
            plain_ms = plain.get("ms_per_step")
            plain_text = f"; plain (other tokens) {plain_ms:.1f}" if plain_ms else ""
            point |= {
                "ms_per_step": held["ms_per_step"],
                "tokens_per_s": held["tokens_per_s"],
                "replay_ms_per_step": replay["ms_per_step"],
                "plain_ms_per_step": plain_ms,
                "overhead": overhead,
                "note": (
                    f"{held['ms_per_step']:.1f} ms/step against {replay['ms_per_step']:.1f} replayed: "
                    f"{100 * overhead:+.1f}%{plain_text}{fill_text}"
                    f" (synthetic {b.config.vocab_size:,}-token byte-level vocabulary)"
                ),
            }
        return point

    return [guarded(f"batch {n}", lambda n=n: measure(n)) for n in sorted({1, *s.batches})]
