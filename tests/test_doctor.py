"""The profiler summary (`colossal_lab.measure.profile`) and the doctor (`colossal_lab.doctor`).

The kernel classifier on real kernel names; the summary and the roofline on a live CPU
trace of the tiny model and on a synthetic GPU trace (Kineto's format, real kernel
names, known overlaps, read by HolisticTraceAnalysis too); every doctor check fires on
a deliberately bad configuration and stays silent on the best one; the command line on
this CPU machine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from colossal_lab import doctor
from colossal_lab.config import SWITCH_SETS, preset
from colossal_lab.doctor import Finding, Machine, Plan, Verdict
from colossal_lab.measure import profile, results
from colossal_lab.switches.checkpointing import GradientCheckpointConfig

# ------------------------------------------------------------------ the classifier

REAL_NAMES = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
     "execute_segment_k_off_kernel__5x_cublas", "GEMM"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT", "GEMM"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_"
     "align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)",
     "GEMM"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, "
     "__nv_bfloat16, false, false, false>(cublasLt::cublasSplitKParams<float>)", "GEMM"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_"
     "kernel0_0", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x128x128_4x1x1_"
     "kernel0_0", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, "
     "false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> "
     ">, false, true, false, false, true, true, false, false>(pytorch_flash::"
     "Flash_fwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
     "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
     "attention"),
    ("_attn_fwd_kernel", "attention"),
    ("_attn_bwd_dkdv_kernel", "attention"),
    ("void at::native::(anonymous namespace)::softmax_warp_forward<c10::BFloat16, "
     "c10::BFloat16, float, 11, false, false>(c10::BFloat16*, c10::BFloat16 const*, int, "
     "int, int, bool const*, int, bool)", "attention"),
    ("_rms_norm_forward_kernel", "norm"),
    ("_rms_norm_backward_kernel", "norm"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, "
     "false>(int, float, float const*, float const*, float const*, float*, float*, float*)",
     "norm"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda("
     "at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#2}::operator()"
     "() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, at::native::rsqrt_kernel_"
     "cuda(at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda()#2}::"
     "operator()() const::{lambda(float)#1}, std::array<char*, 2ul>)", "norm"),
    ("_rope_kernel", "rope"),
    ("_triton_rope", "rope"),
    ("_swiglu_forward_kernel", "activation"),
    ("triton_poi_fused_mul_silu_0", "activation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
     "silu_kernel(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#5}"
     "::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, ...)",
     "activation"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
     "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::"
     "operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}> >(int, "
     "at::native::gpu_kernel_impl_nocast<...>)", "copies/casts"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
     "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#7}::operator()"
     "() const::{lambda(float)#1}, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, "
     "unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::"
     "LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, ...)", "copies/casts"),
    ("Memcpy HtoD (Pageable -> Device)", "copies/casts"),
    ("Memset (Device)", "copies/casts"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
     "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
     "copies/casts"),
    ("_fp8_cast_transpose_kernel", "copies/casts"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<"
     "c10::BFloat16>, std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<"
     "c10::BFloat16>, std::array<char*, 3ul>)", "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
     "MeanOps<float, float, float, float>, unsigned int, float, 4, 4> >(at::native::"
     "ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, "
     "4, 4>)", "elementwise"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, "
     "int)", "loss"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, "
     "float, long>(float*, float*, float const*, long const*, float const*, bool, long, "
     "long, long, long)", "loss"),
    ("_cross_entropy_kernel", "loss"),
    ("liger_cross_entropy_kernel", "loss"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
     "(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::"
     "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, "
     "double, double, double, double, bool, float const*, float const*>(...)", "optimizer"),
    ("multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamWMathFunctor<float>>",
     "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
     "(anonymous namespace)::TensorListMetadata<1>, at::native::(anonymous namespace)::"
     "LpNormFunctor<float, (at::native::(anonymous namespace)::NormType)1, float, float>, "
     "float*, int>(...)", "optimizer"),
    ("_adamw_kernel", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
     "communication"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
     "communication"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, "
     "unsigned int, 2, 2, -2, true>(...)", "other"),
    # operators, as a CPU trace names them
    ("aten::mm", "GEMM"),
    ("aten::addmm", "GEMM"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::_fused_adamw_", "optimizer"),
    ("aten::copy_", "copies/casts"),
    ("aten::mul", "elementwise"),
    ("TritonRMSNormFunction", "norm"),
    ("c10d::allreduce_", "communication"),
    ("aten::embedding", "other"),
]


@pytest.mark.parametrize("name,cls", REAL_NAMES, ids=[f"{c}:{n[:40]}" for n, c in REAL_NAMES])
def test_classify_real_kernel_names(name, cls):
    assert profile.classify(name) == cls


def test_short_name_drops_void_and_arguments():
    assert profile.short_name("void foo<int, (bar)1>(float*, int)") == "foo<int, (bar)1>"
    assert len(profile.short_name("x" * 300, width=50)) == 50


def test_intervals():
    assert profile.union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert profile.length([(0, 2), (1, 3), (5, 6)]) == 4
    assert profile.overlap([(0, 10)], [(2, 3), (9, 12)]) == 2


# ------------------------------------------------------------------ a CPU trace


@pytest.fixture(scope="module")
def cpu_trace(tmp_path_factory):
    """Four steps of the tiny model (naive bf16: no Triton interpreter) profiled on this
    CPU: one waiting, one warm-up, two recorded."""
    from colossal_lab.model import build_model
    from colossal_lab.switches.apply import apply_switches
    from colossal_lab.training import data, train

    torch.manual_seed(0)
    cfg = preset("tiny")
    model = apply_switches(build_model(cfg, "cpu"),
                           SWITCH_SETS["bf16"].replace(enable_flash_attention="sdpa"))
    step = train.make_step(model, train.make_optimizer(model))
    batches = data.random_batches(cfg.vocab_size, 2, 64, seed=0, device="cpu")
    path = tmp_path_factory.mktemp("trace") / "tiny.json"
    return profile.profile_steps(step, batches, path,
                                 schedule=profile.Schedule(wait=1, warmup=1, active=2))


def test_profile_writes_a_trace_without_stderr_noise(cpu_trace, capfd):
    trace = profile.load_trace(cpu_trace)
    assert any(e.get("name", "").startswith("ProfilerStep#") for e in trace["traceEvents"])
    assert "USDT" not in capfd.readouterr().err


def test_profile_keeps_its_one_cycle_and_warns_nothing(tmp_path, monkeypatch):
    """torch 2.11's profiler warns on every first cycle ("Profiler clears events at the
    end of each cycle", with its file path, on stderr) unless `acc_events=True`; with
    one cycle that flag changes nothing in the trace, so `profile_steps` passes it."""
    import warnings

    import torch.profiler as tp

    seen = {}
    real = tp.profile

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)

    monkeypatch.setattr(tp, "profile", spy)
    step = lambda ids, labels: (ids.float() @ ids.float().T).sum()  # noqa: E731
    batches = iter([(torch.ones(4, 4), None)] * 6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = profile.profile_steps(step, batches, tmp_path / "t.json", cuda=False,
                                     schedule=profile.Schedule(wait=1, warmup=1, active=2))
    assert seen.get("acc_events") is True and path.exists()
    assert not [w for w in caught if "Profiler clears events" in str(w.message)]


def test_cpu_summary(cpu_trace):
    s = profile.summarize(cpu_trace)
    assert s.device == "cpu" and s.steps == 2 and s.hta is None
    assert 0 < s.busy_ms <= s.window_ms and s.idle_ms == pytest.approx(s.window_ms - s.busy_ms)
    for cls in ("GEMM", "attention", "optimizer", "loss", "elementwise"):
        assert s.classes[cls] > 0, cls
    # self times partition the operators' time: their sum is the busy time, one thread
    assert sum(s.classes.values()) == pytest.approx(s.busy_ms, rel=0.02)
    assert s.data_ms > 0 and s.data_stall_ms <= s.data_ms + 1e-9
    assert s.top[0]["ms"] >= s.top[-1]["ms"] and len(s.top) == 10
    rows = profile.breakdown_rows(s, setup="tiny")
    assert [r["kind"] for r in rows][:1] == ["step"] and rows[0]["setup"] == "tiny"
    shares = [r["share"] for r in rows if r["kind"] == "class"]
    assert sum(shares) == pytest.approx(1.0) and shares == sorted(shares, reverse=True)


def test_cpu_roofline(cpu_trace):
    points = profile.roofline_points(cpu_trace)
    gemm = [p for p in points if p.kernel_class == "GEMM"]
    assert gemm and all(p.flops > 0 and p.bytes > 0 and p.ms > 0 for p in gemm)
    assert max(p.intensity for p in gemm) > max(
        p.intensity for p in points if p.kernel_class == "elementwise")
    import matplotlib

    matplotlib.use("Agg")
    ax = profile.plot_roofline(points, {"peak": (1.0, 50.0), "measured": (0.5, 20.0)})
    assert ax.figure.get_size_inches()[0] <= 9
    rows = profile.breakdown_rows(profile.summarize(cpu_trace), setup="a")
    ax = profile.plot_breakdown(rows + [{**r, "setup": "b"} for r in rows])
    assert ax.figure.get_size_inches()[0] <= 9 and len(ax.get_yticklabels()) == 2
    import matplotlib.pyplot as plt

    plt.close("all")


def test_op_cost_counts_gemm_and_attention():
    bf16 = "c10::BFloat16"
    flops, nbytes = profile.op_cost("aten::mm", {"Input Dims": [[128, 64], [64, 32]],
                                                 "Input type": [bf16, bf16]})
    assert flops == 2 * 128 * 64 * 32 and nbytes == 2 * (128 * 64 + 64 * 32 + 128 * 32)
    q = [2, 4, 256, 16]
    flops, _ = profile.op_cost("aten::_scaled_dot_product_flash_attention",
                               {"Input Dims": [q, q, q], "Input type": [bf16] * 3})
    assert flops == 4 * 2 * 4 * 256 * 256 * 16 * 0.5  # causal
    assert profile.op_cost("aten::mm", {}) is None


def test_op_cost_reads_the_operands_of_every_gemm_form():
    """What the profiler records for out= and bias forms: 2·M·N·K each time, not the
    output taken for an operand (a head's dW with out= once read as 2·K·N·N)."""
    a, b, c, bias = torch.randn(6, 5), torch.randn(5, 3), torch.empty(6, 3), torch.randn(3)
    with torch.profiler.profile(record_shapes=True) as prof:
        torch.mm(a, b, out=c)
        torch.addmm(bias, a, b)
        torch.addmm(c, a, b, out=c)
        torch.bmm(a[None], b[None])
    seen = 0
    for e in prof.events():
        if e.name in ("aten::mm", "aten::addmm", "aten::bmm"):
            types = ["float"] * len(e.input_shapes)
            flops, _ = profile.op_cost(e.name, {"Input Dims": e.input_shapes,
                                                "Input type": types})
            assert flops == 2 * 6 * 5 * 3, (e.name, e.input_shapes)
            seen += 1
    assert seen == 4


# ------------------------------------------------------------------ a GPU trace


def gpu_trace(path, kernels, *, comm=None, data_us=0.0, steps=2):
    """A Kineto-format trace of `steps` steps on one GPU: each step's host range
    (``ProfilerStep#``) opens with a ``data`` range of `data_us`, then launches
    `kernels` ((name, µs) pairs, 10 µs apart) on stream 7; `comm` ((name, start offset,
    µs)) runs on stream 20 during the step."""
    ev, corr, t = [], 1, 1000.0
    host = {"pid": 100, "tid": 100}
    for s in range(steps):
        kt = t + data_us + 5
        total = data_us + 5 + sum(d + 10 for _, d in kernels)
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}",
                   "ts": t, "dur": total, "args": {}, **host})
        if data_us:
            ev.append({"ph": "X", "cat": "user_annotation", "name": "data", "ts": t,
                       "dur": data_us, "args": {}, **host})
        for i, (name, dur) in enumerate(kernels):
            ext = 10_000 * s + i
            ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": kt - 4,
                       "dur": 2, "args": {"External id": ext, "Input Dims": [[64, 64],
                                          [64, 64]], "Input type": ["float", "float"]},
                       **host})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                       "ts": kt - 3, "dur": 1, "args": {"correlation": corr,
                                                       "External id": ext}, **host})
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": kt, "dur": dur,
                       "pid": 0, "tid": 7, "args": {"device": 0, "stream": 7,
                                                    "correlation": corr,
                                                    "External id": ext}})
            kt += dur + 10
            corr += 1
        if comm:
            name, start, dur = comm
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernelExC",
                       "ts": t + 2, "dur": 1, "args": {"correlation": corr}, **host})
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": t + start, "dur": dur,
                       "pid": 0, "tid": 20, "args": {"device": 0, "stream": 20,
                                                     "correlation": corr}})
            corr += 1
        t += total
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}],
           "distributedInfo": {"rank": 0, "world_size": 2, "backend": "nccl"},
           "traceEvents": ev}
    path.write_text(json.dumps(doc))
    return path


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_kernel__5x_cublas"
FLASH = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_kernel0_0"
NORM = "_rms_norm_forward_kernel"
ADAM = "multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamWMathFunctor<float>>"
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"


def test_gpu_summary_classes_idle_and_communication(tmp_path):
    kernels = [(GEMM, 300.0), (FLASH, 200.0), (NORM, 40.0), (ADAM, 60.0)]
    # on stream 7: GEMM 5..305, flash 315..515, norm 525..565, Adam 575..635 µs into
    # each step; the all-reduce on stream 20 runs 400..600: 180 µs under compute,
    # 20 µs (the two 10 µs gaps) exposed
    path = gpu_trace(tmp_path / "rank0.json", kernels, comm=(NCCL, 400.0, 200.0), steps=3)
    s = profile.summarize(path)
    assert s.device == "cuda" and s.steps == 3 and s.kernels_per_step == 5
    assert s.classes["GEMM"] == pytest.approx(0.3) and s.classes["attention"] == \
        pytest.approx(0.2) and s.classes["optimizer"] == pytest.approx(0.06)
    assert s.comm_ms == pytest.approx(0.2)
    assert s.comm_overlapped_ms == pytest.approx(0.18)
    assert s.comm_exposed_ms == pytest.approx(0.02)
    assert s.busy_ms == pytest.approx((600 + 20) / 1e3)
    assert s.idle_ms == pytest.approx(s.window_ms - s.busy_ms)
    assert [r["name"][:16] for r in s.top[:2]] == [GEMM[:16], FLASH[:16]]
    assert s.top[0]["ms"] == pytest.approx(0.3) and s.top[0]["calls"] == 1
    pytest.importorskip("hta")
    assert "error" not in s.hta, s.hta  # HolisticTraceAnalysis read it, and agrees
    assert s.hta["comm_comp_overlap_pctg"] == pytest.approx(
        100 * s.comm_overlapped_ms / s.comm_ms, abs=0.5)
    assert s.hta["idle_pctg"] >= 0 and s.hta["kernel_wait_ms"] >= 0


def test_gpu_step_is_the_device_window_when_the_host_runs_ahead(tmp_path):
    """The host queues a step's kernels and moves on: its ProfilerStep range ends long
    before the GPU does. The step is the device's window, not the host's range."""
    path = gpu_trace(tmp_path / "rank0.json", [(GEMM, 300.0), (FLASH, 200.0)], steps=3)
    doc = json.loads(path.read_text())
    for e in doc["traceEvents"]:
        if e["name"].startswith("ProfilerStep#"):
            e["dur"] = 50.0  # the host's step: 50 µs, the kernels' 520
    path.write_text(json.dumps(doc))
    s = profile.summarize(path, use_hta=False)
    assert s.host_step_ms == pytest.approx(0.05)
    assert s.step_ms == pytest.approx(s.window_ms) and s.step_ms > s.busy_ms >= 0.5
    (row,) = [r for r in profile.breakdown_rows(s, setup="x") if r["kind"] == "step"]
    assert profile.step_ms_of(row) == pytest.approx(s.window_ms)
    old = {**row, "profiled_step_ms": s.host_step_ms}  # recorded before the fix
    assert profile.step_ms_of(old) == pytest.approx(s.window_ms)


def test_gpu_summary_finds_a_data_stall(tmp_path):
    path = gpu_trace(tmp_path / "rank0.json", [(GEMM, 100.0)], data_us=300.0)
    s = profile.summarize(path, use_hta=False)
    assert s.data_ms == pytest.approx(0.3) and s.data_stall_ms == pytest.approx(0.3)
    assert s.idle_share > 0.7


def test_gpu_roofline_times_come_from_kernels(tmp_path):
    path = gpu_trace(tmp_path / "rank0.json", [(GEMM, 100.0), (GEMM, 300.0)])
    (p,) = profile.roofline_points(path)
    assert p.name == "aten::mm" and p.calls == 2 and p.ms == pytest.approx(0.4)
    assert p.flops == 2 * 2 * 64**3


def test_summary_without_steps_says_how():
    with pytest.raises(ValueError, match="prof.step"):
        profile.summarize({"traceEvents": []})


# ------------------------------------------------------------------ doctor checks

H200 = Machine("NVIDIA H200", "h200", 989.4, True, 134.9, reference=True)
BEST = SWITCH_SETS["best"]
NAIVE_FP32 = SWITCH_SETS["naive"]


def plan(**kw) -> Plan:
    sw = kw.pop("switches", BEST)
    name = next((n for n, s in SWITCH_SETS.items() if s == sw), None)
    return Plan(switches=sw, switches_name=name, **kw)


def stalled_summary(**kw) -> profile.ProfileSummary:
    base = {"device": "cuda", "steps": 3, "step_ms": 400.0, "window_ms": 400.0,
            "busy_ms": 380.0, "idle_ms": 20.0, "kernels_per_step": 900}
    return profile.ProfileSummary(**{**base, **kw})


def run_check(check, p: Plan, summary=None):
    rec = doctor.Recorded(H200)
    ctx = doctor.Context(p, H200, rec, doctor.estimate_memory(p, H200.capacity_gib),
                         summary)
    return check(ctx)


CASES = {  # check: (bad plan, its summary), (good plan, its summary)
    "bf16": (doctor.check_bf16, (plan(switches=NAIVE_FP32), None), (plan(), None)),
    "flash": (doctor.check_flash,
              (plan(switches=BEST.replace(enable_flash_attention=False)), None),
              (plan(), None)),
    "fused norm": (doctor.check_fused_norm,
                   (plan(switches=BEST.replace(enable_fused_normalization=False)), None),
                   (plan(), None)),
    "tp size": (doctor.check_tp_size, (plan(tp_size=16), None), (plan(tp_size=8), None)),
    "gemini": (doctor.check_gemini, (plan(gemini=True), None), (plan(), None)),
    "micro-batches": (doctor.check_microbatches,
                      (plan(pp_size=4, num_microbatches=4), None),
                      (plan(pp_size=4, num_microbatches=16), None)),
    "ckpt ratio": (doctor.check_ckpt_ratio, (plan(switches=BEST.replace(
        gradient_checkpoint_config=GradientCheckpointConfig(1.0))), None), (plan(), None)),
    "data loader": (doctor.check_data_loader,
                    (plan(), stalled_summary(data_stall_ms=100.0)),
                    (plan(), stalled_summary())),
    "mfu": (doctor.check_mfu, (plan(switches=SWITCH_SETS["bf16"]), None), (plan(), None)),
    "compile": (doctor.check_compile, (plan(switches=SWITCH_SETS["bf16"]), None),
                (plan(), None)),
    "fp8": (doctor.check_fp8, (plan(), None), (plan(switches=SWITCH_SETS["best-fp8"]), None)),
    "memory": (doctor.check_memory, (plan(batch=64), None), (plan(), None)),
    "host-bound": (doctor.check_host_bound,
                   (plan(), stalled_summary(busy_ms=240.0, idle_ms=160.0)),
                   (plan(), stalled_summary())),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_check_fires_on_bad_and_is_silent_on_good(case):
    check, (bad, bad_summary), (good, good_summary) = CASES[case]
    found = run_check(check, bad, bad_summary)
    assert isinstance(found, Finding), found
    assert found.message and found.fix and found.evidence
    quiet = run_check(check, good, good_summary)
    assert isinstance(quiet, Verdict) and quiet.status == "ok", quiet


def test_every_check_has_a_case():
    assert {CASES[c][0] for c in CASES} == set(doctor.CHECKS)


def test_gains_come_from_recorded_results_or_say_none():
    bf16 = run_check(doctor.check_bf16, plan(switches=NAIVE_FP32))
    rows = {r["setup"]: r for r in json.loads(
        (results.results_dir() / "h200" / "baseline.json").read_text())["rows"]}
    assert bf16.gain == pytest.approx(rows["ours-fp32-naive"]["step_ms"]
                                      / rows["ours-bf16-naive"]["step_ms"])
    assert "results/h200/baseline.json" in bf16.evidence and "reference" in bf16.evidence
    assert bf16.basis == "recorded" and "(recorded)" in doctor.describe_gain(bf16)
    tp = run_check(doctor.check_tp_size, plan(tp_size=16))
    assert tp.gain is None and tp.evidence.startswith(doctor.NOT_RECORDED)
    bubble = run_check(doctor.check_microbatches, plan(pp_size=4, num_microbatches=4))
    assert bubble.basis == "formula" and "not recorded" in doctor.describe_gain(bubble)
    assert bubble.gain == pytest.approx((7 / 4) / (19 / 16))


def test_checks_that_need_a_profile_say_so():
    for check in (doctor.check_data_loader, doctor.check_host_bound):
        v = run_check(check, plan())
        assert isinstance(v, Verdict) and v.status == "not checked" and "--profile" in v.why


def test_best_fp8_is_silent_and_best_only_suggests_fp8():
    assert doctor.diagnose(plan(switches=SWITCH_SETS["best-fp8"]), H200).findings == []
    (only,) = doctor.diagnose(plan(), H200).findings
    assert only.check == "ours: fp8"


def test_ranking_puts_failures_first_then_gain():
    report = doctor.diagnose(plan(switches=NAIVE_FP32, batch=32), H200)
    sev = [f.severity for f in report.findings]
    assert sev[0] == "fails"
    gains = [f.gain or 0.0 for f in report.findings if f.severity == "gain"]
    assert gains == sorted(gains, reverse=True)
    text = str(report)
    assert "will fail" in text and "expected ×" in text and "fine:" in text


def test_memory_model_is_near_the_recorded_peaks():
    """Within 20% of the H200's measured peaks (results/h200/composed.json), each row
    modelled with the AdamW moments it ran with (`optimizer_moments`)."""
    rows = {r["setup"]: r for r in json.loads(
        (results.results_dir() / "h200" / "composed.json").read_text())["rows"]}
    eager_fp8 = "ours-fp8-eager" if "ours-fp8-eager" in rows else "ours-fp8"  # older files
    for setup, sw in (("ours-bf16", BEST), (eager_fp8, SWITCH_SETS["best-fp8"])):
        sw = sw.replace(extra={**sw.extra,
                               "adamw_moments": rows[setup].get("optimizer_moments",
                                                                "fp32")})
        est = doctor.estimate_memory(plan(switches=sw), None).peak(4, 0)
        assert est == pytest.approx(rows[setup]["peak_mem_gib"], rel=0.2), setup


def test_machine_without_gpu_is_the_reference_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    m = doctor.this_machine()
    assert m.reference and m.slug == "h200" and m.supports_fp8


# ------------------------------------------------------------------ the command line


def cli(*args):
    return subprocess.run([sys.executable, "-m", "colossal_lab", "doctor", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_runs_on_this_machine():
    r = cli("--preset", "llama-7b-8l")
    assert r.returncode == 0, r.stderr
    assert "doctor: llama-7b-8l, seq 4096, batch 4" in r.stdout
    assert "[ours: fp8]" in r.stdout and "not checked:" in r.stdout
    if not torch.cuda.is_available():
        assert "reference GPU" in r.stdout


@pytest.mark.parametrize("args,says", [
    (["--switches", "nosuch"], "neither a set"),
    (["--switches", '{"bogus": 1}'], "unknown fields"),
    (["--switches", "{not json"], "not valid JSON"),
    (["--batch", "0"], "must be >= 1"),
    (["--batch", "4", "--micro-batch", "3"], "must divide"),
    (["--tp", "3"], "does not divide"),
    (["--preset", "nosuch"], "invalid choice"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, says, capsys):
    from colossal_lab.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["doctor", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert says in err[-1] and "Traceback" not in "".join(err)


def test_cli_profile_needs_a_gpu_for_big_models(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from colossal_lab.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["doctor", "--preset", "llama-7b-8l", "--profile"])
    assert e.value.code == 2 and "--preset tiny" in capsys.readouterr().err


def test_cli_profile_on_cpu_with_the_tiny_model(tmp_path, capsys):
    from colossal_lab.__main__ import main

    trace = tmp_path / "t.json"
    main(["doctor", "--preset", "tiny", "--seq", "64", "--batch", "2", "--switches", "bf16",
          "--profile", "--trace", str(trace)])
    out = capsys.readouterr().out
    assert trace.exists() and "profile:" in out and "[8 data loader]" in out


def test_benchmark_quick_smoke():
    from colossal_lab.benchmarks import profile_breakdown

    rows = profile_breakdown.run(quick=True, setups=["naive-bf16"])
    kinds = {r["kind"] for r in rows}
    assert kinds == {"step", "class", "kernel", "op"}
    step = next(r for r in rows if r["kind"] == "step")
    assert step["setup"] == "naive-bf16" and step["device"] == "cpu"
    assert step["profiled_step_ms"] > 0 and step["trace_file"] == "naive-bf16.json"
