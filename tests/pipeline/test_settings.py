import math
from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from engine.options import EngineOptions
from pipeline.settings import Limits, SettingsError, engine_fields, load_settings

BAD_NUMBERS = ["1e12", "nan", "inf", "-inf", "-1", "1e400", "abc", "", "0x10", "9" * 5000]
# Every numeric setting: (variable, key in its enclave.toml table, smallest and largest accepted values).
NUMERIC = [
    ("ENCLAVE_MAX_DOCUMENT_BYTES", "limits", "max_document_bytes", 1, 1 << 30),
    ("ENCLAVE_MAX_ATTEMPTS", "limits", "max_attempts", 1, 100),
    ("ENCLAVE_LEASE_SECONDS", "limits", "lease_seconds", 1, 604800),
    ("ENCLAVE_SHARD_SIZE", "limits", "shard_size", 1, 10_000),
    ("ENCLAVE_CHECKPOINT_EVERY", "limits", "checkpoint_every", 1, 1_000_000),
    ("ENCLAVE_MAX_NUM_SEQS", "engine", "max_num_seqs", 1, 4096),
    ("ENCLAVE_MAX_NUM_BATCHED_TOKENS", "engine", "max_num_batched_tokens", 1, 1 << 20),
    ("ENCLAVE_NUM_SPECULATIVE_TOKENS", "engine", "num_speculative_tokens", 0, 4),
    ("ENCLAVE_KV_CACHE_MEMORY", "engine", "kv_cache_memory", 1, 1 << 42),  # bytes: engine.options
]


def value_of(s, table, key):
    return getattr(s.limits, key) if table == "limits" else s.engine[key]


def refusal(home, env=None, toml=None) -> str:
    if toml is not None:
        (home / "enclave.toml").write_text(toml)
    with pytest.raises(SettingsError) as info:
        load_settings({"ENCLAVE_HOME": str(home), **(env or {})})
    message = str(info.value)
    # 400: an unknown key's message lists every known one, a list that grows with the engine's options.
    assert "\n" not in message and len(message) < 400, message
    return message


def test_defaults_live_in_the_home(tmp_path):
    s = load_settings({"ENCLAVE_HOME": str(tmp_path)})
    assert s.database_url == f"sqlite:///{tmp_path / 'enclave.db'}"
    assert s.broker_url == f"sqla+sqlite:///{tmp_path / 'broker.db'}"
    assert s.model is None and s.model_path == tmp_path / "models" / "demo"
    assert s.limits == Limits() and s.engine == {}


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


@pytest.mark.parametrize(("var", "table", "key", "low", "high"), NUMERIC)
def test_each_numeric_setting_accepts_its_range(tmp_path, var, table, key, low, high):
    for value in (low, high):
        s = load_settings({"ENCLAVE_HOME": str(tmp_path), var: str(value)})
        assert value_of(s, table, key) == value
        (tmp_path / "enclave.toml").write_text(f"[{table}]\n{key} = {value}\n")
        assert value_of(load_settings({"ENCLAVE_HOME": str(tmp_path)}), table, key) == value


@pytest.mark.parametrize(("var", "table", "key", "low", "high"), NUMERIC)
@pytest.mark.parametrize("bad", BAD_NUMBERS)
def test_bad_numbers_from_the_environment_are_one_line_naming_the_variable(
    tmp_path, var, table, key, low, high, bad
):
    if bad == "":  # an empty variable means unset
        assert load_settings({"ENCLAVE_HOME": str(tmp_path), var: bad})
        return
    message = refusal(tmp_path, {var: bad})
    assert message.startswith(f"{var} must be ") and f"between {low} and {high}" in message


@pytest.mark.parametrize(("var", "table", "key", "low", "high"), NUMERIC)
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "-1", "1e400", '"abc"', "true", "[1]", str(10**30)])
def test_bad_numbers_in_the_file_name_the_table_and_key(tmp_path, var, table, key, low, high, bad):
    message = refusal(tmp_path, toml=f"[{table}]\n{key} = {bad}\n")
    assert message.startswith(f"enclave.toml [{table}] {key} must be ")


@pytest.mark.parametrize(("var", "table", "key", "low", "high"), NUMERIC)
def test_out_of_range_by_one(tmp_path, var, table, key, low, high):
    for value in (low - 1, high + 1):
        refusal(tmp_path, {var: str(value)})


def test_fractions_only_where_a_number_may_have_one(tmp_path):
    assert (
        load_settings({"ENCLAVE_HOME": str(tmp_path), "ENCLAVE_LEASE_SECONDS": "2.5"}).limits.lease_seconds
        == 2.5
    )
    assert "whole number" in refusal(tmp_path, {"ENCLAVE_MAX_ATTEMPTS": "2.5"})


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('databse_url = "sqlite:///x"\n', "'databse_url' (known: database_url, broker_url"),
        ("[limit]\nlease_seconds = 5\n", "'limit'"),
        ("[limits]\nmax_attemps = 5\n", "'max_attemps' in [limits] (known: max_document_bytes, max_attempts"),
        ("[engine]\nbeams = 4\n", "'beams' in [engine] (known: quantization, max_num_seqs"),
        ("limits = 3\n", "[limits]"),
    ],
)
def test_unknown_keys_in_any_section_are_refused(tmp_path, toml, needle):
    message = refusal(tmp_path, toml=toml)
    assert message.startswith("enclave.toml: ") and needle in message


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"ENCLAVE_QUANTIZATION": "int3"}, "ENCLAVE_QUANTIZATION must be one of none, fp8, got 'int3'"),
        ({"ENCLAVE_DATABASE_URL": "postgres-at-db1"}, "ENCLAVE_DATABASE_URL must be a URL"),
    ],
)
def test_bad_text_values(tmp_path, env, needle):
    assert needle in refusal(tmp_path, env)


def test_urls_are_never_echoed(tmp_path):
    message = refusal(tmp_path, {"ENCLAVE_BROKER_URL": "hunter2-password"})
    assert message.startswith("ENCLAVE_BROKER_URL must be a URL") and "hunter2" not in message


def test_unreadable_toml(tmp_path):
    assert "enclave.toml" in refusal(tmp_path, toml="this is = = not toml")
    assert "nested too deeply" in refusal(tmp_path, toml="a = " + "[" * 5000 + "]" * 5000)
    (tmp_path / "enclave.toml").write_bytes(b"\xff\xfe")
    assert "enclave.toml" in refusal(tmp_path)


def test_engine_options_from_file_and_environment(tmp_path):
    (tmp_path / "enclave.toml").write_text('[engine]\nmax_num_seqs = 8\nquantization = "none"\n')
    s = load_settings({"ENCLAVE_HOME": str(tmp_path), "ENCLAVE_QUANTIZATION": "FP8"})
    assert s.engine == {"max_num_seqs": 8, "quantization": "fp8"}  # passed to Engine.from_pretrained as is


@pytest.mark.parametrize(
    ("table", "needle"),
    [("quantization = 8", "quantization must be one of none, fp8, got 8"), ("beams = 4", "beams")],
)
def test_bad_engine_options(tmp_path, table, needle):
    assert needle in refusal(tmp_path, toml=f"[engine]\n{table}\n")


def test_engine_table_is_the_engines_options(tmp_path):
    """[engine] takes every flat option of engine.options (the single source) but the top-level device and
    dtype, and each reaches Engine.from_pretrained's keywords as the engine parses it."""
    names = {f.name for f in EngineOptions.flat_fields()} - {"device", "dtype"}
    assert {f.name for f in engine_fields()} == names
    given = {
        "max_num_seqs": 32, "max_num_batched_tokens": 4096, "max_model_len": 2048, "async_scheduling": False,
        "kv_cache_memory": 1 << 30, "gpu_memory_utilization": 0.5, "block_size": 32, "max_prefixes": 2,
        "cuda_graphs": False, "graph_capture_len": 512, "num_speculative_tokens": 2, "mtp_hidden": "raw",
        "quantization": "fp8", "warm_up": True, "kv_cache_dtype": "fp8", "long_prefill_chunk": 8192,
        "draft_head": "fp8", "state_dtype": "bfloat16", "draft_vocab": 32768,
    }  # fmt: skip
    assert set(given) == names
    toml = "[engine]\n" + "".join(
        f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}\n" for k, v in given.items()
    )
    toml = toml.replace("'", '"')
    (tmp_path / "enclave.toml").write_text(toml)
    assert load_settings({"ENCLAVE_HOME": str(tmp_path)}).engine == given


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, 1e12, True])
def test_limits_made_in_code_are_checked_too(bad):
    with pytest.raises(ValidationError):
        Limits(lease_seconds=bad)


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from([v for v, *_ in NUMERIC]),
    value=st.one_of(st.text(max_size=30), st.floats().map(repr), st.integers().map(str)),
)
def test_any_text_loads_in_range_or_is_refused_in_one_line(tmp_path_factory, name, value):
    home = tmp_path_factory.getbasetemp()
    low, high = next((lo, hi) for v, _, _, lo, hi in NUMERIC if v == name)
    try:
        s = load_settings({"ENCLAVE_HOME": str(home), name: value})
    except SettingsError as exc:
        assert str(exc).startswith(f"{name} must be ") and "\n" not in str(exc)
        return
    loaded = [getattr(s.limits, f.name) for f in fields(Limits)] + list(s.engine.values())
    assert all(math.isfinite(x) for x in loaded)
    if value:  # empty: unset, the default
        key = name.removeprefix("ENCLAVE_").lower()
        assert low <= (getattr(s.limits, key, None) or s.engine[key]) <= high


def test_home_given_wins_over_the_environment(tmp_path):
    (tmp_path / "given").mkdir()
    (tmp_path / "given" / "enclave.toml").write_text("[limits]\nmax_attempts = 7\n")
    s = load_settings({"ENCLAVE_HOME": str(tmp_path / "other")}, home=tmp_path / "given")
    assert s.home == tmp_path / "given" and s.limits.max_attempts == 7


def test_passphrases_come_from_the_environment_only_and_are_never_shown(tmp_path):
    env = {"ENCLAVE_HOME": str(tmp_path), "ENCLAVE_SERVICE_PASSPHRASE": "hunter2"}
    s = load_settings(env)
    assert s.passphrase("service") == b"hunter2" and s.passphrase("client") is None
    assert "hunter2" not in repr(s)
    assert "'service_passphrase'" in refusal(tmp_path, toml='service_passphrase = "hunter2"\n')


def test_migrations_folder_must_hold_alembic_env(tmp_path):
    from pipeline.migrate import MIGRATIONS

    s = load_settings({"ENCLAVE_HOME": str(tmp_path), "ENCLAVE_MIGRATIONS": str(MIGRATIONS)})
    assert s.migrations == MIGRATIONS
    message = refusal(tmp_path, {"ENCLAVE_MIGRATIONS": str(tmp_path)})
    assert message.startswith("ENCLAVE_MIGRATIONS must be a folder holding Alembic's env.py, got '/")
