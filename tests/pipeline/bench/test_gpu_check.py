"""The GPU check runs the same code on CPU at tiny sizes, so it works when a GPU machine is lent."""

import math

from pipeline.bench.gpu_check import main


def test_gpu_check_runs_small_on_cpu_and_reports_parity(capsys):
    results = main(["--device", "cpu", "--quick"])
    assert set(results) == {"lstm", "transformer", "linear_transformer", "hybrid"}  # every registered one
    for name, r in results.items():
        assert r["step_vs_forward"] < 1e-4, name
        assert r["chunked_vs_whole"] < 1e-4, name
        assert r["step_vs_forward_torch_defaults"] < 1e-4, name  # no TF32 on CPU
        assert math.isnan(r["bf16_vs_fp32"])  # bf16 autocast is only checked on CUDA
        assert r["train_events_per_s"] > 0 and r["step_events_per_s"] > 0
    assert "step=fwd" in capsys.readouterr().out
