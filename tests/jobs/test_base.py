import json
import subprocess
import sys

import pytest

from jobs import KINDS, make_kind
from jobs.base import Document, DocumentError, decode_text, ensure_fits
from jobs.params import JobParamError
from tests.jobs.factories import FakeModel

MINIMAL = {"chat": {}, "code-review": {}, "extract": {"fields": "name"}, "summarize": {}}


def test_decode_text_reports_the_first_bad_byte():
    assert decode_text(Document("a", "\ufeffhé".encode())) == "hé"
    with pytest.raises(DocumentError, match=r"^document is not valid UTF-8 \(first bad byte at offset 3\)$"):
        decode_text(Document("a", b"abc\xff\xfe"))


def test_ensure_fits_names_the_sizes():
    model = FakeModel(max_model_len=100)
    assert ensure_fits(model, "one two three", "three", 50) == 3
    with pytest.raises(DocumentError) as caught:
        ensure_fits(model, "w " * 90, "w " * 80, 20)
    assert str(caught.value) == (
        "document has 80 tokens; with the instructions and 20 output tokens it needs 110, "
        "the model's context is 100"
    )


def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(JobParamError) as caught:
        make_kind("translate", {})
    assert str(caught.value) == "unknown kind 'translate' (known: chat, code-review, extract, summarize)"


@pytest.mark.parametrize("name", sorted(KINDS))
def test_unknown_parameter_names_the_key_and_the_known_ones(name):
    with pytest.raises(JobParamError) as caught:
        make_kind(name, {**MINIMAL[name], "max_tokenz": "5"})
    message = str(caught.value)
    assert "'max_tokenz'" in message and "known: " in message and "max_tokens" in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["code-review", "extract", "summarize"])
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_tokens", "abc", "max_tokens must be an integer, got 'abc'"),
        ("max_tokens", "0", "max_tokens must be at least 1, got 0"),
        ("temperature", "-0.5", "temperature must be at least 0.0, got -0.5"),
        ("temperature", "hot", "temperature must be a number, got 'hot'"),
        ("top_p", "0", "top_p must be greater than 0.0, got 0.0"),
        ("top_p", "1.5", "top_p must be at most 1.0, got 1.5"),
        ("seed", "1.5", "seed must be an integer, got '1.5'"),
    ],
)
def test_bad_sampling_params_are_one_line_naming_the_param(name, key, value, message):
    with pytest.raises(JobParamError) as caught:
        make_kind(name, {**MINIMAL[name], key: value})
    assert str(caught.value) == message


@pytest.mark.parametrize("name", sorted(KINDS))
def test_normalised_params_are_json_and_round_trip(name):
    kind = make_kind(name, {**MINIMAL[name], "max_tokens": " 12 "})
    assert kind.params["max_tokens"] == 12
    again = make_kind(name, json.loads(json.dumps(kind.params)))
    assert again.params == kind.params


def test_string_params_are_typed():
    kind = make_kind(
        "summarize", {"temperature": "0.7", "top_p": "0.9", "seed": "7", "instructions": " short "}
    )
    assert kind.params == {
        "max_tokens": 256,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 7,
        "instructions": "short",
    }
    sampling = kind.sampling()
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (256, 0.7, 0.9, 7)


def test_importing_jobs_loads_no_engine_database_broker_or_crypto():
    code = (
        "import sys, jobs, jobs.openai_batch, jobs.repository, jobs.review_report\n"
        "bad = [m for m in ('torch', 'engine', 'pipeline', 'sqlalchemy', 'celery', 'kombu', 'cryptography')"
        " if m in sys.modules]\n"
        "print(bad)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
