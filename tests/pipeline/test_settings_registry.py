"""The registries of ENCLAVE_* variables (pipeline/settings.py, engine/env.py) are complete and the only
readers of the environment, and the README's settings table is theirs exactly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.env import VARIABLES as ENGINE_VARIABLES
from pipeline.settings import (
    TABLE_END,
    TABLE_START,
    SettingsError,
    load_settings,
    readme_with_table,
    settings_table,
    variables,
)

ROOT = Path(__file__).resolve().parents[2]
REGISTRIES = {ROOT / "engine" / "env.py", ROOT / "pipeline" / "settings.py"}
# Reading the environment, by any spelling: os.environ, os.getenv, `from os import environ`.
READS_ENVIRONMENT = re.compile(r"os\.environ|getenv|from os import .*\benviron\b")


class Recording(dict):
    """An environment that notes which variables were asked for."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.asked.add(key)
        return super().__contains__(key)


def readme_names() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.partition(TABLE_START)[2].partition(TABLE_END)[0]
    return re.findall(r"^\| `(ENCLAVE_[A-Z0-9_]+)` \|", table, flags=re.MULTILINE)


def test_the_readme_lists_exactly_the_registries_variables():
    names = readme_names()
    registered = [v.name for v in variables()] + [v.name for v in ENGINE_VARIABLES]
    assert len(set(registered)) == len(registered), "a variable is registered twice"
    assert len(set(names)) == len(names), "a variable is listed twice in the README"
    assert set(names) == set(registered), {
        "in the README only": sorted(set(names) - set(registered)),
        "registered only": sorted(set(registered) - set(names)),
    }


def test_the_readme_table_is_the_generated_one():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_with_table(text) == text, "run `python -m pipeline.settings --readme README.md`"


def test_the_table_has_one_documented_row_per_variable():
    rows = settings_table().splitlines()[2:]
    assert len(rows) == len(variables()) + len(ENGINE_VARIABLES)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 5 and cells[0].startswith("`ENCLAVE_") and all(cells[2:]), row


def test_readme_without_the_markers_is_refused():
    with pytest.raises(SettingsError, match="settings table"):
        readme_with_table("# A README without a table\n")


def test_load_settings_reads_exactly_the_registered_variables(tmp_path):
    env = Recording(ENCLAVE_HOME=str(tmp_path))
    load_settings(env)
    assert {name for name in env.asked if name.startswith("ENCLAVE_")} == {v.name for v in variables()}


@pytest.mark.parametrize("var", [v.name for v in variables()], ids=str)
def test_each_registered_variable_takes_effect_or_is_refused_by_name(tmp_path, var):
    """A registered variable set to a stray value changes the settings, or the refusal names it."""
    env = {"ENCLAVE_HOME": str(tmp_path / "home")}
    before = load_settings(env)
    try:
        after = load_settings({**env, var: str(tmp_path / "x")})
    except SettingsError as exc:
        assert str(exc).startswith(f"{var} must be "), exc
        return
    assert after != before


def test_the_environment_is_read_only_by_the_registries():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in ("engine", "pipeline", "jobs")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path not in REGISTRIES
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if READS_ENVIRONMENT.search(line)
    ]
    assert not found, "read the variable through engine/env.py or pipeline/settings.py:\n" + "\n".join(found)
