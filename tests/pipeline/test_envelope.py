import json

import pytest

from pipeline.envelope import (
    EnvelopeError,
    ManifestError,
    canonical_json,
    open_document,
    open_job_name,
    open_params,
    open_result,
    pack_document,
    seal_document,
    seal_job_name,
    seal_params,
    seal_result,
    sha256_hex,
    sign_manifest,
    unpack_document,
    verify_manifest,
)
from pipeline.keys import generate_identity

CANARY = b"CANARY-7f3a patient record: Jane Doe, MRN 0042"


@pytest.fixture(scope="module")
def service():
    return generate_identity()


@pytest.fixture(scope="module")
def client():
    return generate_identity()


def _one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message
    return message


def _manifest(identity, **overrides) -> dict:
    manifest = {
        "version": 1,
        "job_id": "job-1",
        "kind": "summarize",
        "params": {"max_tokens": 256, "style": "brief"},
        "client": identity.public.fingerprint,
        "documents": [
            {"id": "doc-1", "sha256": sha256_hex(b"one")},
            {"id": "doc-2", "sha256": sha256_hex(b"two")},
        ],
        "created_at": "2025-01-01T00:00:00Z",
    }
    manifest.update(overrides)
    return manifest


def _signed(client, manifest: dict) -> tuple[str, bytes]:
    return json.dumps(manifest), sign_manifest(manifest, client)


@pytest.mark.parametrize("size", [0, 1, 63, 1000, 70_000])
def test_document_round_trip(service, size):
    plaintext = bytes(i % 251 for i in range(size))
    sealed = seal_document(plaintext, service.public.x25519, "job-1", "doc-1")
    assert open_document(sealed, service, "job-1", "doc-1") == plaintext


def test_result_round_trip(client):
    sealed = seal_result(b'{"summary": "ok"}', client.public.x25519, "job-1", "doc-1")
    assert open_result(sealed, client, "job-1", "doc-1") == b'{"summary": "ok"}'


def test_wrong_private_key_fails(service):
    sealed = seal_document(CANARY, service.public.x25519, "job-1", "doc-1")
    with pytest.raises(EnvelopeError) as excinfo:
        open_document(sealed, generate_identity(), "job-1", "doc-1")
    assert _one_line(excinfo) == "cannot open document doc-1: wrong key or corrupted ciphertext"


@pytest.mark.parametrize("position", [0, 31, 32, -17, -1])
def test_tampered_ciphertext_fails(service, position):
    sealed = bytearray(seal_document(CANARY, service.public.x25519, "job-1", "doc-1"))
    sealed[position] ^= 0x01
    with pytest.raises(EnvelopeError) as excinfo:
        open_document(bytes(sealed), service, "job-1", "doc-1")
    assert "wrong key or corrupted ciphertext" in _one_line(excinfo)


@pytest.mark.parametrize("sealed", [b"", b"\x00", b"x" * 48])
def test_truncated_or_garbage_fails(service, sealed):
    with pytest.raises(EnvelopeError):
        open_document(sealed, service, "job-1", "doc-1")


@pytest.mark.parametrize(
    ("job_id", "document_id"),
    [("job-2", "doc-1"), ("job-1", "doc-2"), ("job-1doc-1", ""), ("", "job-1doc-1"), ("job-1", "doc-1 ")],
)
def test_swapped_ids_fail(service, job_id, document_id):
    sealed = seal_document(CANARY, service.public.x25519, "job-1", "doc-1")
    with pytest.raises(EnvelopeError) as excinfo:
        open_document(sealed, service, job_id, document_id)
    assert CANARY.decode() not in _one_line(excinfo)


def test_document_does_not_open_as_result_and_back(service):
    # the same key pair on both sides, so only the purpose in `info` differs
    sealed = seal_document(CANARY, service.public.x25519, "job-1", "doc-1")
    with pytest.raises(EnvelopeError) as excinfo:
        open_result(sealed, service, "job-1", "doc-1")
    assert _one_line(excinfo) == "cannot open result of document doc-1: wrong key or corrupted ciphertext"
    result = seal_result(CANARY, service.public.x25519, "job-1", "doc-1")
    with pytest.raises(EnvelopeError):
        open_document(result, service, "job-1", "doc-1")


def test_envelope_is_randomized_and_hides_plaintext(service):
    first = seal_document(CANARY, service.public.x25519, "job-1", "doc-1")
    second = seal_document(CANARY, service.public.x25519, "job-1", "doc-1")
    assert first != second
    for sealed in (first, second):
        assert CANARY not in sealed
        assert b"CANARY" not in sealed
        assert b"job-1" not in sealed and b"doc-1" not in sealed


def test_ids_with_nul_are_refused(service):
    with pytest.raises(EnvelopeError, match="NUL"):
        seal_document(b"x", service.public.x25519, "job\x00a", "doc")


def test_bad_public_key_is_refused():
    with pytest.raises(EnvelopeError, match="32 raw bytes"):
        seal_document(b"x", b"short", "job-1", "doc-1")


@pytest.mark.parametrize(
    ("path", "data"),
    [
        ("notes/a.txt", b"hello"),
        ("", b""),
        ("données/résumé 报告 🚀.md", "Grüße".encode()),
        ("bin/blob.dat", bytes(range(256)) + b"\xff\xfe\x80\xc3\x28"),
        ('quote"and\\slash\n.txt', b"\x00" * 10),
    ],
)
def test_pack_unpack_round_trip(path, data):
    payload = pack_document(path, data)
    assert unpack_document(payload) == (path, data)


def test_pack_through_envelope(service):
    payload = pack_document("secret/name.txt", CANARY)
    sealed = seal_document(payload, service.public.x25519, "job-1", "doc-1")
    assert b"secret/name" not in sealed
    assert unpack_document(open_document(sealed, service, "job-1", "doc-1")) == ("secret/name.txt", CANARY)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x00\x00",
        b"\x00\x00\x00\x10{}",
        b"\x00\x00\x00\x02{}",
        b"\x00\x00\x00\x02[]",
        b'\x00\x00\x00\x0b{"path":12}',
        b"\x00\x00\x00\x03\xff\xfe\xfd",
        b"\x00\x00\x00\x03{no",
        b"\xff\xff\xff\xff" + b"x" * 100,
        len(b'{"path": ' + b"[" * 50_000 + b"]" * 50_000 + b"}").to_bytes(4, "big")
        + b'{"path": '
        + b"[" * 50_000
        + b"]" * 50_000
        + b"}",
        b"\x00\x00\x00\x12" + b'{"path": "\\ud800"}',
        b"\x00\x00\x00\x0e" + b'{"path": 1e999}',
    ],
)
def test_unpack_malformed_payload(payload):
    with pytest.raises(EnvelopeError) as excinfo:
        unpack_document(payload)
    assert _one_line(excinfo).startswith("malformed document payload")


def test_pack_refuses_undecodable_path():
    with pytest.raises(EnvelopeError):
        pack_document("bad\udcff.txt", b"x")


def test_sha256_hex():
    assert sha256_hex(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_canonical_json_is_deterministic():
    assert canonical_json({"b": 1, "a": [1, 2], "é": "ü"}) == '{"a":[1,2],"b":1,"é":"ü"}'.encode()
    assert canonical_json({"a": 1, "b": 2}) == canonical_json({"b": 2, "a": 1})


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_canonical_json_rejects_non_finite(value):
    with pytest.raises(ValueError):
        canonical_json({"x": value})


def test_manifest_verifies(client):
    manifest = _manifest(client)
    text, signature = _signed(client, manifest)
    assert verify_manifest(text, signature, client.public) == manifest
    # whitespace and key order of the transport JSON do not matter, only the content
    reordered = json.dumps(dict(reversed(manifest.items())), indent=4)
    assert verify_manifest(reordered, signature, client.public) == manifest


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m["documents"][0].update(sha256=sha256_hex(b"other")),
        lambda m: m["documents"].reverse(),
        lambda m: m.update(kind="extract"),
        lambda m: m["params"].update(max_tokens=257),
        lambda m: m.update(job_id="job-2"),
    ],
)
def test_manifest_single_change_fails(client, change):
    manifest = _manifest(client)
    signature = sign_manifest(manifest, client)
    tampered = json.loads(json.dumps(manifest))
    change(tampered)
    with pytest.raises(ManifestError) as excinfo:
        verify_manifest(json.dumps(tampered), signature, client.public)
    assert _one_line(excinfo) == "manifest signature does not verify"


def test_manifest_signed_by_another_client_fails(client):
    other = generate_identity()
    manifest = _manifest(client)
    text, signature = json.dumps(manifest), sign_manifest(manifest, other)
    with pytest.raises(ManifestError, match=r"^manifest signature does not verify$"):
        verify_manifest(text, signature, client.public)


def test_manifest_for_another_client_fingerprint_fails(client):
    other = generate_identity()
    manifest = _manifest(client, client=other.public.fingerprint)
    text, signature = _signed(client, manifest)
    with pytest.raises(ManifestError) as excinfo:
        verify_manifest(text, signature, client.public)
    assert "does not match the verifying key" in _one_line(excinfo)


@pytest.mark.parametrize(
    "field", ["version", "job_id", "kind", "params", "client", "documents", "created_at"]
)
def test_manifest_missing_field_fails(client, field):
    manifest = _manifest(client)
    del manifest[field]
    text = json.dumps(manifest)
    signature = client.sign(canonical_json(manifest))  # validly signed, still incomplete
    with pytest.raises(ManifestError) as excinfo:
        verify_manifest(text, signature, client.public)
    assert _one_line(excinfo) == f"manifest is missing field '{field}'"
    with pytest.raises(ManifestError):
        sign_manifest(manifest, client)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"version": 3}, "manifest version is not supported (expected 1 or 2)"),
        ({"version": 10**4000}, "manifest version is not supported (expected 1 or 2)"),
        ({"version": 2}, "manifest is missing field 'params_sha256'"),
        ({"job_id": "j" * 201}, "'job_id' must be 1 to 200 characters"),
        ({"version": True}, "'version' must be an integer"),
        ({"version": "1"}, "'version' must be an integer"),
        ({"params": []}, "'params' must be an object"),
        ({"job_id": 7}, "'job_id' must be a string"),
        ({"documents": [{"id": "d"}]}, "'sha256'"),
        ({"documents": [{"id": "d", "sha256": "AB" * 32}]}, "'sha256'"),
        ({"documents": [{"sha256": "ab" * 32}]}, "'id'"),
        ({"documents": ["doc-1"]}, "must be an object"),
        (
            {"documents": [{"id": "CANARY", "sha256": "ab" * 32}] * 2},
            "one document id twice (documents 0 and 1)",
        ),
    ],
)
def test_manifest_bad_fields_fail(client, overrides, reason):
    manifest = _manifest(client, **overrides)
    signature = client.sign(canonical_json(manifest))
    with pytest.raises(ManifestError) as excinfo:
        verify_manifest(json.dumps(manifest), signature, client.public)
    assert reason in _one_line(excinfo) and "CANARY" not in _one_line(excinfo)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (
            "{not json",
            "manifest is not valid JSON (Expecting property name enclosed in double quotes at offset 1)",
        ),
        ("", "manifest is not valid JSON (Expecting value at offset 0)"),
        ('{"version": NaN}', "manifest holds a number JSON cannot carry"),
        ('{"version": 1e400}', "manifest holds a number JSON cannot carry"),
        ('{"version": ' + "9" * 5000 + "}", "manifest holds a number JSON cannot carry"),
        ('{"params": ' + "[" * 100_000 + "]" * 100_000 + "}", "manifest is nested more than 64 levels deep"),
        ("[" * 100_000, "manifest is nested more than 64 levels deep"),
        ("[1, 2]", "manifest must be a JSON object"),
        (None, "manifest must be text, not NoneType"),
        ('{"CANARY\ud800": 1}', "manifest holds a lone surrogate"),
        ('{"CANARY\\ud800": 1}', "manifest holds a lone surrogate"),
    ],
)
def test_manifest_not_json_object(client, text, reason):
    with pytest.raises(ManifestError) as excinfo:
        verify_manifest(text, b"\x00" * 64, client.public)
    assert _one_line(excinfo).startswith(reason) and "CANARY" not in str(excinfo.value)


def test_sealed_names_open_only_as_names_for_their_document():
    from pipeline import envelope

    client = generate_identity()
    sealed = envelope.seal_name("notes/ünï.txt", client.public.x25519, "job-1", "doc-1")
    assert envelope.open_name(sealed, client, "job-1", "doc-1") == "notes/ünï.txt"
    for args in (("job-1", "doc-2"), ("job-2", "doc-1")):
        with pytest.raises(envelope.EnvelopeError):
            envelope.open_name(sealed, client, *args)
    with pytest.raises(envelope.EnvelopeError):
        envelope.open_result(sealed, client, "job-1", "doc-1")


def _manifest_v2(identity, sealed_params: bytes, **overrides) -> dict:
    manifest = _manifest(identity, version=2, params_sha256=sha256_hex(sealed_params), **overrides)
    del manifest["params"]
    return manifest


def test_manifest_v2_signs_the_hash_of_sealed_params(client, service):
    params = {"instructions": CANARY.decode(), "max_tokens": 8}
    sealed = seal_params(params, service.public.x25519, "job-1")
    assert CANARY not in sealed
    manifest = _manifest_v2(client, sealed)
    text, signature = _signed(client, manifest)
    assert verify_manifest(text, signature, client.public) == manifest
    assert CANARY.decode() not in text
    assert open_params(sealed, service, "job-1") == params
    for job_id, identity in (("job-2", service), ("job-1", client)):  # another job's, or not the service
        with pytest.raises(EnvelopeError, match=r"^cannot open the params of job .*wrong key"):
            open_params(sealed, identity, job_id)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m: m.update(params={"max_tokens": 8}), "must not carry 'params' in clear"),
        (lambda m: m.update(params_sha256="AB" * 32), "'params_sha256' must be 64 lowercase hex"),
        (lambda m: m.update(params_sha256=7), "'params_sha256' must be a string"),
    ],
)
def test_manifest_v2_bad_params_fields_fail(client, service, change, reason):
    manifest = _manifest_v2(client, seal_params({}, service.public.x25519, "job-1"))
    change(manifest)
    signature = client.sign(canonical_json(manifest))
    with pytest.raises(ManifestError, match=reason):
        verify_manifest(json.dumps(manifest), signature, client.public)


def test_sealed_params_that_are_not_an_object_fail_cleanly(service):
    from pipeline.envelope import _seal

    for payload in (b"[1]", b"[" * 100_000, CANARY):
        sealed = _seal("params", payload, service.public.x25519, "job-1", "")
        with pytest.raises(EnvelopeError) as excinfo:
            open_params(sealed, service, "job-1")
        assert _one_line(excinfo).startswith("malformed sealed parameters") and "CANARY" not in str(
            excinfo.value
        )


def test_job_names_open_only_for_their_job_and_client(client, service):
    sealed = seal_job_name("Jane Doe \u00e9", client.public.x25519, "job-1")
    assert open_job_name(sealed, client, "job-1") == "Jane Doe \u00e9"
    for job_id, identity in (("job-2", client), ("job-1", service)):
        with pytest.raises(EnvelopeError):
            open_job_name(sealed, identity, job_id)
    with pytest.raises(EnvelopeError):  # a document name does not open as the job's name
        open_job_name(seal_result(b"x", client.public.x25519, "job-1", ""), client, "job-1")
