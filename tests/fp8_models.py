"""Helpers of the fp8 tests that hold two paths to the same bits: a few SGD steps of
several models on the same tokens, and the checks that their gradients and amax
histories agree."""

import torch

from colossal_lab.config import Switches, tiny
from colossal_lab.model import build_model
from colossal_lab.switches import fp8 as fp8_switch
from colossal_lab.switches.apply import apply_switches


def same_histories(a, b) -> None:
    """Two fp8 linears' amax histories and ring positions, role by role, are equal."""
    for role in ("x", "w", "grad"):
        assert torch.equal(a._scalers[role].history, b._scalers[role].history), role
        assert a._scalers[role].pos == b._scalers[role].pos, role


def sgd_steps(cfg, models, n: int = 3, generator=None, ids_shape=(2, 25)):
    """`n` steps of every model on the same random tokens a step (`ids_shape` ids, one
    fewer position trained: 48 tokens by default), under bf16 autocast: yields (step,
    [loss of each model]) after the backward, before SGD."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    for step in range(n):
        ids = torch.randint(0, cfg.vocab_size, ids_shape, generator=generator)
        losses = []
        for m in models:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = m(ids[:, :-1], ids[:, 1:])
            loss.backward()
            losses.append(loss.detach())
        yield step, losses
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)


def same_models(models, step) -> None:
    """The first two models' gradients and every fp8 linear's histories are equal."""
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p.grad, q.grad), (step, name)
    for a, b in zip(fp8_switch.fp8_modules(models[0]), fp8_switch.fp8_modules(models[1])):
        same_histories(a, b)


def tiny_fp8_models(extra: dict, ckpts, **switches):
    """(cfg, models): one tiny model per (extra, checkpoint config) of `ckpts`, every
    linear fp8 (emulated GEMMs, history 4) with fused projections and `switches`, all
    with the first one's weights."""
    cfg = tiny().replace(intermediate_size=176)  # every linear fp8
    models = [apply_switches(build_model(cfg, "cpu"),
                             Switches(precision="fp8", enable_fused_projections="triton",
                                      **switches,
                                      extra=dict(extra, fp8_backend="emulate",
                                                 fp8_history=4, **e),
                                      gradient_checkpoint_config=c))
              for e, c in ckpts]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return cfg, models
