"""`colossal_lab.measure.timing` helpers that need no GPU."""

from colossal_lab.measure import timing
from colossal_lab.measure.timing import in_turns


def test_in_turns_rotates_one_place_a_round():
    assert list(in_turns("abc", 4)) == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert list(in_turns([], 2)) == [[], []]


def test_time_kernels_tries_the_capture_again_before_falling_back(monkeypatch):
    """A capture that fails once and then succeeds (under the next capture mode) is
    graph replay ("cuda_graph"); one that fails every try falls back to events and
    says why, so `results.fell_back` flags the row for a rerun."""
    from colossal_lab.measure import results

    tries = []

    def flaky(fn, reps, capture_mode):
        tries.append((reps, capture_mode))
        if len(tries) < failures:
            raise RuntimeError("operation failed due to a previous error during capture")
        return timing._summary([1.0, 2.0, 3.0])

    monkeypatch.setattr(timing, "_on_cuda", lambda device: True)
    monkeypatch.setattr(timing, "time_cuda_graph", flaky)
    monkeypatch.setattr(timing, "time_fn", lambda fn, device=None: timing._summary([9.0]))
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    failures = 2  # the first try fails, the second succeeds
    t, how = timing.time_kernels(lambda: None, reps=7)
    assert how == "cuda_graph" and t.median_ms == 2.0
    assert tries == [(7, "thread_local"), (7, "global")]  # `timing.CAPTURE_MODES` in turn
    tries.clear()
    failures = 99  # every try fails
    t, how = timing.time_kernels(lambda: None, reps=7, captures=3)
    assert [m for _, m in tries] == ["thread_local", "global", "thread_local"]
    assert t.median_ms == 9.0
    assert how.startswith("events (") and "RuntimeError: operation failed" in how
    assert results.fell_back({"timing": how}) and not results.fell_back(
        {"timing": "cuda_graph"})
