"""Constrained decoding with llguidance: a `Constraint` compiled against the vocabulary, one matcher per
request, and the step's token bitmask filled on the host and applied to the logits before sampling.

llguidance was chosen over xgrammar after measuring both on this project's CPU (docs/PERFORMANCE.md,
2026-12-04 CPU entry). xgrammar 0.2.9 fills masks faster (mean 121 against 172 us per mask on the same
token streams under a mid-size schema; 5.6 against 12 ms for 256 rows on 2 threads), but it lets raw
control characters (U+0000-U+001F) into JSON strings that carry minLength or maxLength, so its output is not
always JSON; llguidance keeps them out, compiles a schema in 2 ms (xgrammar 36), and is one wheel without
dependencies.

The grammar library is imported on the first constrained request only: an engine that serves none needs it
not installed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine import kernels
from engine.constraints import Constraint
from engine.errors import RequestError
from engine.sampler import to_device
from engine.tokenizer import Tokenizer

MAX_COMPILED = 64  # distinct constraints kept compiled (a job's documents share one)
PARALLEL_FILL_ROWS = 8  # from this many rows a step's masks are filled by a pool (FILL_POOL), GIL released
# Threads that fill a large step's masks, and as many independent copies ("lexer groups") of each compiled
# grammar. llguidance's `LLMatcher.deep_copy` shares the original's lexer, behind one mutex that a mask
# computation holds throughout (its earley/parser.rs: `Parser.shared: Arc<Mutex<..>>`, taken by
# `compute_bias`; only the Rust-side `deep_clone` copies it, and Python's `deep_copy` calls `clone`). So the
# matchers of one schema, all copies of one compiled matcher, filled one at a time whatever the pool: that is
# why no thread count helped on either GPU host (docs/PERFORMANCE.md, fourth and fifth sessions: 256 masks in
# 14.3 ms on 1 thread and 22.9 on 8 on the H100's host; 22.6 and 20.8-24.5 on the H200's). Now each group is
# compiled on its own, a request's matcher copies its group's (round robin), and each thread fills one
# group's rows. Half the cores, at most 8: the engine's own thread keeps one. Unmeasured on a GPU host.
FILL_THREADS = min(8, max(1, (os.cpu_count() or 1) // 2))
# Which pool fills a large step's masks: "llguidance" (its LLExecutor, rayon threads over the rows sorted by
# group, no GIL taken between rows; a thread that steals rows of another group may wait on that group's lexer)
# or "python" (a thread per group calling each of its matchers, the GIL taken and released around every
# row: no two threads ever share a lexer). On this project's 2-core VM neither gains from a second thread even
# with independent lexers (two processes filling half the rows each were as slow: the cores share whatever
# the trie walk is bound by there); with one shared lexer two threads were 29% slower than one.
FILL_POOLS = ("llguidance", "python")
FILL_POOL = "llguidance"
# One-line JSON with OpenAI's separators and no free whitespace: a wandering model cannot loop on blanks.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise RequestError(
            "constrained output needs the llguidance package; install it with `pip install llguidance`"
        ) from None
    return llguidance


@dataclass
class FillStats:
    """What the mask fills of one compiler took on the host: the bench's (k) reports it beside the step
    time, so a constrained step slower than its forward pass shows whether the fill is why."""

    calls: int = 0
    rows: int = 0
    seconds: float = 0.0
    max_seconds: float = 0.0

    def add(self, rows: int, seconds: float) -> None:
        self.calls += 1
        self.rows += rows
        self.seconds += seconds
        self.max_seconds = max(self.max_seconds, seconds)


class GrammarCompiler:
    """Compiles constraints for one vocabulary (built on first use from the tokenizer, padded to the model's
    `vocab_size`, with `stop_ids` as the grammar's end) and keeps the last MAX_COMPILED. Thread-safe:
    requests are compiled in the submitting thread, not in the engine's loop."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_ids: list[int],
        threads: int = FILL_THREADS,
        pool: str = FILL_POOL,
        groups: int | None = None,
    ) -> None:
        if not stop_ids:
            raise RequestError("constrained output needs the model's end-of-sequence token (eos_token_id)")
        if pool not in FILL_POOLS:
            raise ValueError(f"the fill pool is one of {', '.join(FILL_POOLS)}, not {pool!r}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.threads = threads
        self.pool = pool
        # Lexer groups: one per fill thread unless given (1: every request copies one compiled matcher, all
        # sharing its lexer, as before 2026-12-05; `benchmarks/grammar_fill.py --groups 1` times that)
        self.groups = groups or threads
        self._lock = threading.Lock()
        self._vocabulary: Any = None
        self._executor: Any = None
        # Per constraint, one compiled matcher per lexer group (compiled on the group's first request).
        self._compiled: OrderedDict[str, list[Any]] = OrderedDict()
        self._next_group = 0
        self.fill_stats = FillStats()

    def state(self, constraint: Constraint) -> GrammarState:
        """A fresh matcher for `constraint`, in the next lexer group; `RequestError` (one line) when it cannot
        be compiled."""
        with self._lock:
            group = self._next_group
            self._next_group = (group + 1) % self.groups
        return GrammarState(self._compile(constraint, group).deep_copy(), self, group)

    def fill(self, states: list[GrammarState], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill `bitmask[rows[i]]` (host int32, contiguous) with the tokens `states[i]` allows next; from
        PARALLEL_FILL_ROWS rows on, in the `pool` of `threads` threads (the GIL released while they fill)."""
        llg = _llguidance()
        width = bitmask.shape[1] * 4
        start = time.perf_counter()
        pairs = [(state.matcher, row) for state, row in zip(states, rows, strict=True)]
        if len(states) < PARALLEL_FILL_ROWS:
            _fill_rows(pairs, bitmask, width)
        elif self.pool == "python":
            with self._lock:
                self._executor = self._executor or ThreadPoolExecutor(self.threads, "grammar-fill")
            # A thread per group's rows; with fewer groups than threads, the rows dealt out in turn.
            parts: list[list[tuple[Any, int]]] = [[] for _ in range(self.threads)]
            by_group = self.groups >= self.threads
            for j, (state, pair) in enumerate(zip(states, pairs, strict=True)):
                parts[(state.group if by_group else j) % self.threads].append(pair)
            work = [self._executor.submit(_fill_rows, part, bitmask, width) for part in parts if part]
            for done in work:
                done.result()
        else:
            with self._lock:
                self._executor = self._executor or llg.LLExecutor(self.threads)
            # By group: rayon hands out runs of the list, so a thread's rows mostly share one lexer.
            order = sorted(range(len(pairs)), key=lambda i: states[i].group)
            grouped = [pairs[i] for i in order]
            self._executor.unsafe_compute_mask_ptr(grouped, bitmask.data_ptr(), width, bitmask.shape[0])
        self.fill_stats.add(len(states), time.perf_counter() - start)

    def _compile(self, constraint: Constraint, group: int = 0) -> Any:
        """Lexer group `group`'s compiled matcher for `constraint` (compiled now if it has none)."""
        key = constraint.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                if compiled[group] is not None:
                    return compiled[group]
            vocabulary = self._vocabulary = self._vocabulary or self._new_vocabulary()
        llg = _llguidance()
        matcher = llg.LLMatcher(vocabulary, _grammar(llg, constraint), log_level=0)
        if matcher.is_error():
            reason = " ".join(matcher.get_error().split())[:200]
            raise RequestError(f"the {constraint.kind} constraint cannot be compiled: {reason}")
        with self._lock:
            groups = self._compiled.setdefault(key, [None] * self.groups)
            if groups[group] is None:  # else a racing thread's came first
                groups[group] = matcher
            matcher = groups[group]
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return matcher

    def _new_vocabulary(self) -> Any:
        backend = self.tokenizer.backend
        return _llguidance().LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=self.stop_ids)


def _fill_rows(pairs: list[tuple[Any, int]], bitmask: torch.Tensor, width: int) -> None:
    """Each (matcher, row): the row's mask, one llguidance call each (it releases the GIL while it fills)."""
    base = bitmask.data_ptr()
    for matcher, row in pairs:
        matcher.unsafe_compute_mask_ptr(base + row * width, width)


def _grammar(llg: Any, constraint: Constraint) -> str:
    """llguidance's grammar text for a constraint."""
    if constraint.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(constraint.spec, defaults=JSON_OPTIONS)
    if constraint.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if constraint.kind == "regex":
        return llg.LLMatcher.grammar_from_regex(constraint.spec)
    # choice: a Lark alternation of string literals (JSON's escapes are Lark's)
    literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in constraint.spec)
    return llg.LLMatcher.grammar_from_lark(f"start: {literals}")


@dataclass
class GrammarState:
    """One request's matcher: where its output stands in the grammar."""

    matcher: Any
    compiler: GrammarCompiler  # fills masks for every state it made, in parallel for large batches
    group: int = 0  # the compiler's lexer group whose compiled matcher this one copies (shares its lexer)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False, and the state unchanged, when the grammar does not allow it."""
        return self.matcher.try_consume_tokens([token]) == 1

    def rollback(self, count: int) -> None:
        if count:
            self.matcher.rollback(count)

    @property
    def done(self) -> bool:
        """Nothing can follow: the output is complete (only a stop token is allowed) or its stop was taken."""
        return bool(self.matcher.is_stopped())


def allocate_bitmask(rows: int, vocab_size: int, pin: bool) -> torch.Tensor:
    """A host int32 bitmask [rows, ceil(V / 32)], all allowed; pinned for asynchronous copies to CUDA."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set `logits[r, t]` to -inf for each row r in `rows` and token t whose bit is 0. `bitmask` [R, W]
    int32 is on the logits' device: bit t % 32 of word t // 32 is token t (`kernels.apply_token_bitmask`,
    one launch on CUDA)."""
    kernels.apply_token_bitmask(logits, bitmask, to_device(rows, torch.long, logits.device))
