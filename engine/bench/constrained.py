"""Workload (k): what constrained decoding costs. Batch decode as (b) at batch 1 and each of (b)'s sizes, run
twice in the same process, plain and with every request held to a mid-size JSON schema (`SCHEMA`), and the
ratio of the two step times (issue 16: at most 10% at 64 and 256 on an H200).

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

from typing import Any

from engine.bench.harness import Bench, decode_point
from engine.bench.measure import guarded
from engine.constraints import Constraint
from engine.grammar import FillStats, GrammarCompiler

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


def constrained(b: Bench) -> list[dict[str, Any]]:
    """(k) decode steps with and without the schema, at batch 1 and (b)'s sizes."""
    s = b.sizes
    steps = min(s.batch_steps, MIN_NOTES)
    state: dict[str, Any] = {}

    def compiler() -> GrammarCompiler:
        if "compiler" not in state:
            tokenizer = synthetic_tokenizer(b.config.vocab_size)
            state["compiler"] = GrammarCompiler(tokenizer, b.config.vocab_size, list(b.config.eos_token_ids))
        return state["compiler"]

    def grammar():
        return compiler().state(Constraint.json_schema(SCHEMA))

    def measure(batch: int) -> dict[str, Any]:
        plain = decode_point(b, batch, s.batch_prompt, steps)
        fills = FillStats()  # the host's mask fills over the held run
        compiler().fill_stats = fills
        held = decode_point(b, batch, s.batch_prompt, steps, grammar=grammar)
        point = {"batch": batch, "plain": plain, "constrained": held}
        if fills.calls:  # prefill steps' fills included
            point["fill"] = {
                "calls": fills.calls,
                "mean_rows": fills.rows / fills.calls,
                "mean_ms": 1e3 * fills.seconds / fills.calls,
                "max_ms": 1e3 * fills.max_seconds,
                "threads": compiler().threads,
            }
        if plain.get("ms_per_step") and held.get("ms_per_step"):
            fill = point.get("fill")
            fill_text = ""
            if fill:
                fill_text = f"; mask fill {fill['mean_ms']:.2f} ms mean, {fill['max_ms']:.1f} max"
                fill_text += f" on {fill['threads']} threads"
            overhead = held["ms_per_step"] / plain["ms_per_step"] - 1
            point |= {
                "ms_per_step": held["ms_per_step"],
                "tokens_per_s": held["tokens_per_s"],
                "plain_ms_per_step": plain["ms_per_step"],
                "overhead": overhead,
                "note": (
                    f"{held['ms_per_step']:.1f} ms/step against {plain['ms_per_step']:.1f} plain: "
                    f"{100 * overhead:+.1f}%{fill_text}"
                    f" (synthetic {b.config.vocab_size:,}-token byte-level vocabulary)"
                ),
            }
        return point

    return [guarded(f"batch {n}", lambda n=n: measure(n)) for n in sorted({1, *s.batches})]
