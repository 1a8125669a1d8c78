"""Engine.abort: a request stops within a step or two, gives its slot and KV blocks back, fails its future
with RequestAborted, and leaves the requests batched with it exactly as they would have been without it."""

import time

import pytest

from engine import Engine, RequestAborted, SamplingParams

LONG = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 50, 51], [1, *range(100, 140)]]


def wait_until(predicate, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return False


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def engine(request, demo_dir):
    """The synchronous core and the asynchronous one (forced on the CPU), each with its own counters."""
    e = Engine.from_pretrained(demo_dir, device="cpu", dtype="float32", async_scheduling=request.param)
    yield e
    e.close()


def test_abort_stops_generation_within_two_steps_and_frees_slots_and_blocks(engine):
    future = engine.submit(PROMPTS[2], LONG)
    assert wait_until(lambda: engine.stats().generated_tokens >= 5)
    steps_before = engine.stats().steps
    assert engine.abort([future]) == 1
    with pytest.raises(RequestAborted):
        future.result(timeout=10)
    # The loop applies the abort before its next step; one step already launched may still count a token.
    stats = engine.stats()
    assert stats.steps - steps_before <= 2
    assert (stats.slots_used, stats.blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)
    assert stats.aborted_requests == 1
    generated = stats.generated_tokens
    time.sleep(0.2)
    assert engine.stats().generated_tokens == generated  # nothing runs any more
    assert generated < 4000


def test_neighbours_of_an_aborted_request_are_unchanged(engine):
    alone = [o.token_ids for o in engine.generate(PROMPTS[:2], SHORT)]
    doomed = engine.submit(PROMPTS[2], LONG)
    kept = [engine.submit(p, SHORT) for p in PROMPTS[:2]]
    assert wait_until(lambda: engine.stats().num_running == 3)
    engine.abort([doomed])
    assert [f.result(timeout=60).token_ids for f in kept] == alone
    with pytest.raises(RequestAborted):
        doomed.result(timeout=10)
    assert engine.stats().blocks_used == 0


def test_abort_of_queued_finished_and_unknown_requests(demo_dir):
    # One sequence at a time: the second request waits in the scheduler while the first runs.
    engine = Engine.from_pretrained(demo_dir, device="cpu", dtype="float32", max_num_seqs=1)
    try:
        done = engine.submit(PROMPTS[0], SHORT)
        done.result(timeout=60)
        running = engine.submit(PROMPTS[1], LONG)
        waiting = engine.submit(PROMPTS[2], LONG)
        assert wait_until(lambda: engine.stats().num_waiting == 1 and engine.stats().generated_tokens > 12)
        assert engine.abort([done, waiting]) == 1  # a finished request is left alone
        with pytest.raises(RequestAborted):
            waiting.result(timeout=10)
        assert not running.done() and done.result().finish_reason == "length"
        engine.abort([running])
        with pytest.raises(RequestAborted):
            running.result(timeout=10)
        assert engine.abort([running]) == 0  # aborting twice is harmless
        stats = engine.stats()
        assert (stats.slots_used, stats.blocks_used, stats.num_waiting) == (0, 0, 0)
        # the engine still serves after its requests were aborted
        assert len(engine.generate([PROMPTS[0]], SHORT)[0].token_ids) == 12
    finally:
        engine.close()


def test_abort_before_the_loop_takes_the_request(demo_engine):
    # Submitted and aborted under one acquisition of the engine's lock: it never reaches the core.
    with demo_engine._cond:
        future = demo_engine.submit(PROMPTS[0], LONG)
        assert demo_engine.abort([future]) == 1
    with pytest.raises(RequestAborted):
        future.result(timeout=10)
    assert demo_engine.stats().slots_used == 0


def test_stats_report_the_last_batch_size(demo_engine):
    futures = [demo_engine.submit(p, LONG) for p in PROMPTS]
    assert wait_until(lambda: demo_engine.stats().batch_size == 3)
    demo_engine.abort(futures)
    for f in futures:
        with pytest.raises(RequestAborted):
            f.result(timeout=10)
