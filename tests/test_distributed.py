"""The distributed foundation on gloo: `init` from torchrun's variables (and a single
process without them), the named `DeviceMesh` and its errors, rank-aware printing and
progress bars, and `spawn`: results by rank, a rank that dies or hangs ends the run
within a deadline, with an error naming it. Switch 8's tests, including a rank failing
in the middle of a gradient reduction, are in `test_data_parallel.py`."""

from __future__ import annotations

import contextlib
import io
import os
import time

import pytest
import torch
import torch.distributed as dist

from colossal_lab.parallel import distributed

# ------------------------------------------------------------- what the ranks run


def mesh_and_logging(tag: str) -> dict:
    """The mesh of the world, the errors of impossible ones, and the rank-aware output."""
    e = distributed.env()
    mesh = distributed.make_mesh(dp=e.world_size)
    out = {"env": (e.rank, e.world_size, e.local_rank, e.backend, str(e.device), e.timeout_s),
           "dims": mesh.mesh_dim_names,
           "sizes": {d: mesh[d].size() for d in distributed.MESH_DIMS},
           "tp2": distributed.make_mesh(tp=2)["tp"].size(), "errors": {}}
    for name, kw in {"product": {"dp": 2, "tp": 2}, "divide": {"tp": 3},
                     "zero": {"dp": 0}}.items():
        try:
            distributed.make_mesh(**kw)
        except ValueError as exc:
            out["errors"][name] = str(exc)
    t = torch.ones(2) * (e.rank + 1)
    with distributed.collective("a test all-reduce"):
        dist.all_reduce(t)
    out["sum"] = t.tolist()
    out["max"] = distributed.all_max([float(e.rank), -float(e.rank)])
    out["mean"] = distributed.all_mean([float(e.rank), 2.0 * e.rank])
    distributed.barrier()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        distributed.log(f"{tag} from every rank\nin two lines")
        distributed.rank0_print(f"{tag} once")
    out["printed"] = printed.getvalue()
    out["bar_enabled"] = distributed.progress(total=3, desc="x").enabled
    return out


def rank1_exits() -> None:
    """Rank 1 dies without a word (a crash, a signal); rank 0 waits in a collective."""
    if distributed.rank() == 1:
        os._exit(3)
    t = torch.ones(2)
    with distributed.collective("the all-reduce rank 1 never joins"):
        dist.all_reduce(t)


def sleeps() -> None:
    time.sleep(60)


# -------------------------------------------------------------------- one group


@pytest.fixture(scope="module")
def two():
    return distributed.spawn(mesh_and_logging, 2, "hello", collective_timeout_s=20)


def test_spawn_returns_each_rank_result(two):
    assert [out["env"][:5] for out in two] == [(0, 2, 0, "gloo", "cpu"),
                                               (1, 2, 1, "gloo", "cpu")]
    assert all(out["env"][5] == 20 for out in two)  # the collective timeout is on the group
    assert all(out["sum"] == [3.0, 3.0] for out in two)
    assert all(out["max"] == [1.0, 0.0] and out["mean"] == [0.5, 1.0] for out in two)


def test_mesh_has_named_dims(two):
    for out in two:
        assert out["dims"] == ("pp", "dp", "tp") == distributed.MESH_DIMS
        assert out["sizes"] == {"pp": 1, "dp": 2, "tp": 1}
        assert out["tp2"] == 2  # dp=None takes what tp and pp leave


def test_mesh_errors_say_what_to_choose(two):
    errors = two[0]["errors"]
    assert "dp·tp·pp = 2·2·1 = 4, but the world has 2 processes" in errors["product"]
    assert "does not divide the world size 2" in errors["divide"]
    assert "dp=0 must be a whole number >= 1" in errors["zero"]


def test_progress_bar_on_rank0_only(two):
    assert [out["bar_enabled"] for out in two] == [True, False]


def test_log_prefixes_every_line_and_rank0_prints_once(two):
    assert two[0]["printed"] == ("[rank 0/2] hello from every rank\n"
                                 "[rank 0/2] in two lines\nhello once\n")
    assert two[1]["printed"] == ("[rank 1/2] hello from every rank\n"
                                 "[rank 1/2] in two lines\n")


# ---------------------------------------------------------------- failures


def test_rank_that_dies_silently_is_named():
    t0 = time.monotonic()
    with pytest.raises(distributed.SpawnError) as info:
        distributed.spawn(rank1_exits, 2, collective_timeout_s=5, timeout_s=60)
    e = info.value
    assert e.rank == 1 and e.exc_type == "ProcessDied" and "exit code 3" in str(e)
    assert e.errors[0].startswith("RankFailure") and "never joins" in e.errors[0]
    assert time.monotonic() - t0 < 30


def test_spawn_deadline_kills_hung_ranks():
    t0 = time.monotonic()
    with pytest.raises(distributed.SpawnError, match=r"ranks \[0, 1\] of 2 did not finish"):
        distributed.spawn(sleeps, 2, timeout_s=6)
    assert time.monotonic() - t0 < 20


# ------------------------------------------------------------------ one process


def test_init_without_torchrun_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    e = distributed.init()
    assert (e.rank, e.world_size, e.backend, e.is_main) == (0, 1, None, True)
    assert not dist.is_initialized()
    distributed.destroy()  # a no-op


def test_init_with_half_of_torchrun_variables(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match="RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"):
        distributed.init()


def test_make_mesh_errors_on_one_process():
    with pytest.raises(ValueError, match="dp·tp·pp = 2·1·1 = 2, but the world has 1 process "
                                         r"\(torchrun"):
        distributed.make_mesh(dp=2)
    with pytest.raises(ValueError, match="tp=True"):
        distributed.make_mesh(tp=True)
    with pytest.raises(RuntimeError, match="torchrun"):
        distributed.make_mesh()


def test_rank_failure_is_told_from_other_errors():
    gone = distributed.as_rank_failure(
        RuntimeError("[pair.cc:537] Read error: Connection reset by peer"), "all-reduce x")
    assert isinstance(gone, distributed.RankFailure) and gone.what == "all-reduce x"
    assert "all-reduce x failed" in str(gone) and "Connection reset" in str(gone)
    assert distributed.as_rank_failure(RuntimeError("shapes (2,) and (3,)"), "x") is None
    assert distributed.as_rank_failure(ValueError("timed out"), "x") is None
    with pytest.raises(distributed.RankFailure), distributed.collective("x"):
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    with pytest.raises(TypeError), distributed.collective("x"):
        raise TypeError("not a communication error")


def test_guard_logs_and_reraises(capsys):
    with pytest.raises(KeyError), distributed.guard():
        raise KeyError("boom")
    assert "failed: KeyError: 'boom'" in capsys.readouterr().err
    with distributed.guard():
        pass


def test_single_process_printing(capsys):
    distributed.log("plain")
    distributed.rank0_print("once")
    assert capsys.readouterr().out == "plain\nonce\n"
    assert distributed.progress(total=1).enabled
