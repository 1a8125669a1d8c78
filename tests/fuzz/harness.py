"""Shared pieces of the parser fuzz suite: the bounded hypothesis profile, strategies that plant a marker in
every string, the check that a failure is clean, and the count of inputs fed.

A clean failure is one of our error types, with a message of one line, at most 300 characters, holding no
part of the input (the marker is planted in every string and key the strategies make).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from jobs.base import DocumentError
from jobs.bounded_json import JSONInputError
from jobs.openai_batch import BatchFileError
from jobs.params import JobParamError
from pipeline.audit_heads import HeadError
from pipeline.envelope import EnvelopeError, ManifestError

MARKER = "QZXV7MARK"
CLEAN_ERRORS = (
    *(BatchFileError, DocumentError, EnvelopeError, JobParamError, JSONInputError, ManifestError),
    HeadError,
)
MAX_MESSAGE = 300

FED: Counter[str] = Counter()  # inputs fed, per fuzz test (checked by test_zz_total)
DESELECTED = 0  # fuzz tests left out of this run (-k, -m): then the total is not checked
RAN: set[str] = set()  # node ids of the fuzz tests run in this process (pytest-xdist runs some elsewhere)


def profile(examples: int) -> settings:
    """Bounded and reproducible: the same inputs on every run, no example database, no deadline."""
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def fed(name: str, count: int = 1) -> None:
    FED[name] += count


def check_message(message: str) -> None:
    """One line, short, and no part of the input."""
    assert message, "an empty error message"
    assert "\n" not in message and "\r" not in message, f"a message of several lines: {message!r}"
    assert len(message) <= MAX_MESSAGE, f"a message of {len(message)} characters"
    assert MARKER not in message, f"the message quotes the input: {message!r}"


def clean(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call(*args)`: its value, or the clean error it raised (any other exception fails the test)."""
    try:
        return call(*args, **kwargs)
    except CLEAN_ERRORS as exc:
        check_message(str(exc))
        return exc


def sealable(value: Any) -> None:
    """What the worker seals must encode as UTF-8 JSON."""
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")


# Strings carry the marker, often with odd characters: quotes, brackets, newlines, lone surrogates.
_odd = st.text(alphabet=st.sampled_from('"\\[]{}:,\n\t\r\x00 é\ud800\U0001f600'), max_size=6)
marked = st.builds(lambda a, b: a + MARKER + b, st.text(max_size=6) | _odd, st.text(max_size=6) | _odd)
numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**64, 2**63, -(2**63) - 1, 10**400, 0, 1, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, marked)
json_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(marked, inner, max_size=4),
    max_leaves=6,
)


def dumps(value: Any) -> str:
    """JSON text as a careless producer would write it: NaN, Infinity and lone surrogates included."""
    return json.dumps(value, allow_nan=True, ensure_ascii=False)


def deep(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + closer * depth


def mutate(data: bytes, rnd: random.Random) -> bytes:
    """One cheap variant of `data`: cut, spliced with bytes, a byte changed, wrapped in deep brackets, or
    raw bytes with the marker. Variants multiply the inputs each generated example feeds."""
    how = rnd.choice(["cut", "splice", "byte", "deep", "bytes"])
    at = rnd.randint(0, len(data))
    if how == "cut":
        return data[:at]
    if how == "splice":
        return data[:at] + rnd.randbytes(rnd.randint(1, 8)) + data[at:]
    if how == "byte" and data:
        at = min(at, len(data) - 1)
        return data[:at] + bytes([rnd.choice(b'"[]{}:,\\\x00\xff0e-')]) + data[at + 1 :]
    if how == "deep":
        depth = rnd.choice([63, 64, 65, 1000])  # 100,000 deep: the explicit seeds
        return b"[" * depth + data + b"]" * depth
    return rnd.randbytes(rnd.randint(0, 32)) + MARKER.encode()


def variants(data: bytes, rnd: random.Random, count: int) -> list[bytes]:
    """`data` itself, then `count - 1` mutations of it."""
    return [data] + [mutate(data, rnd) for _ in range(count - 1)]
