"""The training loop: gradient accumulation is exact, the loss falls on real text, and
the measured step carries every metric the results files need."""

import pytest
import torch

from colossal_lab import precision
from colossal_lab.config import Switches, tiny
from colossal_lab.measure import mfu
from colossal_lab.model import build_model
from colossal_lab.switches import checkpointing
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.checkpointing import GradientCheckpointConfig
from colossal_lab.training import data, train


def test_micro_batches_give_the_same_update():
    cfg = tiny()
    ids = torch.randint(0, cfg.vocab_size, (4, 33))
    params = []
    for micro in (1, 4):
        torch.manual_seed(0)
        m = apply_switches(build_model(cfg, "cpu"), Switches.naive("fp32"))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        step = train.make_step(m, opt, micro_batches=micro, clip=None)
        loss = step(ids[:, :-1], ids[:, 1:])
        params.append((loss, [p.detach().clone() for p in m.parameters()]))
    (l1, p1), (l4, p4) = params
    assert torch.allclose(l1, l4, atol=1e-6)
    for a, b in zip(p1, p4):
        assert torch.allclose(a, b, atol=1e-6)


def test_loss_falls_on_the_corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOSSAL_LAB_CACHE", str(tmp_path))
    cfg = tiny()
    r = train.train(cfg, Switches(precision="fp32"), batch=8, seq_len=64, steps=30,
                    lr=3e-3, max_files=40, vocab_size=cfg.vocab_size, progress=False,
                    log_every=10)
    assert len(r.losses) == 30
    assert sum(r.losses[-5:]) / 5 < r.losses[0] - 0.5, r.losses
    assert r.val_loss is not None and r.val_loss < r.losses[0]
    assert r.stats is not None and r.stats.tokens_per_s > 0


def test_bf16_autocast_trains():
    cfg = tiny()
    r = train.train(cfg, Switches(precision="bf16"), batch=4, seq_len=32, steps=3,
                    data="random", progress=False)
    assert all(x == x for x in r.losses)  # no NaN


def test_measure_step_row_fields():
    cfg = tiny()
    m = apply_switches(build_model(cfg, "cpu"), Switches.naive("fp32"))
    step = train.make_step(m, train.make_optimizer(m))
    batches = data.random_batches(cfg.vocab_size, 2, 32, seed=0)
    meas = train.measure_step(step, batches, cfg=cfg, setup="x", preset="tiny", batch=2,
                              seq_len=32, warmup=1, iters=3, progress=False,
                              extra={"label": "X"})
    row = meas.row()
    for k in ("setup", "preset", "batch", "seq_len", "tokens_per_s", "mfu", "mfu_attn",
              "hfu", "peak_mem_gib", "step_ms", "label"):
        assert k in row, k
    assert row["tokens_per_s"] == pytest.approx(2 * 32 / (row["step_ms"] / 1e3))
    assert 0 < row["mfu"] < row["mfu_attn"]


def test_hfu_counts_the_recompute():
    """With full checkpointing train() reports HFU = (model FLOPs + recomputed FLOPs) /
    time / peak, larger than MFU (attention included) by exactly the recompute."""
    cfg = tiny()
    sw = Switches(precision="fp32",
                  gradient_checkpoint_config=GradientCheckpointConfig())
    r = train.train(cfg, sw, batch=2, seq_len=32, steps=2, data="random", progress=False,
                    log_every=1)
    model_flops = mfu.model_flops(cfg, 2 * 32, 32)
    extra = checkpointing.recompute_flops(cfg, 2, 32, GradientCheckpointConfig(),
                                          attention_backend="naive")
    assert extra > 0 and r.stats.hfu > r.stats.mfu_attn
    assert r.stats.hfu / r.stats.mfu_attn == pytest.approx(1 + extra / model_flops)
    plain = train.train(cfg, Switches(precision="fp32"), batch=2, seq_len=32, steps=1,
                        data="random", progress=False)
    assert plain.stats.hfu == pytest.approx(plain.stats.mfu_attn)


def test_bad_training_configs():
    with pytest.raises(ValueError, match="micro_batch"):
        train.train(tiny(), batch=4, micro_batch=3, steps=1, data="random", progress=False)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        train.train(tiny(), seq_len=10_000, steps=1, data="random", progress=False)
    with pytest.raises(ValueError, match="choose one of"):
        precision.autocast("fp4", torch.device("cpu"))


def test_gc_held_between_steps(monkeypatch):
    """train() collects only at step boundaries, every `gc_every` steps, and leaves the
    collector as it found it."""
    import gc

    calls = []
    monkeypatch.setattr(train, "collect_now", lambda: calls.append(gc.isenabled()))
    assert gc.isenabled()
    train.train(tiny(), Switches(precision="fp32"), batch=2, seq_len=16, steps=5,
                data="random", progress=False, gc_every=2)
    assert calls == [False, False]  # after steps 2 and 4, automatic collection off
    assert gc.isenabled()
    with train.gc_between_steps(enabled=False):
        assert gc.isenabled()


def test_measure_step_keeps_every_step_and_gc_pause():
    cfg = tiny()
    model = apply_switches(build_model(cfg, "cpu"), Switches(precision="fp32"))
    step = train.make_step(model, train.make_optimizer(model))
    batches = data.random_batches(cfg.vocab_size, 2, 16, seed=0, device="cpu")
    with pytest.raises(ValueError, match="gc_policy"):
        train.measure_step(step, batches, cfg=cfg, setup="x", preset="tiny", batch=2,
                           seq_len=16, gc_policy="sometimes", progress=False)
    for policy in ("python", "between_steps"):
        m = train.measure_step(step, batches, cfg=cfg, setup="x", preset="tiny", batch=2,
                               seq_len=16, warmup=1, iters=5, gc_policy=policy,
                               progress=False)
        assert len(m.step_ms_all) == len(m.gc_ms_all) == m.steps_timed == 5
        assert min(m.step_ms_all) <= m.step_ms <= max(m.step_ms_all)
        assert m.gc_policy == policy and all(g >= 0 for g in m.gc_ms_all)


def test_tf32_only_inside_the_step():
    cfg = tiny()
    model = apply_switches(build_model(cfg, "cpu"), Switches(precision="tf32"))
    seen = []

    def loss_fn(m, ids, labels):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        return m(ids, labels)

    before = torch.backends.cuda.matmul.allow_tf32
    step = train.make_step(model, train.make_optimizer(model), loss_fn)
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    assert torch.isfinite(step(ids[:, :-1], ids[:, 1:]))
    assert seen == [True] and torch.backends.cuda.matmul.allow_tf32 == before


def test_progress_is_one_line_in_a_notebook(monkeypatch, capsys):
    """In a Jupyter kernel the bar prints one plain stdout line when it closes (no
    widget, no carriage returns on stderr); on a terminal it is tqdm's bar."""
    from colossal_lab.measure import progress

    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    bar = progress.Progress(range(5), desc="train 2L")
    for _ in bar:
        bar.set_postfix(loss="3.100")
    out = capsys.readouterr()
    assert out.err == ""
    assert out.out.count("\n") == 1 and "\r" not in out.out
    assert out.out.startswith("train 2L: 5/5 in ") and out.out.rstrip().endswith("loss=3.100")
    monkeypatch.setattr(progress, "in_notebook", lambda: False)
    quiet = progress.Progress(total=3, desc="x", enabled=False)
    quiet.update(3)
    quiet.close()
    assert capsys.readouterr() == ("", "")
