"""The log file: JSON lines when asked for, rotated by size, and shared by processes: a writer whose file was
rotated away by another reopens the new one instead of writing into the rotated file."""

import json
import logging
import sys
from pathlib import Path

from pipeline.logs import JsonFormatter, SharedRotatingFileHandler, configure
from pipeline.settings import load_settings


def record(message: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("enclave.worker", level, __file__, 1, message, None, None)


def test_json_lines_are_one_object_each_with_the_exception_stack():
    line = JsonFormatter().format(record("job 1 shard 0: 2 documents"))
    data = json.loads(line)
    assert data["message"] == "job 1 shard 0: 2 documents" and data["level"] == "INFO"
    assert data["logger"] == "enclave.worker" and data["time"].endswith("+00:00")
    try:
        raise KeyError("k")
    except KeyError:
        failed = record("failed", logging.ERROR)
        failed.exc_info = sys.exc_info()
    assert "KeyError" in json.loads(JsonFormatter().format(failed))["exception"]


def test_two_writers_share_one_rotated_file(tmp_path):
    file = tmp_path / "enclave.log"
    first = SharedRotatingFileHandler(file, max_bytes=400, backups=3)
    second = SharedRotatingFileHandler(file, max_bytes=400, backups=3)  # another process, in effect
    for handler in (first, second):
        handler.setFormatter(logging.Formatter("%(message)s"))
    for i in range(40):
        (first if i % 2 else second).emit(record(f"line {i:02d} " + "x" * 20))
    first.close()
    second.close()
    files = sorted(tmp_path.glob("enclave.log*"))
    names = {f.name for f in files} - {"enclave.log.lock"}
    assert names == {"enclave.log", "enclave.log.1", "enclave.log.2", "enclave.log.3"}
    assert all(f.stat().st_size <= 400 for f in files)
    # Nothing was written into a rotated file after the rotation: the newest lines are in the current file.
    current = (tmp_path / "enclave.log").read_text().splitlines()
    assert current[-1].startswith("line 39")
    kept = [line for f in files if f.name != "enclave.log.lock" for line in f.read_text().splitlines()]
    numbers = sorted(int(line.split()[1]) for line in kept)
    assert numbers == list(range(numbers[0], 40))  # the most recent lines, none lost in between


def test_configure_writes_json_to_the_home_log(tmp_path: Path):
    settings = load_settings({"ENCLAVE_HOME": str(tmp_path), "ENCLAVE_LOG_FORMAT": "json"})
    file = configure(settings)
    logging.getLogger("enclave.test").info("hello %d", 3)
    for handler in logging.getLogger().handlers:
        handler.flush()
    assert json.loads(file.read_text().splitlines()[-1])["message"] == "hello 3"
    logging.basicConfig(force=True)
