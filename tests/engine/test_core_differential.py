"""A randomised differential test of the serving core: seeded workloads against one-at-a-time decoding.

Each seed draws a workload (4-12 requests: random prompt lengths up to several prefill chunks, shared
prefixes, staggered arrivals, priorities, max_tokens, stop ids and strings, log-probs, penalties, logit
bias, JSON-schema / regex / choice constraints, reasoning blocks, seeded sampling, aborts mid-generation)
and an engine configuration (max_num_seqs, a token budget that chunks prefills, block size, a KV pool small
enough to preempt, prefix entries, asynchronous scheduling, speculation k 0-3 fixed or adaptive with the MTP
head). The core is stepped by hand, as the engine's loop does (arrivals, then aborts, then one step), so
every run is deterministic and a failure names its seed.

The reference is the plain synchronous engine running each request alone, without speculation or prefix.
Every other configuration must give the same token ids, text, finish and stop reasons and reasoning split,
and log-probs within LOGPROB_TOL. Seeded sampled requests are compared exactly only without speculation
(rejection sampling draws other tokens from the same distribution); with it they are only checked to be
well formed. Constrained outputs that the grammar ended must also pass an independent validator
(jsonschema, re.fullmatch, membership), and an aborted request's tokens must start the reference's. Every
token read is counted once (`generated_tokens`). After every workload the pools must be idle: no waiting or
running sequence, no prefix users or fillers, and once the idle prefix entries are evicted every slot and
KV block free, every reference count zero.

Numerics. Batching, chunking and recompute change fp32 rounding only (~1e-5 in the hidden state), and the
tokens are compared exactly, as tests/engine/test_serving.py does for batched against lone decoding. Two
kinds of near-tie break that, rarely (about once in 700 seeds each):
- two tokens' logits equal to ~1e-6 (seed 208, request 3: after a preemption the recompute picks the other
  one, 1e-6 apart). A greedy request that leaves the reference there is accepted when the reference scores
  the token taken within TIE_TOL of its own (`tied`); the rest of its output is not compared.
- two experts' router logits equal to ~1e-6: rounding routes the token to the other expert and its hidden
  state moves by O(1). Seen once, in log-probs only (0.09, same tokens: a 41-token prompt computed in
  7-token chunks, layer 0 router logits 0.1672 and 0.1672 at position 4). Not detected here: a new seed
  that fails on log-probs, or on tokens not `tied`, must be checked for one (run the request alone with the
  failing run's chunking) before it is called a bug. Of the seeds below only 208 meets a tie (the first
  kind, kept so that `tied` runs).

Most speculative workloads run on an "echo" copy of the demo checkpoint (see `echo_dir`), whose MTP head
guesses right about half the time, so accepted runs, state commits and stops inside them are exercised, not
only rejections (the demo's random head is almost never right).
"""

from __future__ import annotations

import itertools
import random
import shutil
from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, SamplingParams
from engine.cache import block_bytes, slot_bytes
from engine.config import load_config
from engine.constraints import Constraint
from engine.env import reset_engine_env
from engine.outputs import RequestOutput
from engine.sequence import PENDING
from tests.engine.test_constrained import CHOICES, PATTERN, check

SEEDS = [*range(20), 208]
SMALL_RECORD = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
CONSTRAINTS = [Constraint.json_schema(SMALL_RECORD), Constraint.regex(PATTERN), Constraint.choice(CHOICES)]
ECHO_EPS = 0.1  # the layers' share of the residual stream in the echo model: ~45% of drafts accepted
TIE_TOL = 1e-4  # reference log-probs of two tokens this close: rounding may pick either (see Numerics)
LOGPROB_TOL = 1e-3  # fp32 rounding of batch shapes, chunks and recompute: up to ~1e-4 measured


@pytest.fixture(scope="module")
def echo_dir(demo_dir, tmp_path_factory):
    """The demo checkpoint with every layer's output scaled by ECHO_EPS, the final norms plain and the MTP
    head's fc passing the next token's embedding through: the main model then mostly predicts a fixed
    function of the current token, and the head the same function of the next one (so its drafts are often
    right), while the layers' share still makes the output depend on the context and the cached state."""
    path = tmp_path_factory.mktemp("echo-model")
    for f in demo_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, path / f.name)
    tensors = load_file(str(demo_dir / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * ECHO_EPS
    for name in ("model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight"):
        tensors[name] = torch.zeros_like(tensors[name])
    fc = tensors["mtp.fc.weight"]
    h = fc.shape[0]
    tensors["mtp.fc.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1).to(fc.dtype)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


# ---- workloads


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    prefix: list[int] | None = None
    priority: int = 0
    arrive: int = 0  # the loop iteration it is submitted at
    abort_after: int | None = None  # abort once it has this many tokens read (0: at its arrival + 2 steps)


@dataclass
class Config:
    model: str  # "demo" or "echo"
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_chunk: int | None
    block_size: int
    num_blocks: int
    max_prefixes: int
    async_scheduling: bool
    k: int  # most drafts per step (0: no speculation)
    adaptive: bool
    mtp_hidden: str = "normed"
    draft_head: str = "model"

    @property
    def speculates(self) -> bool:
        return self.k > 0


@dataclass
class Workload:
    config: Config
    requests: list[Request] = field(default_factory=list)


def draw_config(rng: random.Random) -> Config:
    k = rng.choice([0, 0, 1, 2, 3])
    adaptive = k > 0 and rng.random() < 0.4
    asynchronous = rng.random() < 0.5  # with a fixed k the engine stays synchronous whatever is asked
    batched = rng.choice([8, 12, 16, 24, 64, 256])
    return Config(
        model="echo" if k and rng.random() < 0.7 else rng.choice(["demo", "echo"]),
        max_model_len=rng.choice([8192, 8192, 96]),
        max_num_seqs=rng.choice([1, 2, 3, 4, 8]),
        max_num_batched_tokens=batched,
        long_prefill_chunk=rng.choice([None, None, 4 * batched]),
        block_size=rng.choice([4, 8, 16]),
        num_blocks=0,  # sized once the requests are drawn
        max_prefixes=rng.choice([0, 1, 2, 4]),
        async_scheduling=asynchronous,
        k=k,
        adaptive=adaptive,
        mtp_hidden=rng.choice(["normed", "normed", "raw"]),
        draft_head=rng.choice(["model", "model", "fp8"]),  # drafts scored in e4m3; verification exact
    )


def draw_params(rng: random.Random, vocab: int, think_end: int, eos: int) -> tuple[SamplingParams, bool]:
    """Random sampling parameters, and whether the prompt should open a reasoning block."""
    kw: dict = {"max_tokens": rng.randint(1, 32), "temperature": 0.0, "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.15:
        kw |= {"temperature": 0.8, "top_k": rng.choice([0, 40]), "top_p": rng.choice([1.0, 0.9])}
        kw["seed"] = rng.randrange(1000)
    if rng.random() < 0.15:
        kw["logprobs"] = rng.choice([0, 1, 3])
    if rng.random() < 0.15:
        kw["presence_penalty"] = rng.choice([0.0, 0.5, 1.5])
        kw["frequency_penalty"] = rng.choice([0.0, 0.7])
    if rng.random() < 0.15:
        kw["logit_bias"] = {rng.randrange(vocab): rng.choice([-100.0, 4.0, 8.0]) for _ in range(2)}
    if not kw["ignore_eos"] and rng.random() < 0.5:
        kw["logit_bias"] = {**(kw.get("logit_bias") or {}), eos: rng.choice([2.0, 4.0])}  # EOS is met
    if rng.random() < 0.1:
        kw["skip_special_tokens"] = False
    if rng.random() < 0.2:
        kw |= {"constraint": rng.choice(CONSTRAINTS), "max_tokens": rng.randint(8, 48)}
    opens = rng.random() < 0.1
    if opens:
        bias = dict(kw.get("logit_bias") or {})
        bias[think_end] = rng.choice([0.0, 6.0, 100.0])  # may close the block, then the answer follows
        kw |= {"split_reasoning": True, "logit_bias": bias}
    return SamplingParams(**kw), opens


def draw_workload(seed: int, vocab: int, think: tuple[int, int], eos: int) -> Workload:
    rng = random.Random(seed)
    config = draw_config(rng)
    tokens = lambda n: [rng.randrange(5, vocab) for _ in range(n)]  # noqa: E731  (ids 0-4: special tokens)
    prefixes = [tokens(rng.randint(2, 40)) for _ in range(rng.randint(0, 2))]
    if prefixes and rng.random() < 0.3:  # one prefix extending another: two entries, the same first tokens
        prefixes.append(prefixes[0] + tokens(rng.randint(1, 20)))
    workload = Workload(config)
    for _ in range(rng.randint(4, 12)):
        params, opens = draw_params(rng, vocab, think[1], eos)
        length = rng.choice([rng.randint(1, 5), rng.randint(6, 40), rng.randint(41, 80)])
        prompt = tokens(length)
        prefix = None
        if prefixes and rng.random() < 0.5:
            prefix = rng.choice(prefixes)
            prompt = prefix + prompt[: rng.choice([0, 1, length])]  # the prompt may be the prefix itself
        if opens:
            prompt = [*prompt, think[0]]
        prompt = prompt[: config.max_model_len - 8]
        if config.max_model_len < 8192 and rng.random() < 0.2:
            params = replace(params, max_tokens=None)  # until the context ends it
        request = Request(prompt, params, prefix if rng.random() < 0.9 else None)
        request.priority = rng.choice([0, 0, 0, 1, -1])
        request.arrive = rng.choice([0, 0, 0, rng.randint(1, 40)])
        if rng.random() < 0.15:
            request.abort_after = rng.randint(0, max(0, (params.max_tokens or 16) - 1))
        workload.requests.append(request)
    config.num_blocks = pool_blocks(workload) + rng.choice([0, 1, 3, 1000])
    return workload


def add_stops(workload: Workload, rng: random.Random, pilot) -> None:
    """Give some requests a stop id or string taken from their own output (`pilot`: a reference run),
    so stops are really met, at a random place."""
    for request in workload.requests:
        if rng.random() >= 0.3:
            continue
        out = pilot(request)
        at = rng.randrange(len(out.token_ids))
        if rng.random() < 0.5:
            request.params = replace(request.params, stop_token_ids=[out.token_ids[at]])
        elif out.text and out.text.strip():
            start = rng.randrange(len(out.text))
            request.params = replace(request.params, stop=[out.text[start : start + rng.randint(1, 3)]])


def limit(request: Request, context: int) -> int:
    """The most tokens the request may generate."""
    return min(request.params.max_tokens or context, context - len(request.prompt))


def pool_blocks(workload: Workload) -> int:
    """The fewest KV blocks that hold any one request at its longest beside every prefix entry, so that
    nothing ends early for want of room (the reference would not), while running sequences are preempted."""
    c = workload.config
    blocks = lambda positions: -(-positions // c.block_size)  # noqa: E731
    longest = max(blocks(len(r.prompt) + limit(r, c.max_model_len) + 2 * c.k + 1) for r in workload.requests)
    prefixes = {tuple(r.prefix) for r in workload.requests if r.prefix}
    return longest + sum(blocks(len(p)) for p in prefixes)


# ---- engines and the loop


def build(path, config: Config) -> Engine:
    """The configuration's engine, with a KV pool of `config.num_blocks` blocks (fewer when more would exceed
    what max_num_seqs sequences of max_model_len positions could use)."""
    model = load_config(path)
    per_slot = slot_bytes(model, torch.float32)
    per_block = block_bytes(model, torch.float32, config.block_size, 1 if config.k else 0)
    slots = config.max_num_seqs * (1 + config.k) + config.max_prefixes  # k verify scratch slots each
    e = Engine.from_pretrained(
        path,
        device="cpu",
        dtype="float32",
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        long_prefill_chunk=config.long_prefill_chunk,
        block_size=config.block_size,
        max_prefixes=config.max_prefixes,
        kv_cache_memory=slots * per_slot + config.num_blocks * per_block,
        num_speculative_tokens=config.k,
        async_scheduling=config.async_scheduling,
        mtp_hidden=config.mtp_hidden,
        draft_head=config.draft_head,
    )
    assert e.adaptive_speculation == config.adaptive
    return e


@dataclass
class Run:
    outputs: dict[int, RequestOutput]  # finished requests
    aborted: dict[int, list[int]]  # aborted requests: the tokens read before and after the abort
    steps: int


def drive(engine: Engine, requests: dict[int, Request]) -> Run:
    """Step the engine's core by hand as its loop would: submit arrivals, apply due aborts, step."""
    core, arrivals = engine.core, itertools.count()
    counted = core.generated_tokens
    queue = sorted(requests, key=lambda i: requests[i].arrive)
    seqs, outputs, aborted = {}, {}, {}
    step = 0
    while queue or core.has_work():
        while queue and requests[queue[0]].arrive <= step:
            i = queue.pop(0)
            r = requests[i]
            seq = engine._sequence(i, r.prompt, r.params, False, r.priority, r.prefix)
            seq.arrival = next(arrivals)
            core.add(seq)
            seqs[i] = seq
        for i, seq in seqs.items():
            due = requests[i].abort_after
            if due is None or i in outputs or i in aborted:
                continue
            read = len(seq.output_ids) - seq.num_pending
            if (due and read >= due) or (not due and step >= requests[i].arrive + 2):
                core.abort(seq)
                aborted[i] = seq
        if core.has_work():
            for seq in core.step():
                assert seq.index not in outputs, f"request {seq.index} finished twice"
                outputs[seq.index] = seq.to_output()
        step += 1
        assert step < 5000, "the engine stopped making progress"
    tokens = {i: [t for t in s.output_ids if t != PENDING] for i, s in aborted.items()}
    # Every token read counts once: a preempted request's are not counted again when recomputed, and a
    # token read for a request after its abort (asynchronous scheduling) is counted and kept.
    read = sum(len(o.token_ids) for o in outputs.values()) + sum(map(len, tokens.values()))
    assert core.generated_tokens - counted == read
    return Run(outputs, tokens, step)


def assert_idle(engine: Engine) -> None:
    """No request left anywhere, and every slot, block and prefix entry back to the pools' idle state."""
    core = engine.core
    s = core.scheduler
    assert not core.has_work() and not s.waiting and not s.running
    assert not s.prefixes.users, f"prefix users left: {s.prefixes.users}"
    assert all(e.ready for e in s.prefixes.entries.values()), "a prefix filler was left behind"
    held = len(s.prefixes.entries)
    assert core.slots.num_slots - core.slots.num_free == held  # one slot per cached prefix, nothing else
    while s.prefixes.evict_one():
        pass
    assert not s.prefixes.entries
    assert core.slots.num_free == core.slots.num_slots
    assert sorted(core.slots._free) == list(range(core.slots.num_slots))  # no slot freed twice
    assert core.blocks.num_free == core.blocks.num_blocks
    assert not any(core.blocks._refs), "a KV block is still referenced"


def summary(out: RequestOutput) -> tuple:
    return (
        out.token_ids,
        out.finish_reason,
        out.stop_reason,
        out.text,
        out.reasoning,
        out.reasoning_finished,
    )


def assert_logprobs_close(got, want, where: str) -> None:
    assert (got is None) == (want is None), where
    if want is None:
        return
    assert len(got) == len(want), where
    for position, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), f"{where} position {position}"
        for token in b:
            assert abs(a[token] - b[token]) <= LOGPROB_TOL, f"{where} position {position} token {token}"


def assert_well_formed(request: Request, out: RequestOutput, stop_ids: frozenset[int], context: int) -> None:
    """What any output must satisfy, whatever its tokens."""
    p = request.params
    assert PENDING not in out.token_ids and out.token_ids
    assert len(out.token_ids) <= limit(request, context)
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "length":
        assert len(out.token_ids) == limit(request, context)
    ends = set(p.stop_token_ids) | (set() if p.ignore_eos else stop_ids)
    assert not ends & set(out.token_ids[:-1])
    if isinstance(out.stop_reason, int):
        assert out.token_ids[-1] == out.stop_reason
    # The grammar ended it: on its last token (stop_reason None) or its EOS. A stop id or string, or
    # max_tokens, may cut it anywhere.
    completed = out.stop_reason is None or out.stop_reason in stop_ids
    if p.constraint is not None and out.finish_reason == "stop" and out.reasoning_finished and completed:
        check(p.constraint, out.text)


# ---- the test


@pytest.fixture(scope="module")
def references(demo_dir, echo_dir):
    """One plain synchronous engine per (model, max_model_len), reused across workloads: it serves one
    request at a time and `alone` checks it idle after each."""
    engines: dict[tuple[str, int], Engine] = {}

    def get(model: str, max_model_len: int) -> Engine:
        if (model, max_model_len) not in engines:
            engines[model, max_model_len] = Engine.from_pretrained(
                demo_dir if model == "demo" else echo_dir,
                device="cpu",
                dtype="float32",
                max_model_len=max_model_len,
                num_speculative_tokens=0,
                async_scheduling=False,
            )
        return engines[model, max_model_len]

    yield get
    for e in engines.values():
        e.close()


def alone(engine: Engine, request: Request) -> RequestOutput:
    plain = replace(request, prefix=None, priority=0, arrive=0, abort_after=None)
    run = drive(engine, {0: plain})
    assert_idle(engine)
    return run.outputs[0]


def prepare(seed: int, references) -> tuple[Workload, list[RequestOutput]]:
    """The seed's workload and each request's output alone on the plain synchronous engine."""
    probe = references("demo", 8192)
    think, eos = (probe.think.start, probe.think.end), min(probe.config.eos_token_ids)
    workload = draw_workload(seed, probe.config.vocab_size, think, eos)
    config = workload.config
    reference = references(config.model, config.max_model_len)
    add_stops(workload, random.Random(seed + 1000), lambda r: alone(reference, r))
    return workload, [alone(reference, r) for r in workload.requests]


def serve(workload: Workload, path) -> Run:
    """The workload on its configuration's engine (ENCLAVE_SPECULATION=adaptive already set if wanted),
    checked idle afterwards."""
    engine = build(path, workload.config)
    try:
        run = drive(engine, dict(enumerate(workload.requests)))
        assert_idle(engine)
    finally:
        engine.close()
    return run


def tied(reference: Engine, request: Request, tokens: list[int], want: list[int]) -> bool:
    """Whether greedy `tokens` left the reference's `want` at a near-tie: at the first difference the token
    taken scored, in the reference, within TIE_TOL of the reference's own choice (scores: the raw log-probs
    with the request's bias and penalties, as test_penalties.py's reference computes them)."""
    p = request.params
    at = next((j for j, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), None)
    if not p.greedy or at is None:
        return False
    entry = alone(reference, replace(request, params=replace(p, logprobs=20))).logprobs[at]
    counts = Counter(want[:at])

    def score(token: int) -> float:
        shift = p.presence_penalty * (counts[token] > 0) + p.frequency_penalty * counts[token]
        return entry[token] + (p.logit_bias or {}).get(token, 0.0) - shift

    return tokens[at] in entry and score(want[at]) - score(tokens[at]) <= TIE_TOL


def compare(seed: int, workload: Workload, expected: list[RequestOutput], run: Run, references) -> None:
    """Each request's output against its lone reference (see the module docstring)."""
    config = workload.config
    reference = references(config.model, config.max_model_len)
    eos = reference.eos_token_ids
    for i, (request, want) in enumerate(zip(workload.requests, expected, strict=True)):
        where = f"seed {seed} request {i} ({config})"
        assert_well_formed(request, want, eos, config.max_model_len)
        exact = request.params.greedy or not config.speculates  # rejection sampling draws other tokens
        if i in run.aborted:
            got = run.aborted[i]
            same = got == want.token_ids[: len(got)]
            assert not exact or same or tied(reference, request, got, want.token_ids), where
            continue
        out = run.outputs[i]
        assert_well_formed(request, out, eos, config.max_model_len)
        if not exact or (
            out.token_ids != want.token_ids and tied(reference, request, out.token_ids, want.token_ids)
        ):
            continue
        assert summary(out) == summary(want), where
        assert_logprobs_close(out.logprobs, want.logprobs, where)


@pytest.mark.parametrize("seed", SEEDS)
def test_workload_equals_one_at_a_time(seed, monkeypatch, demo_dir, echo_dir, references):
    workload, expected = prepare(seed, references)
    if workload.config.adaptive:
        monkeypatch.setenv("ENCLAVE_SPECULATION", "adaptive")
        reset_engine_env()
    run = serve(workload, demo_dir if workload.config.model == "demo" else echo_dir)
    compare(seed, workload, expected, run, references)


def test_a_grammar_ended_by_eos_under_ignore_eos_keeps_the_eos_out_of_its_text(demo_engine):
    """Found by the workloads above (seed 17 and others): with ignore_eos the EOS is not a stop id, but the
    grammar still takes it as its end. That token ends the request as a stop token does (cut from `text`,
    named in stop_reason), not as the answer's last token: with skip_special_tokens=False the text was
    'NX-434<|im_end|>', which does not match the regex it was constrained to."""
    eos = min(demo_engine.config.eos_token_ids)
    constraint = Constraint.regex(PATTERN)
    outs = {}
    for ignore_eos in (False, True):
        params = SamplingParams(
            max_tokens=20,
            temperature=0.0,
            ignore_eos=ignore_eos,
            skip_special_tokens=False,
            constraint=constraint,
            logit_bias={eos: 30.0},  # the EOS as soon as the grammar allows it
        )
        out = demo_engine.generate(["Hello"], params)[0]
        assert out.token_ids[-1] == eos and out.finish_reason == "stop"
        check(constraint, out.text)
        outs[ignore_eos] = (out.token_ids, out.text, out.stop_reason)
    assert outs[True] == outs[False]
