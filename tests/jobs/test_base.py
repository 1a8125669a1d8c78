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


def test_unknown_kind_lists_the_known_ones_without_quoting_the_name():
    with pytest.raises(JobParamError) as caught:
        make_kind("translate", {})
    assert str(caught.value) == "unknown kind (known: chat, code-review, extract, summarize)"
    with pytest.raises(JobParamError) as caught:
        make_kind("sumarize", {})
    assert (
        str(caught.value)
        == "unknown kind (did you mean 'summarize'? known: chat, code-review, extract, summarize)"
    )


@pytest.mark.parametrize("name", sorted(KINDS))
def test_unknown_parameter_suggests_a_known_one_and_never_quotes_the_key(name):
    with pytest.raises(JobParamError) as caught:
        make_kind(name, {**MINIMAL[name], "max_tokenz": "5"})
    message = str(caught.value)
    assert "max_tokenz" not in message and "did you mean 'max_tokens'?" in message and "known: " in message
    assert "\n" not in message
    with pytest.raises(JobParamError, match=r"^unknown parameter for kind"):
        make_kind(name, {**MINIMAL[name], 5: "5"})
    with pytest.raises(JobParamError, match=r"^parameters must be an object, not array$"):
        make_kind(name, [1])


@pytest.mark.parametrize(
    "name, param",
    [
        ("code-review", {"focus": "x\ud800"}),
        ("extract", {"fields": ["a\udfff"]}),
        ("summarize", {"instructions": "\ud800"}),
    ],
)
def test_a_parameter_with_a_lone_surrogate_is_refused_before_sealing(name, param):
    # Found by tests/fuzz: such a string passed validation, then could not be encoded as UTF-8 to be sealed.
    with pytest.raises(JobParamError, match=r"^parameter \w+ is not valid Unicode text") as caught:
        make_kind(name, {**MINIMAL[name], **param})
    assert "\ud800" not in str(caught.value) and "\udfff" not in str(caught.value)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70, str(2**70), "1" * 5000])
def test_a_seed_must_fit_in_64_bits(seed):
    with pytest.raises(JobParamError, match=r"^seed must be an integer"):
        make_kind("summarize", {"seed": seed})
    assert make_kind("summarize", {"seed": 2**64 - 1}).params["seed"] == 2**64 - 1


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "nan", "-inf", "1e400", 10**400, True, [1]])
def test_temperature_must_be_a_finite_number(value):
    with pytest.raises(JobParamError, match=r"^temperature must be a (finite )?number"):
        make_kind("summarize", {"temperature": value})


@pytest.mark.parametrize("name", ["code-review", "extract", "summarize"])
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_tokens", "abc", "max_tokens must be an integer (got a 3-character string)"),
        ("max_tokens", "0", "max_tokens must be at least 1"),
        ("max_tokens", 2**40, "max_tokens must be at most 2147483647"),
        ("temperature", "-0.5", "temperature must be at least 0.0"),
        ("temperature", "hot", "temperature must be a number (got a 3-character string)"),
        ("top_p", "0", "top_p must be greater than 0.0"),
        ("top_p", "1.5", "top_p must be at most 1.0"),
        ("seed", "1.5", "seed must be an integer (got a 3-character string)"),
        ("seed", 1.5, "seed must be an integer (got number)"),
    ],
)
def test_bad_sampling_params_are_one_line_naming_the_param_never_the_value(name, key, value, message):
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
        "enable_thinking": False,  # summarize's default (jobs/thinking.py)
        "include_reasoning": False,
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
