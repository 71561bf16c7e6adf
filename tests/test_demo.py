"""The main job (`make demo`) end to end at a small size, against the project's real Kafka broker: train,
promote, compare, serve the champion, stream through Kafka, summarise."""

import pytest

from pipeline.cli.demo import DemoConfig, run_demo


@pytest.mark.slow
def test_demo_trains_promotes_serves_and_scores_every_streamed_event(
    kafka_bootstrap, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg = DemoConfig(
        accounts=150,
        days=30,
        test_days=7,
        max_epochs=1,
        stream_days=1,
        stream_events_per_s=500,
        workdir=tmp_path,
        bootstrap_servers=kafka_bootstrap,
    )
    assert run_demo(cfg) == 0  # 0 only when every streamed event came back scored
    out = capsys.readouterr().out
    assert "champion:" in out and "latency p50" in out
    for model in ("lstm", "linear_transformer", "transformer", "logreg", "isolation_forest"):
        assert model in out
    assert (tmp_path / "comparison" / "comparison.csv").exists()
    assert "restore done" in (tmp_path / "serve.log").read_text()
