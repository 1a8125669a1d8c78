import pytest

from pipeline.settings import SettingsError, load_settings


def test_defaults_live_in_the_home(tmp_path):
    s = load_settings({"ENCLAVE_HOME": str(tmp_path)})
    assert s.database_url == f"sqlite:///{tmp_path / 'enclave.db'}"
    assert s.broker_url == f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    assert s.model is None and s.model_path == tmp_path / "models" / "demo"


def test_environment_wins_over_the_file(tmp_path):
    (tmp_path / "enclave.toml").write_text(
        'database_url = "postgresql+psycopg://db/enclave"\nbroker_url = "redis://file:6379/0"\n'
        "[limits]\nmax_attempts = 5\nlease_seconds = 12.5\n"
    )
    s = load_settings(
        {
            "ENCLAVE_HOME": str(tmp_path),
            "ENCLAVE_BROKER_URL": "redis://env:6379/1",
            "ENCLAVE_MAX_DOCUMENT_BYTES": "1000",
        }
    )
    assert s.database_url == "postgresql+psycopg://db/enclave" and s.broker_url == "redis://env:6379/1"
    assert (
        s.limits.max_attempts == 5 and s.limits.lease_seconds == 12.5 and s.limits.max_document_bytes == 1000
    )


@pytest.mark.parametrize(
    ("env", "needle"),
    [({"ENCLAVE_MAX_ATTEMPTS": "many"}, "max_attempts"), ({"ENCLAVE_LEASE_SECONDS": "0"}, "lease_seconds")],
)
def test_bad_values(tmp_path, env, needle):
    with pytest.raises(SettingsError, match=needle):
        load_settings({"ENCLAVE_HOME": str(tmp_path), **env})


def test_unreadable_toml(tmp_path):
    (tmp_path / "enclave.toml").write_text("this is = = not toml")
    with pytest.raises(SettingsError, match=r"enclave\.toml"):
        load_settings({"ENCLAVE_HOME": str(tmp_path)})


def test_engine_options_from_file_and_environment(tmp_path):
    (tmp_path / "enclave.toml").write_text('[engine]\nmax_num_seqs = 8\nquantization = "none"\n')
    s = load_settings({"ENCLAVE_HOME": str(tmp_path), "ENCLAVE_QUANTIZATION": "fp8"})
    assert s.engine == {"max_num_seqs": 8, "quantization": "fp8"}  # passed to Engine.from_pretrained as is


@pytest.mark.parametrize(
    ("table", "needle"), [("quantization = 8", "quantization must be a string"), ("beams = 4", "beams")]
)
def test_bad_engine_options(tmp_path, table, needle):
    (tmp_path / "enclave.toml").write_text(f"[engine]\n{table}\n")
    with pytest.raises(SettingsError, match=needle):
        load_settings({"ENCLAVE_HOME": str(tmp_path)})
