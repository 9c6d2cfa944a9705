import os, traceback, torch
from colossal_lab.benchmarks import fused_norm as f
from colossal_lab import bench
for mode in ("global", "thread_local", "relaxed"):
    os.environ["COLOSSAL_LAB_CAPTURE_MODE"] = mode
    for prov in ("torch", "triton", "separate"):
        fn = f._provider_fn("add_rms_norm", prov)
        inputs, grads = f._inputs("add_rms_norm", 16384, 4096, torch.bfloat16, torch.device("cuda"))
        for what, g in (("fwd", lambda: fn(*inputs)), ("fwd_bwd", lambda: torch.autograd.grad(f._as_tuple(fn(*inputs)), inputs, grads))):
            try:
                t = bench.time_cuda_graph(g)
                print(mode, prov, what, "ok", round(t.median_ms, 4))
            except Exception as e:
                print(mode, prov, what, "FAIL", type(e).__name__, str(e)[:300])
        torch.cuda.empty_cache()
