import re

import pytest

from jobs import make_kind
from jobs.base import DocumentError
from jobs.code_review import build_report
from jobs.findings import parse_findings
from jobs.scan_record import ScanRecord
from tests.jobs.factories import FakeModel, doc, make_output

SOURCE = "".join(f"value_{i} = compute({i}) + offset\n" for i in range(1, 121))


def numbered_lines(prompt: str) -> list[int]:
    return [int(n) for n in re.findall(r"^\s*(\d+) \| ", prompt, flags=re.M)]


def test_a_file_that_fits_is_one_prompt(model):
    kind = make_kind("code-review", {"focus": "security"})
    [request] = kind.requests(doc("import os\nos.system(cmd)\n", "src/run.py"), model)
    assert "particular attention to security" in request.prompt
    assert "File: src/run.py (Python), lines 1-2 of 2" in request.prompt
    assert "1 | import os\n2 | os.system(cmd)" in request.prompt
    assert request.sampling.max_tokens == 2048  # the default covers reasoning too (jobs/thinking.py)


def test_a_long_file_is_split_into_chunks_of_whole_lines_that_fit():
    model = FakeModel(max_model_len=600)
    kind = make_kind("code-review", {"max_tokens": "100"})
    requests = kind.requests(doc(SOURCE, "calc.py"), model)
    assert len(requests) > 2
    covered = [n for r in requests for n in numbered_lines(r.prompt)]
    assert covered == list(range(1, 121))  # every line once, in order
    for request in requests:
        assert model.count_tokens(request.prompt) + 100 <= 600
        lines = numbered_lines(request.prompt)
        assert f"lines {lines[0]}-{lines[-1]} of 120" in request.prompt
        assert "Reply with a JSON list only" in request.prompt


def test_a_line_longer_than_the_context_fails_the_file():
    model = FakeModel(max_model_len=300)
    with pytest.raises(DocumentError, match="line 2 is too long to review"):
        make_kind("code-review", {"max_tokens": "50"}).requests(doc("ok\n" + "w " * 400), model)


def test_no_room_for_code_says_to_lower_max_tokens():
    with pytest.raises(DocumentError, match=r"leave no room for code .*; lower max_tokens"):
        make_kind("code-review", {"max_tokens": "40"}).requests(doc(SOURCE), FakeModel(max_model_len=100))


def test_non_utf8_file_fails(model):
    with pytest.raises(DocumentError, match="not valid UTF-8"):
        make_kind("code-review", {}).requests(doc(b"\x80abc"), model)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[{"line": 3, "severity": "HIGH", "issue": "SQL injection"}]', [(3, "high", "SQL injection")]),
        ('Sure:\n```json\n[{"line": "7", "severity": "warning", "message": "x"}]\n```', [(7, "medium", "x")]),
        (
            '{"line": 1, "severity": "low", "issue": "a"}\n{"line": 2, "issue": "b"}',
            [(1, "low", "a"), (2, "medium", "b")],
        ),
        ('{"findings": [{"line": [4, 6], "severity": "nit", "issue": "c"}]}', [(4, "low", "c")]),
        ("[]", []),
        ("  ", []),
        ("Looks fine, but [1, 2] is odd.", [(None, "note", "Looks fine, but [1, 2] is odd.")]),
    ],
)
def test_parse_findings(text, expected):
    assert [(f["line"], f["severity"], f["issue"]) for f in parse_findings(text)] == expected


def test_result_merges_chunks_and_sorts_by_line():
    outputs = [
        make_output('[{"line": 40, "severity": "low", "issue": "b"}]'),
        make_output("free text"),
        make_output('[{"line": 2, "severity": "high", "issue": "a"}]'),
    ]
    result = make_kind("code-review", {}).result(doc("", "lib/x.go"), outputs)
    assert result.status == "done"
    assert result.output["path"] == "lib/x.go"
    assert (result.output["language"], result.output["chunks"]) == ("Go", 3)
    assert [f["issue"] for f in result.output["findings"]] == ["a", "b", "free text"]
    assert result.usage["prompt_tokens"] == 30
    assert result.output["model"] is None  # hand-built outputs name no model


def test_result_names_the_served_model():
    output = make_output("[]")
    output.model = "Qwen3.6-35B-A3B"
    assert (
        make_kind("code-review", {}).result(doc("x = 1\n", "a.py"), [output]).output["model"] == output.model
    )


def test_build_report():
    def done(path, findings, chunks=1):
        output = {"path": path, "language": "Python", "chunks": chunks, "findings": findings}
        return path, {"status": "done", "output": output, "error": None}

    results = [
        done("b.py", [{"line": 3, "severity": "high", "issue": "uses | pipes\nand lines"}], chunks=2),
        done("a.py", []),
        (
            "c.py",
            {
                "status": "failed",
                "output": None,
                "error": "document is not valid UTF-8 (first bad byte at offset 0)",
            },
        ),
        done(
            "d.py",
            [
                {"line": None, "severity": "note", "issue": "free\ntext"},
                {"line": 1, "severity": "low", "issue": "x"},
            ],
        ),
    ]
    scan = ScanRecord(skipped=[("node_modules/", "vendored")])
    report = build_report(results, scan, title="Review of repo")
    assert report.startswith("# Review of repo\n")
    assert "\n| Files reviewed | Failed | Skipped | High | Medium | Low | Note |\n" in report
    assert "| 3 | 1 | 1 | 1 | 0 | 1 | 1 |" in report
    assert (
        report.index("## `a.py`")
        < report.index("## `b.py`")
        < report.index("## `c.py`")
        < report.index("## `d.py`")
    )
    assert "No findings." in report
    assert "- **high** (line 3): uses \\| pipes and lines" in report
    assert "_Python, reviewed in 2 parts_" in report
    assert "**Failed:** document is not valid UTF-8 (first bad byte at offset 0)" in report
    assert "  > free\n  > text" in report
    assert (
        "## Skipped\n\n| Reason | Files |\n| --- | --- |\n| vendored | 1 |\n\n- `node_modules/`: vendored"
        in report
    )
