import polars as pl
import pytest

from pipeline.data.generate import GenerateConfig, generate


@pytest.fixture(scope="session")
def generated() -> pl.DataFrame:
    """A generated dataset in event order: 50k+ events, labels known mid-stream, some terminals with more
    fraud reports than they remember."""
    frame = generate(GenerateConfig(accounts=700, days=75, seed=11)).sort("ts", "event_id")
    assert frame.height >= 50_000, frame.height
    return frame
