"""Canary markers and the scanners that look for them in every place plaintext must never reach.

Each input field gets its own marker `CANARY-<run>-<tag>`: a hit names the field (its tag) and the place
(a table column, a file, a Redis key, a log). A marker is found in clear, whatever the letter case, and
inside the encodings that stores and brokers use on the way: hex, UTF-16 and base64 (Kombu carries
message bodies base64-encoded, so a plain byte search of the broker would miss them), one level inside
another.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import re
import uuid
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import redis
from sqlalchemy import create_engine, inspect, text

_TAG = re.compile(rb"[a-z0-9_]*")
_HEX = re.compile(rb"[0-9a-f]*")
_BASE64 = re.compile(rb"[A-Za-z0-9+/_-]{24,}={0,2}")
_MAX_FILE = 256 << 20  # bytes read of one file; larger files are named, not read


class Canaries:
    """Markers of one test run: `canaries("custom_id")` -> "CANARY-<run>-custom_id", remembered by tag."""

    def __init__(self) -> None:
        self.prefix = f"CANARY-{uuid.uuid4().hex}-"
        self.tags: set[str] = set()
        self._known: list[str] = []  # longest first: a tag is read up to where a known one ends
        self.numbers: dict[bytes, str] = {}  # numeric canaries (token ids, seeds...): decimal text -> tag

    def __call__(self, tag: str) -> str:
        assert re.fullmatch(r"[a-z0-9_]+", tag), tag
        self.tags.add(tag)
        self._known = sorted(self.tags, key=len, reverse=True)
        return self.prefix + tag

    def number(self, tag: str, digits: int = 13) -> int:
        """A numeric canary, for fields that must hold numbers; found by its decimal text."""
        self(tag)
        value = int(uuid.uuid4().int % 9 * 10 ** (digits - 1) + uuid.uuid4().int % 10 ** (digits - 1))
        value += 10 ** (digits - 1)
        self.numbers[str(value).encode()] = tag
        return value

    def tags_in(self, data: bytes | str, depth: int = 2) -> set[str]:
        """The tags of the markers in `data`, in any encoding above; "?" for a marker cut before its tag."""
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogatepass")
        tags = _tags_in(data, self.prefix.encode(), self.numbers, depth)
        return {self._known_tag(tag) for tag in tags}

    def _known_tag(self, read: str) -> str:
        """A tag as read from raw bytes may run on into the next field (`jobnamesummarize`)."""
        return next((tag for tag in self._known if read.startswith(tag)), read)


_HEAD = len("CANARY-") + 12  # a marker cut after this many characters is still found (as "?")


def _tags_in(data: bytes, prefix: bytes, numbers: dict[bytes, str], depth: int) -> set[str]:
    low = data.lower()
    found = _plain(low, prefix) | {tag for text, tag in numbers.items() if text in data}
    for encoding in ("utf-16-le", "utf-16-be"):
        for at in _positions(low, prefix[:_HEAD].lower().decode().encode(encoding)):
            window = data[at : at + 2 * (len(prefix) + 80)]
            found |= _plain(window.decode(encoding, "ignore").lower().encode(), prefix)
    for needle in {prefix[:_HEAD].hex().encode(), prefix[:_HEAD].lower().hex().encode()}:
        for at in _positions(low, needle):
            run = _HEX.match(low, at).group()
            found |= _plain(bytes.fromhex(run[: len(run) // 2 * 2].decode()).lower(), prefix)
    if depth > 0:
        for run in _BASE64.findall(data):
            for decoded in _base64_views(run):
                found |= _tags_in(decoded, prefix, numbers, depth - 1)
    return found


def _plain(low: bytes, prefix: bytes) -> set[str]:
    """Tags of the markers in lower-cased `low`."""
    prefix = prefix.lower()
    found = set()
    for at in _positions(low, prefix[:_HEAD]):
        whole = low.startswith(prefix, at)
        found.add((_TAG.match(low, at + len(prefix)).group().decode() if whole else "") or "?")
    return found


def _positions(data: bytes, needle: bytes) -> Iterable[int]:
    at = data.find(needle)
    while at >= 0:
        yield at
        at = data.find(needle, at + 1)


def _base64_views(run: bytes) -> Iterable[bytes]:
    """`run` decoded as base64 and URL-safe base64, from each of its first four offsets (a run may start
    with characters that are not part of the encoded value)."""
    run = run.rstrip(b"=")
    for start in range(4):
        part = run[start:]
        part += b"=" * (-len(part) % 4)
        for decode in (base64.b64decode, base64.urlsafe_b64decode):
            with contextlib.suppress(binascii.Error, ValueError):
                yield decode(part)


class Findings:
    """Where markers were found: place -> tags. `scan_*` add to it; `report()` lists it one line a place."""

    def __init__(self, canaries: Canaries) -> None:
        self.canaries = canaries
        self.places: dict[str, set[str]] = defaultdict(set)
        self.scanned: list[str] = []

    def scan(self, place: str, data: bytes | str | None) -> None:
        if data is None:
            return
        if tags := self.canaries.tags_in(data):
            self.places[place] |= tags

    def report(self) -> str:
        return "\n".join(f"{place}: {', '.join(sorted(tags))}" for place, tags in sorted(self.places.items()))

    def scan_tree(
        self, root: Path, label: str, skip: Iterable[Path] = (), since: float | None = None, deep: bool = True
    ) -> None:
        """Every regular file and every name under `root`, but for those under `skip`; with `since`, only
        files modified since then. Without `deep`, only files holding a marker in clear (ASCII or UTF-16,
        as written) are decoded further: fast enough for a shared /tmp of 100,000 files."""
        quick = [self.canaries.prefix[:_HEAD].encode(), self.canaries.prefix[:_HEAD].encode("utf-16-le")]
        root, skip = root.resolve(), [Path(p).resolve() for p in skip]
        self.scanned.append(f"{label}:{root}")
        for folder, dirs, files in os.walk(root, onerror=lambda _: None):
            here = Path(folder).resolve()
            if any(here == s or s in here.parents for s in skip):
                dirs.clear()
                continue
            for name in files:
                path = here / name
                try:
                    info = path.lstat()
                    if (
                        not path.is_file()
                        or path.is_symlink()
                        or (since is not None and info.st_mtime < since)
                    ):
                        continue
                    with open(path, "rb") as f:
                        data = f.read(_MAX_FILE)
                except OSError:
                    continue
                where = f"{label}:{path.relative_to(root)}"
                if deep or any(q in data for q in quick):
                    self.scan(where, data)
                self.scan(where + " (file name)", os.fsencode(name))
            for name in dirs:
                self.scan(f"{label}:{(here / name).relative_to(root)} (folder name)", os.fsencode(name))

    def scan_sql(self, url: str, label: str) -> dict[str, int]:
        """Every column of every row of every table, bytes decoded leniently (the scan reads raw bytes).
        Returns the rows read per table."""
        engine = create_engine(url)
        rows: dict[str, int] = defaultdict(int)
        try:
            with engine.connect() as c:
                for table in inspect(c).get_table_names():
                    self.scanned.append(f"{label}:{table}")
                    result = c.execute(text(f'SELECT * FROM "{table}"'))
                    columns = list(result.keys())
                    for row in result:
                        rows[table] += 1
                        for column, value in zip(columns, row, strict=True):
                            if value is not None:
                                raw = bytes(value) if isinstance(value, bytes | memoryview) else str(value)
                                self.scan(f"{label}:{table}.{column}", raw)
        finally:
            engine.dispose()
        return rows

    def scan_redis(self, client: redis.Redis, label: str) -> None:
        """Every key of the client's database: its name, its typed contents and its DUMP."""
        self.scanned.append(f"{label}:db{client.connection_pool.connection_kwargs.get('db')}")
        for key in client.scan_iter(count=1000):
            kind = client.type(key).decode()
            if kind == "string":
                values = [client.get(key)]
            elif kind == "list":
                values = client.lrange(key, 0, -1)
            elif kind == "hash":
                values = [k + b"=" + v for k, v in client.hgetall(key).items()]
            elif kind == "set":
                values = list(client.smembers(key))
            elif kind == "zset":
                values = [m for m, _ in client.zrange(key, 0, -1, withscores=True)]
            elif kind == "stream":
                values = [repr(entry).encode() for entry in client.xrange(key)]
            else:
                values = []
            values.append(client.dump(key) or b"")
            place = f"{label}:{key.decode(errors='replace')}"
            self.scan(place + " (key)", key)
            for value in values:
                self.scan(place, value or b"")
