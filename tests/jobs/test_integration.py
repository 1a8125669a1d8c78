"""Each kind end to end on the demo model, driven the way a worker drives a shard.

The demo model has RANDOM weights: its text is garbage, so these tests check plumbing and shapes, not
language quality (extract normally fails with "not valid JSON" and keeps the raw text).
"""

import json

from jobs import make_kind
from jobs.base import Document, EngineModel
from jobs.openai_batch import output_line, parse_batch_file
from tests.jobs.factories import run_shard

NOTE = "Patient is a 64-year-old with hypertension, admitted with chest pain. Troponin negative."


def test_engine_model_adapter(demo_engine):
    model = EngineModel(demo_engine)
    assert model.max_model_len == demo_engine.config.max_model_len
    assert model.count_tokens("hello world") == len(
        demo_engine.tokenizer.encode("hello world", add_special_tokens=False)
    )
    assert model.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_summarize(demo_engine):
    kind = make_kind("summarize", {"max_tokens": "8"})
    good, bad = run_shard(
        kind, [Document("a.txt", NOTE.encode()), Document("b.txt", b"\xffbad")], demo_engine
    )
    assert good.status == "done" and isinstance(good.output, str) and good.output
    assert good.usage["completion_tokens"] <= 8 and good.usage["prompt_tokens"] > 20
    assert (bad.status, bad.error) == ("failed", "document is not valid UTF-8 (first bad byte at offset 0)")


def test_extract_keeps_raw_text_of_unparsable_output(demo_engine):
    kind = make_kind("extract", {"fields": "age,diagnosis", "max_tokens": "8"})
    [result] = run_shard(kind, [Document("a.txt", NOTE.encode())], demo_engine)
    assert (result.status, result.output) == ("failed", None)
    assert result.error.startswith("model output is not valid JSON")
    assert isinstance(result.raw, str) and result.raw


def test_code_review(demo_engine):
    source = b"def add(a, b):\n    return a - b\n"
    [result] = run_shard(
        make_kind("code-review", {"max_tokens": "8"}), [Document("src/add.py", source)], demo_engine
    )
    assert result.status == "done"
    assert {k: result.output[k] for k in ("path", "language", "chunks")} == {
        "path": "src/add.py",
        "language": "Python",
        "chunks": 1,
    }
    assert all(set(f) == {"line", "severity", "issue"} for f in result.output["findings"])


def test_chat_batch(demo_engine):
    chat = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    lines = [
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {
            "custom_id": "c2",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "The quick", "max_tokens": 4},
        },
        {"custom_id": "c3", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    batch = parse_batch_file(b"\n".join(json.dumps(line).encode() for line in lines))
    docs = [Document(line.custom_id, line.raw) for line in batch]
    results = run_shard(make_kind("chat", {}), docs, demo_engine)
    out = [output_line(doc.path, vars(result)) for doc, result in zip(docs, results, strict=True)]
    chat, completion = out[0]["response"]["body"], out[1]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["model"] == demo_engine.model_name
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["choices"][0]["finish_reason"] in ("stop", "length")
    assert 1 <= chat["usage"]["completion_tokens"] <= 6
    assert completion["object"] == "text_completion" and isinstance(completion["choices"][0]["text"], str)
    assert out[2]["response"] is None and out[2]["error"]["code"] == "invalid_request_error"
    json.dumps(out)  # the output file is JSON


def test_instructions_are_a_shared_prefix_that_changes_nothing(demo_engine):
    """The worker submits each request with its rendered instructions as a shared prefix: the engine
    computes them once for the job, and every document's output is what it would be without sharing."""
    kind = make_kind("extract", {"fields": "age,diagnosis", "max_tokens": "6", "temperature": "0"})
    model = EngineModel(demo_engine)
    docs = [NOTE, "Patient 2 is 40.", "\nleading blank line", "  indented note"]
    requests = [kind.requests(Document(f"{i}.txt", d.encode()), model)[0] for i, d in enumerate(docs)]
    assert all(r.prefix and r.prompt.startswith(r.prefix) for r in requests)
    assert len({r.prefix for r in requests}) == 1 and "Extract" in requests[0].prefix
    plain = demo_engine.generate(
        [demo_engine.tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests],
        requests[0].sampling,
    )
    shared = [
        demo_engine.submit(r.prompt, r.sampling, prefix=r.prefix, add_special_tokens=False).result()
        for r in requests
    ]
    assert [o.token_ids for o in shared] == [o.token_ids for o in plain]
    prefix_tokens = len(demo_engine.tokenizer.encode(requests[0].prefix, add_special_tokens=False))
    assert all(o.metrics.cached_prefix_tokens >= prefix_tokens - 2 for o in shared)
