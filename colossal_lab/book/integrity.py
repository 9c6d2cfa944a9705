"""Every number traceable: results files and book outputs still agree with their sources.

* `check_rows`: each derived field of a row recomputes from the row's own inputs
  (tokens/s, MFU, MFU with attention, HFU, TFLOP/s, GB/s, the predicted largest
  batch), within `RTOL`. Fields that compare two rows (`*_speedup`, `*_vs_bf16`) and
  loss-curve throughput (timed with evaluation in it) are not recomputable here.
* `check_provenance`: the provenance names GPU, driver, versions, commit, date and
  command, and carries no key that `results.provenance` does not write. `driver` and
  `cuda` may be None only when the "GPU" is the CPU (`hardware.detect` names it
  "CPU (...)"): no driver exists to record there.
* `check_history`: the provenance was written by the run that wrote the rows: it
  equals the provenance of the newest commit that changed the rows, so a hand edit of
  the provenance alone shows up.
* `check_notebook`: every `show_source` output still equals the library's source, and
  every results banner or caption names the commit the results file now records.

Each returns a list of problems (strings); empty means clean. The tests and
``python -m colossal_lab.book.integrity`` share them.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import pkgutil
import re
import statistics
import subprocess
import sys
from pathlib import Path

from colossal_lab.benchmarks import collectives
from colossal_lab.benchmarks import flash_attention as fa
from colossal_lab.benchmarks import grad_overlap_measured as gom
from colossal_lab.benchmarks.curves import FINAL_WINDOW
from colossal_lab.benchmarks.fused_norm import moved_bytes
from colossal_lab.benchmarks.pipeline_measured import bubble
from colossal_lab.book import notebook
from colossal_lab.config import preset
from colossal_lab.measure import mfu, timing
from colossal_lab.measure.results import BANNER_PREFIX, REPO_ROOT
from colossal_lab.switches.checkpointing import colossalai_flops
from colossal_lab.training.memory import largest_batch

RTOL = 2e-3
"""Relative tolerance of a recomputed field."""
REQUIRED = ("gpu", "gpu_count", "driver", "cuda", "torch", "triton", "python",
            "git_sha", "date", "command")
"""Provenance keys every results file must carry, non-empty."""
CPU_MAY_LACK = ("driver", "cuda")
"""Keys that may be None when the measurement ran on the CPU."""
WRITTEN = (*REQUIRED, "git_dirty", "host_cpu")
"""Every key `results.provenance` writes (keep in step with it): any other key was
added by hand, and a hand-annotated provenance is no longer the run's own record."""


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---------------------------------------------------------------- rows


def _step_fields(row: dict, batch: int, recompute_tflop) -> dict:
    """tokens/s, MFU (6N), MFU (+attention), HFU, ... of a step of `batch` sequences
    timed at `step_ms`, as `mfu.step_stats` computes them at measurement time."""
    t, seq = row["step_ms"] / 1e3, row["seq_len"]
    out = {"tokens_per_s": batch * seq / t}
    if not _num(row.get("peak_tflops")) or row.get("preset") is None:
        return out
    cfg = preset(row["preset"])
    s = mfu.step_stats(cfg, batch=batch, seq_len=seq, step_time_s=t,
                       peak_tflops=row["peak_tflops"],
                       recompute_flops=None if recompute_tflop is None
                       else recompute_tflop * 1e12)
    out.update(mfu=s.mfu, mfu_attn=s.mfu_attn, achieved_tflops=s.achieved_tflops,
               n_params=s.n_params)
    if recompute_tflop is not None:
        out["hfu"] = s.hfu
    if _num(row.get("ckpt_layers")):
        peak = row["peak_tflops"] * 1e12
        out["mfu_colossalai"] = colossalai_flops(cfg, batch * seq,
                                                 row["ckpt_layers"] > 0) / t / peak
    return out


def _recompute(row: dict, scale: float = 1.0):
    """Recomputed TFLOP of the step (None: checkpointing without a recorded figure)."""
    rc = row.get("recompute_tflop")
    if _num(rc):
        return rc * scale  # linear in the batch (`checkpointing.recompute_flops`)
    return None if row.get("ckpt_layers") else 0.0


def expected(row: dict) -> dict:
    """The derived fields of `row` recomputed from its inputs (those it has)."""
    want: dict = {}
    if all(_num(row.get(k)) for k in ("step_ms", "batch", "seq_len")):
        want.update(_step_fields(row, row["batch"], _recompute(row)))
        big, big_ms = row.get("largest_batch"), row.get("largest_batch_step_ms")
        if _num(big) and _num(big_ms):
            scaled = _recompute(row, big / row["batch"])
            want.update({f"largest_batch_{k}": v for k, v in _step_fields(
                {**row, "step_ms": big_ms}, big, scaled).items()
                if k in ("tokens_per_s", "mfu", "mfu_attn", "hfu")})
        mem = [row.get(k) for k in ("mem_fixed_gib", "mem_per_sample_gib",
                                    "mem_capacity_gib")]
        if all(_num(v) for v in mem) and mem[1] > 0:
            want["largest_batch_predicted"] = max(row["batch"], largest_batch(*mem))
    for p in ("fwd", "bwd", "fwd_bwd"):  # work / time, named by their units
        ms, nbytes = row.get(f"{p}_ms"), row.get(f"{p}_bytes")
        if p == "fwd_bwd" and nbytes is None and _num(row.get("fwd_bytes")) \
                and _num(row.get("bwd_bytes")):
            nbytes = row["fwd_bytes"] + row["bwd_bytes"]
        if _num(ms) and ms > 0 and _num(nbytes):
            want[f"{p}_gbps"] = timing.gbps(nbytes, ms)
        if _num(ms) and ms > 0 and _num(row.get(f"{p}_flops")):
            want[f"{p}_tflops"] = timing.tflops(row[f"{p}_flops"], ms)
    if row.get("kind") == "speed" and all(k in row for k in ("heads", "head_dim")):
        flops = fa.attention_flops(row["batch"], row["heads"], row["seq_len"],
                                   row["head_dim"], row["causal"])
        for p, f in (("fwd", flops), ("fwd_bwd", fa.FWD_BWD_FACTOR * flops)):
            if _num(row.get(f"{p}_ms")):
                want[f"{p}_tflops"] = timing.tflops(f, row[f"{p}_ms"])
    times = row.get("step_ms_all")
    if isinstance(times, list) and len(times) >= 2:  # the summary of every timed step
        q = timing.quantile_10_90(times)  # as timing._summary computes it
        want.update(step_ms=statistics.median(times), step_ms_p10=q[0], step_ms_p90=q[1],
                    steps_timed=len(times))
    if row.get("kind") == "floor":  # `bench step_floor`
        if row.get("part") == "gemm" and _num(row.get("flops")) and _num(row.get("ms")):
            want["tflops"] = timing.tflops(row["flops"], row["ms"])
        if row.get("part") == "optimizer" and _num(row.get("bytes")) \
                and _num(row.get("copy_gbps")):
            want["ms"] = row["bytes"] / row["copy_gbps"] / 1e6
    for tag in ("old", "new"):  # `spot_check --old-tree`: one round of two checkouts
        times = row.get(f"{tag}_step_ms_all")
        if isinstance(times, list) and len(times) >= 2:
            q = timing.quantile_10_90(times)
            want.update({f"{tag}_step_ms": statistics.median(times),
                         f"{tag}_step_ms_p10": q[0], f"{tag}_step_ms_p90": q[1],
                         f"{tag}_steps_timed": len(times)})
    if _num(row.get("old_step_ms")) and _num(row.get("new_step_ms")) \
            and "speedup_new_vs_old" in row:
        want["speedup_new_vs_old"] = row["old_step_ms"] / row["new_step_ms"]
    if row.get("kind") == "loss_curve" and isinstance(row.get("losses"), list):
        window = row["losses"][-min(FINAL_WINDOW, len(row["losses"])):]
        want["final_loss"] = sum(window) / len(window)
    if _num(row.get("ms")) and row["ms"] > 0 and _num(row.get("gbytes")):
        want["gbps"] = timing.gbps(row["gbytes"] * 1e9, row["ms"])  # bench optimizer
        if _num(row.get("copy_gbps")):
            want["of_copy_ceiling"] = want["gbps"] / row["copy_gbps"]
    if row.get("kind") in ("tune", "tune-small") and _num(row.get("ms")) and row["ms"] > 0 and \
            row.get("pass") in ("fwd", "bwd") and _num(row.get("tokens")):
        elem = {"bfloat16": 2, "float16": 2, "float32": 4}[row["dtype"]]  # bench fused_norm --tune
        fwd, bwd = moved_bytes("rms_norm", row["tokens"], row["hidden"], elem)
        want["gbps"] = timing.gbps(fwd if row["pass"] == "fwd" else bwd, row["ms"])
    if row.get("kind") == "gemm" and _num(row.get("ms")) and "in_features" in row:
        factor = 6 if row.get("pass") == "fwd_bwd" else 2  # precision.measure_gemm
        want["tflops"] = timing.tflops(factor * row["tokens"] * row["in_features"]
                                      * row["out_features"], row["ms"])
    want.update(_model_fields(row))
    want.update(_multi_gpu_fields(row))
    want.update(_parallel_step_fields(row))
    return want


def _multi_gpu_fields(row: dict) -> dict:
    """The derived fields of the multi-GPU benchmarks' rows: a collective's algorithm
    and bus bandwidth from its message size and time (`bench collectives`), a
    data-parallel step's exposed communication, overlap efficiency and communication
    share from its times (`bench grad_overlap_measured`)."""
    want: dict = {}
    kind = row.get("kind")
    if kind == "collective":
        times = row.get("ms_all")
        if isinstance(times, list) and len(times) >= 2:
            q = timing.quantile_10_90(times)
            want.update(ms=statistics.median(times), ms_p10=q[0], ms_p90=q[1],
                        reps=len(times))
        if all(_num(row.get(k)) and row[k] > 0 for k in ("size_bytes", "ms", "ms_p10",
                                                          "ms_p90", "world")):
            want.update(collectives.bandwidths(row["op"], row["size_bytes"], row["world"],
                                               row["ms"], row["ms_p10"], row["ms_p90"]))
    if kind == "dp_step" and all(_num(row.get(k)) for k in ("step_ms", "t_nocomm_ms",
                                                             "t_sync_ms")):
        t, t0, ts = row["step_ms"], row["t_nocomm_ms"], row["t_sync_ms"]
        want["measured_exposed_ms"] = t - t0
        e = gom.overlap_efficiency(ts, t, t0)
        if row.get("backend") in gom.OVERLAPPED and e is not None:
            want["overlap_efficiency"] = e
        share = gom.comm_share(ts, t0, row.get("backward_ms")) \
            if _num(row.get("backward_ms")) else None
        if share is not None:
            want["comm_share"] = share
    return want


def _parallel_step_fields(row: dict) -> dict:
    """The derived fields of the two-GPU runs' rows (`bench sequence_parallel_step`,
    `bench pipeline_measured`): per-GPU throughput, the bubble from the useful time, and
    the ratios against the baseline each row records (plain TP's step and activation
    memory, 1F1B's step, the simulator's bubble)."""
    want: dict = {}
    step = row.get("step_ms")
    if not (_num(step) and step > 0):
        return want
    if _num(row.get("world")) and row["world"] > 0 and _num(row.get("tokens_per_s_per_gpu")) \
            and all(_num(row.get(k)) for k in ("batch", "seq_len")):
        want["tokens_per_s_per_gpu"] = row["batch"] * row["seq_len"] / (step / 1e3) \
            / row["world"]
    if _num(row.get("step_ms_tp")) and "vs_tp" in row:
        want["vs_tp"] = row["step_ms_tp"] / step
    act, act_tp = row.get("activation_gib"), row.get("activation_gib_tp")
    if _num(act) and _num(act_tp) and act_tp > 0 and "act_vs_tp" in row:
        want["act_vs_tp"] = act / act_tp
    useful = row.get("useful_ms_per_rank")
    if isinstance(useful, list) and useful and all(_num(u) for u in useful) \
            and "bubble" in row:
        want["bubble"] = bubble(useful, step)
        if _num(row.get("bubble_sim")) and row["bubble_sim"] and "bubble_vs_sim" in row:
            want["bubble_vs_sim"] = want["bubble"] / row["bubble_sim"]
    if _num(row.get("step_ms_1f1b")) and "speedup_vs_1f1b" in row:
        want["speedup_vs_1f1b"] = row["step_ms_1f1b"] / step
    return want


def _model_fields(row: dict) -> dict:
    """The derived fields of the single-GPU models' rows (`bench sequence_parallel_gemm`,
    `bench pipeline_sim`, `bench profile_breakdown`), from the inputs they record."""
    want: dict = {}
    kind, ms = row.get("kind"), row.get("ms")
    if kind == "gemm" and all(_num(row.get(k)) for k in ("m", "n", "k")) \
            and _num(ms) and ms > 0:  # sequence_parallel_gemm: one GEMM of m × n × k
        want["tflops"] = timing.tflops(2 * row["m"] * row["n"] * row["k"], ms)
    if kind == "comm" and all(_num(row.get(k)) for k in
                              ("exposed_fwd_ms", "exposed_bwd_ms", "gemm_ms", "split_cost_ms")):
        exposed = row["exposed_fwd_ms"] + row["exposed_bwd_ms"]
        layer = row["gemm_ms"] + exposed + row["split_cost_ms"]
        want.update(exposed_ms=exposed, layer_ms=layer,
                    exposed_share=(exposed + row["split_cost_ms"]) / layer)
    if kind == "memory" and all(_num(row.get(k)) for k in
                                ("sbh_per_layer", "seq_len", "batch", "hidden", "layers")):
        per_layer = row["sbh_per_layer"] * row["seq_len"] * row["batch"] * row["hidden"]
        want.update(bytes_per_layer=per_layer, model_gib=per_layer * row["layers"] / 2**30)
    if kind == "sim" and _num(row.get("bubble")) and row["bubble"] < 1:
        want["bubble_over_useful"] = row["bubble"] / (1 - row["bubble"])
    if kind == "op" and all(_num(row.get(k)) for k in ("flops", "bytes")) and _num(ms) \
            and ms > 0:  # profile_breakdown's roofline points
        want["tflops"] = timing.tflops(row["flops"], ms)
        if row["bytes"]:
            want["intensity"] = row["flops"] / row["bytes"]
    if kind == "step" and _num(row.get("window_ms")) and _num(row.get("busy_ms")) \
            and row["window_ms"] > 0:
        want["idle_ms"] = max(0.0, row["window_ms"] - row["busy_ms"])
        want["idle_share"] = want["idle_ms"] / row["window_ms"]
    return want


def check_rows(doc: dict) -> list[str]:
    """Derived fields that do not recompute from their row's inputs."""
    problems = []
    for i, row in enumerate(doc.get("rows") or []):
        name = row.get("setup") or row.get("provider") or row.get("kind") or "?"
        try:
            want = expected(row)
        except Exception as e:  # an unknown preset, a missing input, ...
            problems.append(f"row {i} ({name}): cannot recompute: "
                            f"{type(e).__name__}: {e}")
            continue
        for key, w in want.items():
            got = row.get(key)
            if _num(got) and not math.isclose(got, w, rel_tol=RTOL):
                problems.append(f"row {i} ({name}): {key}={got:.6g} but its inputs give "
                                f"{w:.6g}")
    return problems


# ---------------------------------------------------------------- provenance


def check_provenance(doc: dict) -> list[str]:
    """Missing or empty provenance keys, and values that cannot be right."""
    p = doc.get("provenance")
    if not isinstance(p, dict):
        return ["no provenance"]
    on_cpu = str(p.get("gpu") or "").startswith("CPU")
    problems = [f"provenance lacks {k}" for k in REQUIRED
                if p.get(k) in (None, "") and not (on_cpu and k in CPU_MAY_LACK
                                                   and k in p)]
    extra = sorted(set(p) - set(WRITTEN))
    if extra:
        problems.append(f"provenance has keys no run writes (edited by hand?): "
                        f"{', '.join(extra)}")
    if p.get("gpu_count") is not None and not (
            isinstance(p["gpu_count"], int) and p["gpu_count"] >= 1):
        problems.append(f"gpu_count={p['gpu_count']!r} is not a positive integer")
    if p.get("git_sha") and not re.fullmatch(r"[0-9a-f]{7,40}", str(p["git_sha"])):
        problems.append(f"git_sha={p['git_sha']!r} is not a commit")
    if p.get("date"):
        try:
            _dt.datetime.fromisoformat(str(p["date"]))
        except ValueError:
            problems.append(f"date={p['date']!r} is not an ISO date")
    return problems


# ---------------------------------------------------------------- history


def _git(repo_root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo_root, capture_output=True, text=True)


def _doc_at(repo_root, rev: str, rel: str):
    """The file's JSON at `rev` (None: absent there; {} when it does not parse)."""
    out = _git(repo_root, "show", f"{rev}:{rel}")
    if out.returncode != 0:
        return None
    try:
        return json.loads(out.stdout)
    except ValueError:
        return {}


def check_history(path, repo_root) -> list[str]:
    """The provenance must be the one committed together with the rows it describes:
    the working tree's provenance equals that of the newest commit that changed the
    rows. Nothing to check for a file never committed, or whose rows differ from
    HEAD's (an uncommitted re-run). A shallow clone that lacks the commit that
    changed the rows gives "history unavailable"."""
    root = Path(repo_root).resolve()
    rel = Path(path).resolve().relative_to(root).as_posix()
    log = _git(root, "log", "--format=%H", "--", rel)
    if log.returncode != 0:
        return [f"history unavailable: git log failed: {log.stderr.strip()[:200]}"]
    head = _doc_at(root, "HEAD", rel)
    if not log.stdout.split() or head is None:
        return []  # never committed (or deleted at HEAD): nothing to compare
    current = json.loads(Path(path).read_text())
    if current.get("rows") != head.get("rows"):
        return []  # an uncommitted re-run: its provenance is new too
    shallow = _git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    for c in log.stdout.split():
        parent = _doc_at(root, f"{c}^", rel)
        if parent is None and _git(root, "rev-parse", "-q", "--verify",
                                   f"{c}^").returncode != 0 and shallow:
            return [f"history unavailable: shallow clone; the commit that changed the "
                    f"rows is at or before {c[:10]} (fetch full history: git fetch "
                    f"--unshallow)"]
        doc = _doc_at(root, c, rel) or {}
        if parent is not None and parent.get("rows") == doc.get("rows"):
            continue  # this commit did not change the rows
        committed = doc.get("provenance") or {}
        now = current.get("provenance") or {}
        diff = sorted(k for k in set(committed) | set(now)
                      if committed.get(k) != now.get(k))
        if not diff:
            return []
        subject = _git(root, "log", "-1", "--format=%s", c).stdout.strip()[:60]
        return [f"provenance differs from the one committed with its rows in {c[:10]} "
                f"({subject!r}) in {', '.join(diff)}: edited by hand? re-run instead"]
    return []


def committed_results(repo_root=REPO_ROOT) -> list[Path]:
    """The results files git tracks (every `results/*/*.json` without git)."""
    out = _git(repo_root, "ls-files", "--", "results/*/*.json")
    if out.returncode != 0:
        return sorted(Path(repo_root).glob("results/*/*.json"))
    return sorted(Path(repo_root) / p for p in out.stdout.split())


def check_file(path, repo_root=REPO_ROOT) -> list[str]:
    """All of the above for one results file."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        return [f"unreadable: {e}"]
    return check_provenance(doc) + check_rows(doc) + check_history(path, repo_root)


def check_all(results_root, repo_root) -> dict[Path, list[str]]:
    """Problems of every `<results_root>/*/*.json`, by path (clean files included)."""
    paths = sorted(Path(results_root).glob("*/*.json"))
    return {p: check_file(p, repo_root) for p in paths}


# ---------------------------------------------------------------- notebooks

_CALL = re.compile(r"^(?!\s*(?:from|import)\s)[^#\n]*\bshow_source\(", re.M)
_BANNER = re.compile(re.escape(BANNER_PREFIX)
                     + r"(\S+) \((?:recorded|measured live), commit (\S+)\)$")
_BANNER_DATE = re.compile(r"^  \d+ x .*?, (\d{4}-\d\d-\d\d \d\d:\d\d), by `")
_OLD_BANNER = re.compile(r"^(Recorded|Measured live) on \d+ x .*commit [0-9a-f?]+\)")


def _text(v) -> str:
    return "".join(v) if isinstance(v, list) else (v or "")


def _resolve(source_of: str):
    """The object a notebook showed, by its recorded "module:qualname"."""
    return pkgutil.resolve_name(source_of)


def _check_source(where: str, out: dict, meta: dict) -> list[str]:
    src_of, lines = meta.get("source_of", "?"), meta.get("lines")
    try:
        now = notebook.source_text(_resolve(src_of), tuple(lines) if lines else None)
    except Exception as e:
        return [f"{where}: cannot find the source of {src_of}: {type(e).__name__}: {e}"]
    shown = _text(out.get("data", {}).get("text/plain"))
    if shown == now:
        return []
    a, b = shown.splitlines(), now.splitlines()
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return [f"{where}: shows {src_of} lines={lines} as it was, not as it is now (first "
            f"difference at line {i + 1}): re-execute the notebook"]


def _check_banners(where: str, text: str, repo_root: Path) -> list[str]:
    problems, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if _OLD_BANNER.match(line):
            problems.append(f"{where}: banner in the old format, names no results file: "
                            f"re-execute the notebook")
        if not line.startswith(BANNER_PREFIX):
            continue
        m = _BANNER.match(line)
        if not m:
            problems.append(f"{where}: banner names no results file: {line[:90]!r}")
            continue
        rel, sha = m.groups()
        try:
            prov = json.loads((repo_root / rel).read_text())["provenance"]
        except (OSError, ValueError, KeyError) as e:
            problems.append(f"{where}: banner names {rel}, unreadable: {e}")
            continue
        now = str(prov.get("git_sha") or "?")[:10]
        if now != sha:
            problems.append(f"{where}: banner says {rel} is from commit {sha}, the file "
                            f"now says {now}: re-execute the notebook")
        d = _BANNER_DATE.match(lines[i + 1]) if i + 1 < len(lines) else None
        date = str(prov.get("date") or "?")[:16].replace("T", " ")
        if d and d.group(1) != date:
            problems.append(f"{where}: banner dates {rel} {d.group(1)}, the file "
                            f"{date}: re-execute the notebook")
    return problems


def _check_caption(where: str, meta: dict, repo_root: Path) -> list[str]:
    """A caption (`notebook.Caption`) records its results file's commit and date in its
    metadata: both must still be the file's."""
    rel = meta.get("results", "?")
    try:
        prov = json.loads((repo_root / rel).read_text())["provenance"]
    except (OSError, ValueError, KeyError) as e:
        return [f"{where}: caption names {rel}, unreadable: {e}"]
    problems = []
    now, then = str(prov.get("git_sha") or "?"), str(meta.get("git_sha") or "?")
    if now[:10] != then[:10]:
        problems.append(f"{where}: caption says {rel} is from commit {then[:10]}, the "
                        f"file now says {now[:10]}: re-execute the notebook")
    elif str(prov.get("date") or "?") != str(meta.get("date") or "?"):
        problems.append(f"{where}: caption dates {rel} {meta.get('date')}, the file "
                        f"{prov.get('date')}: re-execute the notebook")
    return problems


def check_notebook(path, repo_root=REPO_ROOT) -> list[str]:
    """Stale outputs of one notebook: a `show_source` output that differs from the
    source today (or a `show_source` call whose output records nothing, i.e. from
    before outputs recorded it), and a results banner whose commit is not the one
    its results file now records."""
    nb = json.loads(Path(path).read_text())
    problems = []
    for ci, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        where, recorded = f"{Path(path).name} cell {ci}", 0
        for out in cell.get("outputs", []):
            meta = (out.get("metadata") or {}).get(notebook.SOURCE_KEY)
            if isinstance(meta, dict) and "source_of" in meta:
                recorded += 1
                problems += _check_source(where, out, meta)
            if isinstance(meta, dict) and "results" in meta:
                problems += _check_caption(where, meta, Path(repo_root))
            for one in (meta or {}).get("captions", []) if isinstance(meta, dict) else []:
                problems += _check_caption(where, one, Path(repo_root))
            text = _text(out.get("text")) or _text(out.get("data", {}).get("text/plain"))
            problems += _check_banners(where, text, Path(repo_root))
        if _CALL.search(_text(cell.get("source"))) and not recorded:
            problems.append(f"{where}: calls show_source but no output records what it "
                            f"showed (stale output): re-execute the notebook")
    return problems


def main(argv=None) -> int:
    """Check every results file and every notebook of the book; print the problems."""
    found = check_all(REPO_ROOT / "results", REPO_ROOT)
    notebooks = sorted((REPO_ROOT / "book").glob("*.ipynb"))
    found.update({p: check_notebook(p) for p in notebooks})
    bad = {p: v for p, v in found.items() if v}
    for p, problems in bad.items():
        print(p.relative_to(REPO_ROOT))
        for msg in problems:
            print(f"  {msg}")
    print(f"{len(found) - len(bad)} of {len(found)} files clean")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
