import pytest

from jobs import make_kind
from jobs.base import DocumentError
from jobs.summarize import INSTRUCTIONS
from tests.jobs.factories import FakeModel, doc, make_output


def test_prompt_holds_the_instructions_and_the_document(model):
    kind = make_kind("summarize", {"instructions": "Three sentences.", "max_tokens": "64"})
    [request] = kind.requests(doc("Patient seen today."), model)
    [system, user] = model.rendered[0]
    assert system == {"role": "system", "content": INSTRUCTIONS + "\n\nThree sentences."}
    assert user == {"role": "user", "content": "Patient seen today."}
    assert request.prompt.endswith("<assistant>\n")
    assert (request.sampling.max_tokens, request.sampling.temperature) == (64, 0.0)


def test_too_long_document_is_a_document_error():
    kind = make_kind("summarize", {})
    with pytest.raises(DocumentError, match=r"^document has 300 tokens; .* 256 output tokens it needs \d+, "):
        kind.requests(doc("word " * 300), FakeModel(max_model_len=512))


def test_non_utf8_and_empty_documents_fail(model):
    kind = make_kind("summarize", {})
    with pytest.raises(DocumentError, match=r"not valid UTF-8 .*offset 2"):
        kind.requests(doc(b"ok\xc3("), model)
    with pytest.raises(DocumentError, match="document is empty"):
        kind.requests(doc(" \n\t"), model)


def test_result_is_the_stripped_summary():
    kind = make_kind("summarize", {})
    result = kind.result(
        doc("x"), [make_output("  A short summary.\n", prompt_tokens=7, completion_tokens=4)]
    )
    assert (result.status, result.output, result.error) == ("done", "A short summary.", None)
    assert result.usage == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}


def test_empty_summary_fails():
    result = make_kind("summarize", {}).result(doc("x"), [make_output("  \n")])
    assert (result.status, result.error) == ("failed", "model returned an empty summary")
