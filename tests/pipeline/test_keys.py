import hashlib
import json
import os
import re
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from pipeline.keys import (
    ED25519_FILE,
    PUBLIC_FILE,
    X25519_FILE,
    Identity,
    KeyFileError,
    PublicIdentity,
    generate_identity,
    load_identity,
    load_public,
    save_identity,
    verify_signature,
)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message
    return message


def test_round_trip_keeps_keys(tmp_path):
    identity = generate_identity()
    save_identity(identity, tmp_path / "keys")
    loaded = load_identity(tmp_path / "keys")
    assert loaded.public == identity.public
    assert verify_signature(identity.public, b"data", loaded.sign(b"data"))


def test_file_modes(tmp_path):
    directory = tmp_path / "service"
    save_identity(generate_identity(), directory)
    assert _mode(directory) == 0o700
    assert _mode(directory / X25519_FILE) == 0o600
    assert _mode(directory / ED25519_FILE) == 0o600
    assert _mode(directory / PUBLIC_FILE) == 0o644
    assert sorted(p.name for p in directory.iterdir()) == sorted([X25519_FILE, ED25519_FILE, PUBLIC_FILE])


def test_private_files_are_0600_even_with_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        save_identity(generate_identity(), tmp_path / "k")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "k" / X25519_FILE) == 0o600


def test_private_key_pem_is_pkcs8(tmp_path):
    save_identity(generate_identity(), tmp_path)
    assert (tmp_path / X25519_FILE).read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")


def test_passphrase_round_trip(tmp_path):
    identity = generate_identity()
    save_identity(identity, tmp_path, passphrase=b"correct horse")
    assert (tmp_path / X25519_FILE).read_bytes().startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----")
    assert load_identity(tmp_path, passphrase=b"correct horse").public == identity.public


def test_passphrase_missing_is_clear(tmp_path):
    save_identity(generate_identity(), tmp_path, passphrase=b"pw")
    with pytest.raises(KeyFileError) as excinfo:
        load_identity(tmp_path)
    message = _one_line(excinfo)
    assert message.startswith(f"key file {tmp_path / X25519_FILE} is passphrase-protected: set ")


def test_wrong_passphrase_is_clear(tmp_path):
    save_identity(generate_identity(), tmp_path, passphrase=b"pw")
    with pytest.raises(KeyFileError) as excinfo:
        load_identity(tmp_path, passphrase=b"not it")
    assert _one_line(excinfo).startswith(f"wrong passphrase for key file {tmp_path / X25519_FILE}")


def test_passphrase_given_for_plain_keys_still_loads(tmp_path):
    identity = generate_identity()
    save_identity(identity, tmp_path)
    assert load_identity(tmp_path, passphrase=b"unused").public == identity.public


def test_empty_passphrase_refused(tmp_path):
    with pytest.raises(KeyFileError):
        save_identity(generate_identity(), tmp_path, passphrase=b"")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_refuses_key_file_readable_by_others(tmp_path, mode):
    save_identity(generate_identity(), tmp_path)
    path = tmp_path / ED25519_FILE
    os.chmod(path, mode)
    with pytest.raises(KeyFileError) as excinfo:
        load_identity(tmp_path)
    assert _one_line(excinfo) == f"key file {path} is readable by others (mode {mode:04o}); chmod 600 it"


def test_overwrite_refused_then_allowed(tmp_path):
    first, second = generate_identity(), generate_identity()
    save_identity(first, tmp_path)
    with pytest.raises(KeyFileError) as excinfo:
        save_identity(second, tmp_path)
    assert "already exists" in _one_line(excinfo)
    assert load_identity(tmp_path).public == first.public
    save_identity(second, tmp_path, overwrite=True)
    assert load_identity(tmp_path).public == second.public
    assert load_public(tmp_path) == second.public
    assert _mode(tmp_path / X25519_FILE) == 0o600
    assert not list(tmp_path.glob(".*.tmp"))


def test_overwrite_fixes_loose_mode(tmp_path):
    save_identity(generate_identity(), tmp_path)
    os.chmod(tmp_path / X25519_FILE, 0o644)
    save_identity(generate_identity(), tmp_path, overwrite=True)
    assert _mode(tmp_path / X25519_FILE) == 0o600


def test_missing_keys_say_what_to_run(tmp_path):
    with pytest.raises(KeyFileError) as excinfo:
        load_identity(tmp_path / "nowhere")
    assert _one_line(excinfo) == (
        f"no key in {tmp_path / 'nowhere'}; run `enclave init` or `enclave keys create`"
    )
    save_identity(generate_identity(), tmp_path)
    (tmp_path / ED25519_FILE).unlink()
    with pytest.raises(KeyFileError, match=r"^no key in "):
        load_identity(tmp_path)


def test_corrupt_key_file(tmp_path):
    save_identity(generate_identity(), tmp_path)
    path = tmp_path / X25519_FILE
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(KeyFileError) as excinfo:
        load_identity(tmp_path)
    assert _one_line(excinfo) == f"key file {path} is corrupt: not a PEM private key"


def test_wrong_key_type(tmp_path):
    save_identity(generate_identity(), tmp_path)
    ed_pem = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / X25519_FILE).write_bytes(ed_pem)
    with pytest.raises(KeyFileError) as excinfo:
        load_identity(tmp_path)
    assert _one_line(excinfo) == f"key file {tmp_path / X25519_FILE} is not an X25519 private key"


def test_fingerprint_format_and_stability(tmp_path):
    identity = generate_identity()
    fingerprint = identity.public.fingerprint
    assert re.fullmatch(r"[0-9a-f]{64}", fingerprint)
    save_identity(identity, tmp_path)
    assert load_identity(tmp_path).public.fingerprint == fingerprint
    assert load_public(tmp_path).fingerprint == fingerprint
    assert generate_identity().public.fingerprint != fingerprint
    known = PublicIdentity(x25519=bytes(32), ed25519=bytes(range(32)))
    # pins the order ed25519 || x25519
    assert known.fingerprint == hashlib.sha256(bytes(range(32)) + bytes(32)).hexdigest()
    assert known.fingerprint != hashlib.sha256(bytes(32) + bytes(range(32))).hexdigest()


def test_public_json_round_trip_and_validation():
    public = generate_identity().public
    data = public.to_json()
    assert set(data) == {"x25519", "ed25519", "fingerprint"}
    assert PublicIdentity.from_json(json.loads(json.dumps(data))) == public
    assert PublicIdentity.from_json({"x25519": data["x25519"], "ed25519": data["ed25519"]}) == public
    with pytest.raises(KeyFileError, match="fingerprint"):
        PublicIdentity.from_json({**data, "fingerprint": "0" * 64})
    with pytest.raises(KeyFileError, match="32 raw bytes"):
        PublicIdentity.from_json({**data, "x25519": "AAAA", "fingerprint": None})
    with pytest.raises(KeyFileError, match="base64"):
        PublicIdentity.from_json({**data, "ed25519": "not base64!"})
    with pytest.raises(KeyFileError, match="missing"):
        PublicIdentity.from_json({"x25519": data["x25519"]})


def test_load_public_file_and_errors(tmp_path):
    identity = generate_identity()
    save_identity(identity, tmp_path)
    assert load_public(tmp_path / PUBLIC_FILE) == identity.public
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(KeyFileError) as excinfo:
        load_public(tmp_path / "bad.json")
    assert "not valid JSON" in _one_line(excinfo)
    with pytest.raises(KeyFileError) as excinfo:
        load_public(tmp_path / "missing.json")
    assert _one_line(excinfo).startswith("no public key at ")


def test_verify_signature_never_raises_for_bad_signatures():
    identity, other = generate_identity(), generate_identity()
    signature = identity.sign(b"message")
    assert len(signature) == 64
    assert verify_signature(identity.public, b"message", signature)
    assert not verify_signature(identity.public, b"messagE", signature)
    assert not verify_signature(other.public, b"message", signature)
    assert not verify_signature(identity.public, b"message", signature[:-1])
    assert not verify_signature(identity.public, b"message", b"")
    assert not verify_signature(identity.public, b"message", bytes(64))


def test_identity_repr_hides_private_keys():
    identity = generate_identity()
    raw = identity.x25519_private.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    assert raw.hex() not in repr(identity)
    assert identity.public.fingerprint in repr(identity)
    with pytest.raises(TypeError):
        Identity(identity.x25519_private, identity.x25519_private)
