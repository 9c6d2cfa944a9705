"""`python -m colossal_lab doctor`: the tutorial's tuning checklist as code.

The tutorial closes with eight checks that "catch 90% of performance problems", in order:
1 bf16 / fp16 on; 2 flash attention on; 3 fused norm on; 4 tensor parallelism no wider
than 8; 5 Gemini (heterogeneous memory) only when memory needs it; 6 enough
micro-batches for the pipeline stages; 7 a checkpoint ratio no higher than memory
needs; 8 no data-loader stalls. The doctor runs each against a `Plan` (a model preset,
its `Switches`, the batch, the parallel layout) and this machine, then five of ours:
MFU against what this GPU's matmuls reach, compile or CUDA graphs, fp8, memory
headroom, host-bound steps.

Each finding carries the gain it should bring **as recorded on this GPU**
(`results/<gpu>/*.json`, the step benchmarks of the chapters); on a machine without a
GPU, as recorded on the reference GPU (`results.REFERENCE_GPU`), and it says so; when
nothing was recorded for it, it says that instead of inventing a number. Findings are
ranked: what will fail first, then by expected gain.

Configuration checks run anywhere. What only a run can tell (data-loader stalls,
host-bound steps, the MFU of an arbitrary configuration) comes from a short profile
(`--profile`, `measure.profile`) on a GPU; without one, those checks say they were not
run. The plan and its evidence live in `doctor_plan`, the checks in `doctor_checks`;
this module ranks them into a report and is the command.

    python -m colossal_lab doctor --preset llama-7b-8l --switches naive
    python -m colossal_lab doctor --switches best --batch 8 --pp 4 --microbatches 4
    python -m colossal_lab doctor --switches '{"precision": "bf16"}' --profile   # GPU
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colossal_lab.benchmarks.steps import Setup, build
from colossal_lab.config import PRESETS, SWITCH_SETS, Switches, preset
from colossal_lab.doctor_checks import (  # noqa: F401  (re-exported: `doctor.check_bf16`, ...)
    CHECKS,
    Context,
    Finding,
    Verdict,
    check_bf16,
    check_ckpt_ratio,
    check_compile,
    check_data_loader,
    check_flash,
    check_fp8,
    check_fused_norm,
    check_gemini,
    check_host_bound,
    check_memory,
    check_mfu,
    check_microbatches,
    check_tp_size,
)
from colossal_lab.doctor_plan import (  # noqa: F401  (re-exported: `doctor.Plan`, ...)
    NOT_RECORDED,
    RECORDED_STEPS,
    Machine,
    Plan,
    Recorded,
    ckpt_layers,
    estimate_memory,
    this_machine,
)
from colossal_lab.measure import profile, timing
from colossal_lab.switches import checkpointing
from colossal_lab.switches.apply import check as check_switches
from colossal_lab.training import cli as cli_train
from colossal_lab.training import data, train

# ---------------------------------------------------------------- the report


@dataclass
class Report:
    plan: Plan
    machine: Machine
    memory: object
    findings: list[Finding] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    summary: object | None = None

    def __str__(self) -> str:
        p, m, mm = self.plan, self.machine, self.memory
        k = ckpt_layers(p)
        sw = p.switches_name or "custom"
        lines = [f"doctor: {p.preset}, seq {p.seq_len}, batch {p.batch}"
                 + (f" (micro-batch {p.micro})" if p.micro != p.batch else "")
                 + f", switches {sw} (precision {p.switches.precision})",
                 f"for {m.gpu}" + (" (the reference GPU: this machine has none)"
                                   if m.reference else ""),
                 f"memory model: ~{mm.peak(p.micro, k):.0f} GiB"
                 + (f" of {m.capacity_gib:.0f} GiB" if m.capacity_gib else "")]
        if self.summary is not None:
            s = self.summary
            lines.append(f"profile: {s.step_ms:.1f} ms per step, device idle "
                         f"{s.idle_share:.0%}, {s.kernels_per_step:,.0f} kernels per step")
        lines.append("")
        if self.findings:
            lines.append(f"{len(self.findings)} finding(s), most expected gain first:")
        else:
            lines.append("no findings: every check passed or could not run")
        for i, f in enumerate(self.findings, 1):
            gain = describe_gain(f)
            lines += [f"{i:>2}. [{f.check}] {gain}", f"    {f.message}",
                      f"    fix: {f.fix}", f"    evidence: {f.evidence}"]
        ok = [v for v in self.verdicts if v.status == "ok"]
        skipped = [v for v in self.verdicts if v.status != "ok"]
        if ok:
            lines += ["", "fine:"] + [f"    [{v.check}] {v.why}" for v in ok]
        if skipped:
            lines += ["", "not checked:"] + [f"    [{v.check}] {v.why}" for v in skipped]
        return "\n".join(lines)


SEVERITY_ORDER = ("fails", "gain", "summary")


def describe_gain(f: Finding) -> str:
    """The gain of a finding in words, with its basis."""
    if f.severity == "fails":
        return "will fail"
    if not f.gain:
        return "gain not recorded"
    if f.severity == "summary":
        return f"up to ×{f.gain:.2f} (the best recorded composition)"
    return {"recorded": f"expected ×{f.gain:.2f} (recorded)",
            "profile": f"expected ×{f.gain:.2f} (this profile)",
            "formula": f"predicted ×{f.gain:.2f} by a formula, not recorded"}[f.basis]


def rank(findings: list[Finding]) -> list[Finding]:
    """What will fail first, then by expected gain (largest first, unrecorded last),
    then the summary (MFU against the ceiling, which the others explain)."""
    return sorted(findings, key=lambda f: (SEVERITY_ORDER.index(f.severity),
                                           -(f.gain or 0.0)))


def diagnose(plan: Plan, machine: Machine | None = None, *, summary=None,
             measured_peak_gib: float | None = None) -> Report:
    """Run every check of `CHECKS` on `plan` for `machine` (default: `this_machine()`)."""
    machine = machine or this_machine()
    mm = estimate_memory(plan, machine.capacity_gib)
    ctx = Context(plan, machine, Recorded(machine), mm, summary, measured_peak_gib)
    report = Report(plan, machine, mm, summary=summary)
    for check in CHECKS:
        out = check(ctx)
        (report.findings if isinstance(out, Finding) else report.verdicts).append(out)
    report.findings = rank(report.findings)
    return report


# ---------------------------------------------------------------- a short profile


def profile_plan(plan: Plan, trace_path: str | Path) -> tuple[object, float | None]:
    """Profile a few steps of `plan` on this machine (`profile.profile_steps`); returns
    the `ProfileSummary` and the peak memory in GiB (None on a CPU)."""
    if plan.tp_size > 1 or plan.pp_size > 1:
        raise ValueError("--profile runs one process: tensor and pipeline parallelism "
                         "are not built yet; profile with --tp 1 --pp 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup = Setup("doctor", "doctor", "ours", plan.switches, compile=plan.compile)
    model, loss_fn = build(setup, plan.preset, device)
    opt = train.make_optimizer(model)
    step = train.make_step(model, opt, loss_fn, micro_batches=plan.batch // plan.micro)
    batches = data.random_batches(plan.cfg.vocab_size, plan.batch, plan.seq_len, seed=0,
                                  device=device)
    timing.reset_peak_memory()
    with train.gc_between_steps():
        path = profile.profile_steps(step, batches, trace_path)
    return profile.summarize(path), timing.peak_memory_gib()


# ---------------------------------------------------------------- the command line


def add_arguments(d: argparse.ArgumentParser) -> None:
    """The `doctor` command's flags: the plan, then `--profile`."""
    d.add_argument("--preset", default="llama-7b-8l", choices=sorted(PRESETS))
    d.add_argument("--switches", default="best", help=f"one of {', '.join(SWITCH_SETS)}, "
                   "a JSON file of Switches fields, or the JSON object itself")
    d.add_argument("--batch", type=cli_train.whole(1), default=4)
    d.add_argument("--seq", "--seq-len", dest="seq", type=cli_train.whole(2), default=4096)
    d.add_argument("--micro-batch", type=cli_train.whole(1))
    d.add_argument("--tp", type=cli_train.whole(1), default=1, help="tensor-parallel size")
    d.add_argument("--pp", type=cli_train.whole(1), default=1, help="pipeline stages")
    d.add_argument("--microbatches", type=cli_train.whole(1), help="pipeline micro-batches")
    d.add_argument("--gemini", action="store_true", help="heterogeneous memory (offload)")
    d.add_argument("--compile", action="store_true", help="the step runs torch.compile'd")
    d.add_argument("--cuda-graphs", action="store_true", help="the step is a CUDA graph")
    d.add_argument("--profile", action="store_true", help="profile a few steps (GPU; "
                   "on a CPU only --preset tiny)")
    d.add_argument("--trace", default="doctor_trace.json",
                   help="where --profile writes its trace (Perfetto, chrome://tracing)")


def switches_of(spec: str) -> tuple[Switches, str | None]:
    """A `SWITCH_SETS` name, a JSON file, or an inline JSON object of `Switches` fields;
    ValueError saying what is wrong."""
    if not spec.lstrip().startswith("{"):
        return cli_train.load_switches(spec), spec if spec in SWITCH_SETS else None
    try:
        fields = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--switches: not valid JSON ({e})") from None
    sw = Switches.from_dict(fields, checkpoint_config=checkpointing.resolve,
                            where="--switches")
    name = next((n for n, s in SWITCH_SETS.items() if s == sw), None)
    return sw, name


def plan_of(a: argparse.Namespace) -> Plan:
    """The `Plan` the command line describes; ValueError for what cannot be."""
    sw, name = switches_of(a.switches)
    check_switches(sw.replace(overlap_communication=False))  # backend names, checkpoint config
    if a.micro_batch and a.batch % a.micro_batch:
        raise ValueError(f"--micro-batch {a.micro_batch} must divide --batch {a.batch}")
    cfg = preset(a.preset)
    if a.tp > 1 and (cfg.num_key_value_heads % a.tp or cfg.num_attention_heads % a.tp):
        ok = [d for d in range(1, cfg.num_key_value_heads + 1)
              if cfg.num_key_value_heads % d == 0]
        raise ValueError(f"--tp {a.tp} does not divide num_key_value_heads="
                         f"{cfg.num_key_value_heads}; choose one of {ok}")
    if a.pp > cfg.num_hidden_layers:
        raise ValueError(f"--pp {a.pp} > {cfg.num_hidden_layers} layers of {a.preset}")
    if a.microbatches and a.batch % a.microbatches:
        raise ValueError(f"--microbatches {a.microbatches} must divide --batch {a.batch} "
                         "(each pipeline micro-batch holds the same number of sequences)")
    return Plan(preset=a.preset, switches=sw, switches_name=name, batch=a.batch,
                seq_len=a.seq, micro_batch=a.micro_batch, tp_size=a.tp, pp_size=a.pp,
                num_microbatches=a.microbatches, gemini=a.gemini, compile=a.compile,
                cuda_graphs=a.cuda_graphs)


def check_trace_path(path: Path) -> None:
    """The trace can be written at `path`: checked before the profile runs."""
    if path.is_dir():
        raise ValueError(f"--trace {path} is a folder; name a file (e.g. trace.json)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"--trace {path} cannot be written: {e.strerror or e}") from None


def run(a: argparse.Namespace, error) -> None:
    """`python -m colossal_lab doctor`: print the report; `error(message)` ends the
    program with status 2 for bad input."""
    try:
        plan = plan_of(a)
        if a.profile and not torch.cuda.is_available() and plan.preset != "tiny":
            raise ValueError("--profile without a GPU profiles only --preset tiny (a CPU "
                             f"step of {plan.preset} takes minutes)")
        if a.profile:
            check_trace_path(Path(a.trace))
    except ValueError as e:
        error(str(e).splitlines()[0])
        return
    summary = peak = None
    if a.profile:
        summary, peak = profile_plan(plan, a.trace)
        print(f"trace: {a.trace} (open in https://ui.perfetto.dev)")
    print(diagnose(plan, summary=summary, measured_peak_gib=peak))
