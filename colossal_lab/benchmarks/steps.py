"""Whole training steps, timed side by side: the machinery behind every MFU delta.

A `Setup` is one way to train a model (our LLaMA with some `Switches`, or Hugging Face's
with SDPA / compile / Liger). `run_setups` times each in its own process, so an
out-of-memory in one cannot poison the next and compile caches do not leak between
them; a failure becomes a row with an `error` field. The chapters declare their setups
(`baseline.SETUPS`, `switch_deltas`), this module times them.

Memory is measured too, on a GPU (`colossal_lab.training.memory`): the activation memory of one
extra forward+backward, and, when a setup asks, the largest batch that fits
(`Setup.find_largest_batch`) or the fewest checkpointed layers that fit its batch
(`Setup.auto_ratio`, chapter 04). Every row records `first_step_s`, the wall time of
the first warm-up step: where `torch.compile` compiles (`Setup.compile`,
`Switches.enable_compile`), so what compilation costs is reported next to what it buys.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from colossal_lab import precision
from colossal_lab.benchmarks.harness import Benchmark, Invocation, flag, opt
from colossal_lab.config import Switches, preset
from colossal_lab.measure import results, telemetry
from colossal_lab.measure.results import error_line, exception_tail
from colossal_lab.model import build_model
from colossal_lab.ops.attention import resolve_backend
from colossal_lab.switches import checkpointing, deferred_adamw
from colossal_lab.switches.apply import apply_switches
from colossal_lab.switches.checkpointing import colossalai_flops, resolve
from colossal_lab.switches.resolved import backends_in_use
from colossal_lab.training import data, memory, optimizer, train

TORCHAO_RECIPES = ("tensorwise", "rowwise")
"""torchao float8 recipes a setup may name (`Float8LinearConfig.from_recipe_name`)."""


@dataclass(frozen=True)
class Setup:
    """One way to train the model; `impl` is "ours" or "hf" (Hugging Face)."""

    name: str
    label: str
    impl: str = "ours"
    switches: Switches = field(default_factory=Switches)
    """What to turn on (`apply_switches`); its `precision` is the setup's, for Hugging
    Face's model too (which takes only the precision)."""
    compile: bool = False
    """`torch.compile` the whole built model (the wrapper; ours also has the in-place
    `Switches.enable_compile`)."""
    liger: bool = False
    torchao_fp8: bool = False
    """Hugging Face's model with torchao's float8 training linears
    (`convert_torchao_float8`): the peer of our fp8 row. Needs `compile`, bf16 autocast
    and torchao."""
    torchao_recipe: str = "tensorwise"
    """torchao's float8 recipe: "tensorwise" (one dynamic scale a tensor) or "rowwise"
    (a scale a row of each operand, fp32 scales, more accurate and slower)."""
    micro_batch: int | None = None
    """Gradient-accumulation slice; naive attention needs small slices to fit."""
    iters: int = 20
    """Timed steps: at least 20, so the p10-p90 spread means something."""
    warmup: int = 3
    gc_policy: str = "between_steps"
    """Python's garbage collector: held between steps (as `train` does) or "python"
    (automatic collection on; `step_noise` shows what that does to the spread)."""
    preset: str | None = None
    """This setup's model preset, overriding the chapter's (e.g. full LLaMA-7B)."""
    batch: int | None = None
    """This setup's batch, overriding the chapter's."""
    find_largest_batch: bool = False
    """Predict the largest batch that fits from two memory probes and verify it by
    running it (GPU only): the `largest_batch*` fields of the row."""
    auto_ratio: bool = False
    """Before timing, set the fewest checkpointed layers (full recomputation) that fit
    `batch`, from three memory probes (GPU only; ours only)."""

    def __post_init__(self) -> None:
        if self.iters < 20:  # the CPU smoke test times 2 steps whatever this says
            raise ValueError(f"{self.name}: iters={self.iters}; time at least 20 steps "
                             "on a GPU, or the p10-p90 spread means nothing")
        if self.compile and self.switches.enable_compile:
            raise ValueError(f"{self.name}: compile=True wraps the model in torch.compile, "
                             f"switches.enable_compile={self.switches.enable_compile!r} "
                             "compiles it in place: choose one")
        if self.torchao_fp8:
            if self.impl != "hf":
                raise ValueError(f"{self.name}: torchao_fp8 converts Hugging Face's "
                                 "model (impl='hf'); ours has precision='fp8'")
            if not self.compile:
                raise ValueError(f"{self.name}: torchao_fp8 needs compile=True: torchao's "
                                 "float8 casts and scales are only fast once compiled")
            if self.torchao_recipe not in TORCHAO_RECIPES:
                raise ValueError(f"{self.name}: torchao_recipe={self.torchao_recipe!r}; "
                                 f"choose one of {TORCHAO_RECIPES}")
            if self.switches.precision != "bf16":
                raise ValueError(f"{self.name}: torchao_fp8 runs under bf16 autocast, "
                                 f"not precision={self.switches.precision!r}")

    def to_json(self) -> str:
        d = dataclasses.asdict(self)  # nested dataclasses (a checkpoint config) as dicts
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> Setup:
        d = json.loads(text)
        d.pop("precision", None)  # written by older versions; the switches hold it
        d["switches"] = Switches.from_dict(d["switches"], checkpoint_config=resolve)
        return cls(**d)


def build(setup: Setup, preset_name: str, device: torch.device):
    """The model for `setup` on `device`, its switches applied (`apply_switches`), and
    its loss function."""

    cfg = preset(preset_name)
    if setup.impl == "ours":
        model = apply_switches(build_model(cfg, device), setup.switches)
        if setup.compile:
            model = torch.compile(model)
        return model, train.our_loss
    if setup.impl != "hf":
        raise ValueError(f"impl={setup.impl!r}; choose 'ours' or 'hf'")
    if setup.switches.precision not in ("bf16", "fp32"):
        raise ValueError(f"{setup.name}: Hugging Face setups run 'bf16' (autocast) or "
                         f"'fp32', not {setup.switches.precision!r}")
    from transformers import AutoModelForCausalLM  # lazy: optional package

    if setup.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # lazy: optional

        apply_liger_kernel_to_llama()  # patches the module's classes: before building
    hf_cfg = cfg.to_hf()
    hf_cfg.use_cache = False
    with device:
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    model.train()
    apply_switches(model, setup.switches)  # its precision; a kernel switch is an error
    if setup.torchao_fp8:
        convert_torchao_float8(model, setup.torchao_recipe)
    if setup.compile:
        model = torch.compile(model)
    return model, train.hf_loss


def _torchao_takes(module: torch.nn.Module, fqn: str) -> bool:
    """torchao's float8 takes a linear whose both dims are multiples of 16 (`_scaled_mm`
    needs them), never the output head (kept in bf16, as in torchtitan's recipe)."""
    return (isinstance(module, torch.nn.Linear) and fqn.rsplit(".", 1)[-1] != "lm_head"
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_torchao_float8(model: torch.nn.Module, recipe: str = "tensorwise") -> int:
    """Swap `model`'s linears (`_torchao_takes`) for torchao's `Float8Linear`, in place,
    with dynamic scaling by torchao's `recipe` ("tensorwise" or "rowwise"); returns how
    many."""
    try:
        from torchao.float8 import (  # lazy: optional package
            Float8LinearConfig,
            convert_to_float8_training,
        )
    except ImportError as e:
        raise ImportError(f"torchao float8 setups need torchao ({e}): install torchao "
                          "(make wheelhouse carries it)") from e
    convert_to_float8_training(model, module_filter_fn=_torchao_takes,
                               config=Float8LinearConfig.from_recipe_name(recipe))
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


def prepare(setup: Setup, preset_name: str, batch: int):
    """What a measured step starts from, seeded: (device, config, model with its
    switches, loss function, micro-batch, optimizer)."""

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    cfg = preset(preset_name)
    model, loss_fn = build(setup, preset_name, device)
    micro = min(setup.micro_batch or batch, batch)
    return device, cfg, model, loss_fn, micro, train.make_optimizer(model)


def measure_one(setup: Setup, preset_name: str, seq_len: int, batch: int,
                progress: bool = True) -> dict:
    """Build, warm up and time one setup in this process; returns its results row.

    On a GPU the row also carries the memory probes' fields (`memory.memory_probe`)
    and, when the setup asks, the largest batch (`find_largest_batch`) and the ratio
    chosen to fit (`auto_ratio`)."""

    preset_name, batch = setup.preset or preset_name, setup.batch or batch
    device, cfg, model, loss_fn, micro, opt = prepare(setup, preset_name, batch)
    quick = device.type == "cpu"
    extra = {"label": setup.label, "precision": precision.of(model),
             "optimizer": type(opt).__name__, "optimizer_moments": optimizer.moments_of(opt),
             **ran_backends(model, setup)}
    probe = memory.Prober(model, loss_fn, setup, cfg, seq_len, device)
    if setup.auto_ratio:
        extra.update(memory.auto_ratio(probe, model, opt, micro, accumulating=micro < batch))
    timed = functools.partial(time_setup, model, opt, loss_fn, setup, cfg, preset_name,
                              seq_len=seq_len, device=device)
    row = timed(batch, micro=micro, warmup=1 if quick else setup.warmup,
                iters=2 if quick else setup.iters, seed=0, progress=progress, extra=extra)
    row.update(probe.fields(micro))
    if setup.find_largest_batch and probe.available:
        verify = lambda bs: timed(bs, micro=bs, warmup=1, iters=2, seed=2)  # noqa: E731
        big, why = memory.guarded(memory.verify_largest_batch, probe, row, verify,
                                  model=model)
        row.update(big if big is not None else {"largest_batch_note": why})
    return row


def runs_quick(setup: Setup) -> bool:
    """Does a `quick` (CPU, tiny model) run take `setup`? Not Liger's (its kernels need
    a GPU), nor a compiled one (minutes of compilation on a CPU, and Dynamo cannot
    trace our Triton kernels under the interpreter), nor torchao's float8."""
    return not (setup.liger or setup.compile or setup.torchao_fp8
                or setup.switches.enable_compile)


def ran_backends(model, setup: Setup) -> dict:
    """What each switch resolved to on this device (after any fallback), for the row:
    a label says what was asked for, these fields what actually ran."""
    if setup.impl == "hf":
        return {"attention_backend": "hf-sdpa", "norm_backend": "liger" if setup.liger
                else "hf-eager", **({"fp8_backend": f"torchao-{setup.torchao_recipe}"}
                                    if setup.torchao_fp8 else {})}

    return backends_in_use(getattr(model, "_orig_mod", model))  # under torch.compile too


def time_setup(model, opt, loss_fn, setup: Setup, cfg, preset_name: str, batch: int, *,
               seq_len: int, device, micro: int | None = None, warmup: int = 1,
               iters: int = 2, seed: int = 0, progress: bool = False,
               extra: dict | None = None) -> dict:
    """The timed results row of `setup` (model and optimizer already built) at `batch`,
    in micro-batches of `micro`, on random tokens: `train.measure_step`, with the
    recompute counted in HFU and ColossalAI's 8N figure next to it."""

    micro = micro or batch
    step = FirstCallTimer(train.make_step(model, opt, loss_fn, micro_batches=batch // micro),
                          device)
    batches = data.random_batches(cfg.vocab_size, batch, seq_len, seed=seed, device=device)
    recompute = recompute_accounting(model, setup, cfg, batch, seq_len, device)
    with telemetry.GpuSampler(device) as gpu:  # clocks and power beside the steps
        m = train.measure_step(step, batches, cfg=cfg, setup=setup.name, preset=preset_name,
                               batch=batch, seq_len=seq_len, micro_batch=micro,
                               warmup=warmup, iters=iters, progress=progress,
                               gc_policy=setup.gc_policy,
                               recompute_flops=recompute["recompute_flops"], extra=extra)
    step.step.flush()  # a deferred update: the memory probes see the updated weights
    row = m.row()
    row["first_step_s"] = step.seconds
    row["optimizer_deferred"] = getattr(step.step, "deferred", None) is not None  # as ran
    if hasattr(step.step, "captures"):  # `enable_compile="graph"`: in first_step_s
        row.update(graph_captures=step.step.captures, graph_capture_s=step.step.capture_s)
    # the timed steps only: warm-up (and any compilation) runs at other clocks
    row.update(gpu.fields(step.starts[warmup] if len(step.starts) > warmup else None))
    row.update(colossalai_fields(row, cfg, recompute))
    return row


class FirstCallTimer:
    """`step`, with the wall time of its first call kept in `seconds`: the first
    warm-up step, where `torch.compile` compiles (forward and backward graphs) and
    Triton JIT-compiles our kernels. Waits for the device, so the time covers the
    kernels that call queued. `starts`: the local time each call began
    (`telemetry.now`), so the GPU's samples can be cut to the timed steps."""

    def __init__(self, step, device):
        self.step, self.device, self.seconds = step, torch.device(device), None
        self.starts: list = []

    def __call__(self, *args):
        self.starts.append(telemetry.now())
        if self.seconds is not None:
            return self.step(*args)
        start = time.perf_counter()
        out = self.step(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = round(time.perf_counter() - start, 3)
        return out


# ------------------------------------------------------------------ recompute, HFU


def recompute_accounting(model, setup: Setup, cfg, batch: int, seq_len: int,
                         device) -> dict:
    """What the step recomputes (our model's checkpoint config) and its FLOPs: HFU
    counts them (`train.measure_step(recompute_flops=...)`), MFU does not."""

    config = getattr(model, "_orig_mod", model).switches.gradient_checkpoint_config
    if setup.impl != "ours" or config is None:
        return {"recompute_flops": 0.0, "ckpt_mode": None, "ckpt_layers": 0,
                "ckpt_ratio": 0.0}
    backend = resolve_backend(setup.switches.enable_flash_attention, device)
    spec = checkpointing.recompute_spec(config, cfg.num_hidden_layers,
                                        attention_backend=backend)
    flops = checkpointing.recompute_flops(cfg, batch, seq_len, config,
                                          attention_backend=backend)
    return {"recompute_flops": flops, "ckpt_mode": config.mode, "ckpt_layers": spec.layers,
            "ckpt_ratio": spec.fraction}


def colossalai_fields(row: dict, cfg, recompute: dict) -> dict:
    """What ColossalAI's evaluator would call MFU for this step (8N per token whenever
    checkpointing is on), next to the recompute that our HFU counted."""

    t, peak = row["step_ms"] / 1e3, row["peak_tflops"] * 1e12
    tokens = row["batch"] * row["seq_len"]
    return {"mfu_colossalai": colossalai_flops(cfg, tokens, recompute["ckpt_layers"] > 0)
            / t / peak, "recompute_tflop": recompute["recompute_flops"] / 1e12,
            **{k: recompute[k] for k in ("ckpt_mode", "ckpt_layers", "ckpt_ratio")}}


def in_child(module: str, args: list[str], cwd: str | None = None,
             env: dict[str, str] | None = None):
    """Run ``python -m <module> <args> --json-out FILE`` in a fresh process (an
    out-of-memory or a crash stays there, compile caches do not leak) and return
    (what it wrote to FILE, None), or (None, why it failed) in one line. `cwd`: the
    source tree the child imports `colossal_lab` from (another checkout's, say); `env`:
    variables set for the child on top of this process's."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        proc = subprocess.run([sys.executable, "-m", module, *args, "--json-out", out],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=cwd, env=None if env is None else {**os.environ, **env})
        if proc.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                return json.load(f), None
    if "OutOfMemoryError" in proc.stdout:
        return None, "out of memory"
    return None, error_line(exception_tail(proc.stdout))[:500]


def child_env(setup: Setup) -> dict[str, str] | None:
    """What a setup's process needs set before CUDA starts: expandable segments for a
    deferred AdamW update (`switches.deferred_adamw`, **Memory**), else nothing."""
    if deferred_adamw.requested(setup.switches):
        return {"PYTORCH_CUDA_ALLOC_CONF": deferred_adamw.ALLOC_CONF}
    return None


def measure_isolated(setup: Setup, preset_name: str, seq_len: int, batch: int) -> dict:
    """`measure_one` in a child process (`child_env`); a failure becomes a row with an
    `error`."""
    row, why = in_child("colossal_lab.benchmarks.steps", [
        "--setup-json", setup.to_json(), "--preset", preset_name, "--seq-len",
        str(seq_len), "--batch", str(batch)], env=child_env(setup))
    return row if why is None else {"setup": setup.name, "label": setup.label,
                                    "preset": setup.preset or preset_name,
                                    "seq_len": seq_len, "batch": setup.batch or batch,
                                    "error": why}


def run_setups(setups, *, preset_name: str, seq_len: int, batch: int,
               isolate: bool = True, tag: str = "steps", on_row=None) -> list[dict]:
    """Time every setup, side by side; prints one line per setup as it finishes and
    hands the rows so far to `on_row(rows)` (the command line saves them as it goes)."""
    rows = []
    for s in setups:
        print(f"[{tag}] {s.name} ...", flush=True)
        row = (measure_isolated(s, preset_name, seq_len, batch) if isolate
               else measure_one(s, preset_name, seq_len, batch, progress=False))
        rows.append(row)
        print(format_row(row), flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def format_row(r: dict) -> str:
    if "error" in r:
        return f"  {r['setup']:<26} failed: {error_line(r['error'])[:80]}"
    mem = f"{r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") else "-"
    if r.get("activation_mem_gib") is not None:
        mem += f" (activations {r['activation_mem_gib']:.1f})"
    hfu = f"  HFU {r['hfu']:6.1%}" if r.get("ckpt_layers") else ""
    big = (f"  largest batch {r['largest_batch']} (predicted {r['largest_batch_predicted']})"
           if r.get("largest_batch_predicted") is not None else "")
    return (f"  {r['setup']:<26} {r['tokens_per_s']:>10,.0f} tok/s  MFU {r['mfu']:6.1%}  "
            f"+attn {r['mfu_attn']:6.1%}{hfu}  {mem}{big}")


def _run_child(call: Invocation) -> None:
    a = call.args
    row = measure_one(Setup.from_json(a.setup_json), a.preset, a.seq_len, a.batch)
    with open(a.json_out, "w") as f:
        json.dump(row, f)


CHILD = Benchmark(
    "steps", __doc__, description="time one setup (child of measure_isolated)",
    options=[opt("--setup-json", required=True), flag("preset", required=True),
             flag("seq_len", required=True), flag("batch", required=True),
             opt("--json-out", required=True)],
    execute=_run_child)
"""The child process of `measure_isolated`: one setup, its row written to a file."""


def run_chapter(name: str, setups, quick: bool = False, *, preset_name: str = "llama-7b-8l",
                seq_len: int = 4096, batch: int = 4, on_row=None) -> list[dict]:
    """A chapter's MFU delta: `setups` side by side (`quick`: tiny model, in-process;
    per-setup preset and batch overrides are dropped, and the setups `runs_quick`
    leaves to the GPU run are skipped)."""
    if quick:
        if skipped := [s.name for s in setups if not runs_quick(s)]:
            print(f"[{name}] quick: {', '.join(skipped)} left to the GPU run", flush=True)
        setups = [dataclasses.replace(s, preset=None, batch=None) for s in setups
                  if runs_quick(s)]
        return run_setups(setups, preset_name="tiny", seq_len=64, batch=2, isolate=False,
                          tag=name)
    return run_setups(setups, preset_name=preset_name, seq_len=seq_len, batch=batch, tag=name,
                      on_row=on_row)


def chapter_benchmark(name: str, setups):
    """`(run, main)` of a benchmark module that times `setups` side by side:
    `run(quick=False) -> rows` (`run_chapter`) and `main(argv)`, the command line that
    saves `results/<gpu>/<name>.json` (`chapter_bench`)."""

    def run(quick: bool = False) -> list[dict]:
        return run_chapter(name, setups, quick)

    return run, chapter_bench(name, setups).main


def step_config(preset_name="llama-7b-8l", seq_len=4096, batch=4) -> dict:
    return {"preset": preset_name, "seq_len": seq_len, "batch": batch, "optimizer": "AdamW",
            "data": "random tokens", "mfu_peak": "dense bf16 datasheet peak",
            "attention_flops": "causal, half of 12·L·d·S per token"}


def _time_chapter(call: Invocation, setups, paired: tuple[str, str] | None = None
                  ) -> None:
    """Time the chosen setups side by side and save them, each setup as it finishes
    into `results/<gpu>/partial/` (what `--resume` continues), all at the end into
    `results/<gpu>/<name>.json`. With `--pairs N`, the two `paired` setups are timed N
    times instead of once, in turns (the order swapped every pair), after the others:
    a drift of the card's clock or power then falls on both sides of each ratio."""
    a, name = call.args, call.bench.name
    chosen = [s for s in setups if a.setups is None or s.name in a.setups]
    pairs = getattr(a, "pairs", 0) or 0
    tags: list[int | None] = [None] * len(chosen)
    if pairs:
        by = {s.name: s for s in setups}
        chosen = [s for s in chosen if s.name not in paired]
        tags = [None] * len(chosen)
        for i in range(pairs):
            for n in (paired if i % 2 == 0 else paired[::-1]):
                chosen.append(by[n])
                tags.append(i)
    config = step_config(a.preset, a.seq_len, a.batch)
    if pairs:
        config["pairs"] = {"setups": list(paired), "count": pairs}
    done: list[dict] = []
    if a.resume:
        done, config = results.resumed_rows(name, results.load_partial(name), config,
                                            call.error, what="interrupted run")
        have = {(r["setup"], r.get("pair")) for r in done}
        print(f"[{name}] resuming: {len(done)} rows kept ("
              + ", ".join(n if t is None else f"{n} (pair {t})" for n, t in sorted(
                  have, key=lambda k: (k[1] is not None, k[1] or 0, k[0]))) + ")",
              flush=True)
        plan = [(s, t) for s, t in zip(chosen, tags, strict=True)
                if (s.name, t) not in have]
        chosen, tags = [s for s, _ in plan], [t for _, t in plan]

    def keep(rows):  # an interrupted run keeps the setups it finished
        results.save_partial(name, done + rows, config=config, command=call.command)

    def tagged(rows):  # the pair each paired row belongs to
        return [dict(r, pair=t) if t is not None else r for r, t in zip(rows, tags)]

    rows = run_chapter(name, chosen, a.quick, preset_name=a.preset, seq_len=a.seq_len,
                       batch=a.batch,
                       on_row=None if a.quick else (lambda rows: keep(tagged(rows))))
    if not a.quick:
        call.save(done + tagged(rows), config=config)


def chapter_bench(name: str, setups, paired: tuple[str, str] | None = None
                  ) -> Benchmark:
    """The `Benchmark` of a chapter's MFU delta: `setups` timed side by side, saved in
    `results/<gpu>/<name>.json` (`--quick`: tiny model on CPU, not saved). `paired`:
    two setups that `--pairs N` times N times in turns (`_time_chapter`)."""
    pair_opt = [opt("--pairs", type=int, default=0,
                    help=f"time {' and '.join(paired)} this many times, in turns")
                ] if paired else []

    def check(a):
        if a.resume and a.quick:
            return "--resume continues a saved GPU run; --quick runs are not saved"
        pairs = getattr(a, "pairs", 0)
        if pairs and (a.quick or pairs < 0):
            return "--pairs N (N >= 1) goes with a GPU run, without --quick"
        if pairs and a.setups is not None and not set(paired) <= set(a.setups):
            return f"--pairs needs {' and '.join(paired)} among --setups"
        return None

    return Benchmark(
        name, __doc__, description=f"MFU delta: {name}",
        quick_help="tiny model on the CPU, in-process, not saved",
        options=[flag("preset"), flag("seq_len"), flag("batch"),
                 opt("--setups", nargs="*", choices=[s.name for s in setups]),
                 flag("resume", help="finish an interrupted run: keep the rows it saved "
                      "in results/<gpu>/partial/ and measure only the setups it lacks"),
                 *pair_opt],
        check=check, execute=lambda call: _time_chapter(call, setups, paired))


def main_for(name: str, setups, argv=None) -> None:
    """The command line of a chapter's MFU-delta benchmark (`chapter_bench`)."""
    chapter_bench(name, setups).main(argv)


if __name__ == "__main__":
    CHILD.main()
