"""The stream bench's arithmetic and table, without a broker (the README test runs the bench itself)."""

import pytest

from pipeline.bench.stream import _timing, format_table


def test_timing_measures_rate_over_the_outputs_span_and_latency_per_event():
    inputs = {f"e{i}": 1_000 + 10 * i for i in range(100)}  # one event every 10 ms
    outputs = {e: t + (50 if e == "e99" else 5) for e, t in inputs.items()}  # e99 waited 50 ms
    got = _timing(outputs, inputs)
    assert got["span_s"] == pytest.approx(1.035)  # first output at 1,005 ms, last at 2,040 ms
    assert got["events_per_s"] == pytest.approx(99 / 1.035)
    assert got["p50_ms"] == 5 and got["max_ms"] == 50
    assert got["p99_ms"] == pytest.approx(5 + 0.01 * 45)  # numpy's linear interpolation, 99th of 100
    # without inputs (a backlog, whose latency is only its age): the rate alone
    assert _timing(outputs) == {"events_per_s": got["events_per_s"], "span_s": got["span_s"]}


def result(rate: float, ratio: float) -> dict:
    half = {"events_per_s": rate / 2, "p50_ms": 41, "p99_ms": 118, "p99_ms_after_first_10pct": 120}
    return {
        "service": {"events_per_s": rate},
        "raw": {
            "events_per_s": rate / ratio,
            "before": {"events_per_s": rate / ratio * 1.1},
            "after": {"events_per_s": rate / ratio * 0.9},
        },
        "ratio": ratio,
        "half_rate": {**half, "busy_share": 0.68},
        "raw_half_rate": {"p50_ms": 24, "p99_ms": 240},
    }


def test_table_has_a_row_a_model_with_both_latencies_at_half_rate():
    name = "lstm models:/txsentinel@champion"
    lines = format_table({"linear_transformer": result(6203, 0.362), name: result(9840, 0.667)}).splitlines()
    assert "svc/ceiling" in lines[0] and "raw p50 / p99 @half" in lines[0]
    assert set(lines[1]) == {"-"} and len(lines) == 4
    row = lines[3].split()
    assert row[:2] == name.split() and row[2:6] == ["9840", "14753", "-20%", "66.7%"]
    assert row[6:13] == ["4920", "41", "/", "118", "24", "/", "240"] and row[13:] == ["120", "68%"]
    assert len({len(line) for line in lines}) == 1  # the long name widened the column for every row


def test_shadow_rows_pair_each_model_with_an_untrained_shadow_of_its_type_it_can_serve(tmp_path):
    import torch

    from consumers.scoring.shadow import ShadowModel
    from pipeline.bench.stream import _with_shadow
    from pipeline.bench.stream_models import build_default_model
    from pipeline.registry.tracking import load_model

    served = build_default_model("lstm", tmp_path)
    alone, shadowed = _with_shadow("lstm", served, tmp_path)
    assert alone == ("lstm", served, None)
    name, model, shadow = shadowed
    assert (name, model) == ("lstm + shadow", served)
    champion, challenger = load_model(served), load_model(shadow)
    assert challenger.detector.name == "lstm" and challenger.meta["model_version"] == "bench-lstm-shadow"
    ShadowModel(challenger, champion.spec)  # the service takes it as a shadow: same features
    weights = [next(m.detector.parameters()) for m in (champion, challenger)]
    assert not torch.equal(*weights)  # another model, not a copy of the served one
