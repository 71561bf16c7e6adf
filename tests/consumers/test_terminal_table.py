"""The terminal table's record codec: versioned terminal records and the label positions record."""

import numpy as np
import pytest

from consumers import terminal_table
from pipeline.features.stream import EventBatch, LabelBatch, StreamingFeaturizer


def featurizer_with_two_terminals() -> StreamingFeaturizer:
    featurizer = StreamingFeaturizer()
    ts = np.array([1_700_000_000_000_000, 1_700_000_100_000_000], dtype=np.int64)
    featurizer.transform(EventBatch(["a", "b"], ["t1", "t2"], ts, np.array([5.0, 7.0])))
    featurizer.observe_labels(LabelBatch(["t1"], ts[1:], np.array([True])))
    return featurizer


def test_terminal_records_round_trip_and_only_known_terminals_are_written():
    source = featurizer_with_two_terminals()
    records = terminal_table.changed_records(source, {"t1", "t2", "never-seen"})
    assert [terminal for terminal, _ in records] == ["t1", "t2"]
    for terminal, value in records:
        assert terminal_table.decode_terminal(terminal, value) == source.terminals.get_bytes(terminal)


def test_a_record_of_another_state_version_is_refused_with_what_to_do():
    (_, value), *_ = terminal_table.changed_records(featurizer_with_two_terminals(), {"t1"})
    other = value[:4] + (99).to_bytes(2, "little") + value[6:]
    with pytest.raises(ValueError, match=r"state version 99.*new topic and replay"):
        terminal_table.decode_terminal("t1", other)
    with pytest.raises(ValueError, match="bad magic"):
        terminal_table.decode_terminal("t1", b"nope")


def test_label_positions_round_trip_and_refuse_another_labels_topic():
    data = terminal_table.encode_positions("labels", {1: 7, 0: 3})
    assert terminal_table.decode_positions(data, "labels") == {0: 3, 1: 7}
    with pytest.raises(ValueError, match=r"labels topic 'labels'.*reads 'other-labels'"):
        terminal_table.decode_positions(data, "other-labels")
