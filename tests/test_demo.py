"""The main job (`make demo`) end to end at a small size, against the project's real Kafka broker."""

import pytest

from pipeline.demo import DemoConfig, run_demo


@pytest.mark.slow
def test_demo_streams_through_kafka_and_matches_the_batch_features(kafka_bootstrap, tmp_path, capsys):
    cfg = DemoConfig(
        accounts=200, days=45, stream_days=3, workdir=tmp_path, bootstrap_servers=kafka_bootstrap
    )
    assert run_demo(cfg) == 0
    out = capsys.readouterr().out
    assert "(OK)" in out
    assert (tmp_path / "data" / "transactions.parquet").exists()
