"""The shadow challenger inside the Scorer: its scores are the challenger's alone, its records promote it."""

import dataclasses
import re
import struct
from datetime import timedelta

import numpy as np
import polars as pl
import pytest
import torch

from consumers.scoring.messages import transactions_from_frame
from consumers.scoring.scorer import Scorer
from models.registry import build_detector
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features import FEATURE_NAMES, compute_features, fit_feature_spec
from pipeline.registry.artifact import LoadedModel

TINY = {"num_features": len(FEATURE_NAMES), "d_model": 8, "num_layers": 1, "dropout": 0.0}
BATCH = 97

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:
    return generate(GenerateConfig(accounts=30, days=20, seed=7)).sort("ts", "event_id")


@pytest.fixture(scope="module")
def spec(frame):
    start = frame["ts"].min()
    return fit_feature_spec(compute_features(frame), start, start + timedelta(days=12))


def model(name, spec, seed):
    torch.manual_seed(seed)
    return LoadedModel(detector=build_detector(name, dict(TINY)), spec=spec)


def batches(frame):
    txs = transactions_from_frame(frame)
    for start in range(0, len(txs), BATCH):
        part = txs[start : start + BATCH]
        yield part, [(0, start + i) for i in range(len(part))]


def test_shadow_scores_equal_the_challenger_alone(frame, spec):
    both = Scorer(model("lstm", spec, 0), shadow=model("linear_transformer", spec, 1), reasons=0)
    alone = Scorer(model("linear_transformer", spec, 1), reasons=0)
    champion = Scorer(model("lstm", spec, 0), reasons=0)
    for txs, pos in batches(frame):
        got = both.score_batch(txs, pos)
        want = alone.score_batch(txs, pos)
        assert np.allclose(got.shadow_logit, [r.logit for r in want.records], rtol=0, atol=1e-5)
        assert [r.logit for r in got.records] == [r.logit for r in champion.score_batch(txs, pos).records]


def test_promoted_shadow_records_continue_as_the_challenger_alone(frame, spec):
    txs = transactions_from_frame(frame)
    cut = len(txs) // 2
    first = [(t, (0, i)) for i, t in enumerate(txs[:cut])]
    both = Scorer(model("lstm", spec, 0), shadow=model("lstm", spec, 2), reasons=0)
    alone = Scorer(model("lstm", spec, 2), reasons=0)
    for scorer in (both, alone):
        scorer.score_batch([t for t, _ in first], [p for _, p in first])
    accounts = sorted(both.accounts_in_memory)
    records = both.shadow_states_bytes(accounts)
    promoted = Scorer(model("lstm", spec, 2), reasons=0)
    promoted.restore_accounts(accounts, records)  # the challenger serves from the shadow's records
    promoted.featurizer.terminals = both.featurizer.terminals  # the global table, restored on its own
    alone_rest = alone.score_batch(txs[cut:], [(0, cut + i) for i in range(len(txs) - cut)])
    rest = promoted.score_batch(txs[cut:], [(0, cut + i) for i in range(len(txs) - cut)])
    assert [r.logit for r in rest.records] == pytest.approx([r.logit for r in alone_rest.records], abs=1e-6)
    assert promoted.account_states_bytes(accounts) == alone.account_states_bytes(accounts)


def test_shadow_restore_keeps_current_records_and_drops_stale_ones(frame, spec):
    txs = transactions_from_frame(frame)
    pos = [(0, i) for i in range(len(txs))]
    both = Scorer(model("lstm", spec, 0), shadow=model("lstm", spec, 2), reasons=0)
    both.score_batch(txs[:200], pos[:200])
    accounts = sorted(both.accounts_in_memory)
    stale = both.shadow_states_bytes(accounts)
    both.score_batch(txs[200:400], pos[200:400])
    current = both.shadow_states_bytes(accounts)
    moved = {t.account_id for t in txs[200:400]}

    again = Scorer(model("lstm", spec, 0), shadow=model("lstm", spec, 2), reasons=0)
    again.restore_accounts(accounts, both.account_states_bytes(accounts))
    assert again.shadow.restore(accounts, current, again.store) == len(accounts)
    assert again.shadow_states_bytes(accounts) == current

    older = Scorer(model("lstm", spec, 0), shadow=model("lstm", spec, 2), reasons=0)
    older.restore_accounts(accounts, both.account_states_bytes(accounts))
    loaded = older.shadow.restore(accounts, stale, older.store)
    assert loaded == len(accounts) - len(moved & set(accounts)) and older.shadow.stale == len(
        moved & set(accounts)
    )


def test_a_shadow_with_other_features_is_refused(spec):
    other = dataclasses.replace(spec, window_days=(1, 2))
    with pytest.raises(ValueError, match=r"shadow model .* computes other features.*window_days"):
        Scorer(model("lstm", spec, 0), shadow=LoadedModel(detector=build_detector("lstm", TINY), spec=other))


def test_a_record_of_another_model_is_refused_by_the_shadow(frame, spec):
    txs = transactions_from_frame(frame)[:100]
    both = Scorer(model("lstm", spec, 0), shadow=model("lstm", spec, 2), reasons=0)
    both.score_batch(txs, [(0, i) for i in range(len(txs))])
    accounts = sorted(both.accounts_in_memory)
    with pytest.raises(ValueError, match=r"shadow state record of .* another model"):
        both.shadow.restore(accounts, both.account_states_bytes(accounts), both.store)


def test_a_corrupt_shadow_record_is_left_out_naming_its_account(frame, spec, caplog):
    txs = transactions_from_frame(frame)[:100]
    both = Scorer(model("lstm", spec, 0), shadow=model("lstm", spec, 2), reasons=0)
    both.score_batch(txs, [(0, i) for i in range(len(txs))])
    accounts = sorted(both.accounts_in_memory)
    records = both.shadow_states_bytes(accounts)
    records[2] = records[2][:-4] + struct.pack("<f", float("nan"))
    assert both.shadow.restore(accounts, records, both.store) == len(accounts) - 1
    assert both.shadow.corrupt == 1 and both.shadow.stale == 0
    assert re.search(rf"shadow state record of {accounts[2]!r}: 'lstm' state 'h' holds nan", caplog.text)


def test_eviction_and_checkpoint_cover_the_shadow(frame, spec):
    txs = transactions_from_frame(frame)[:150]
    both = Scorer(model("lstm", spec, 0), shadow=model("lstm", spec, 2), reasons=0)
    both.score_batch(txs[:100], [(0, i) for i in range(100)])
    account = txs[100].account_id
    before = both.shadow_states_bytes([account])
    checkpoint = both.checkpoint([account], [txs[100].terminal_id])
    both.score_batch(txs[100:101], [(0, 100)])
    assert both.shadow_states_bytes([account]) != before
    both.rollback(checkpoint)
    assert both.shadow_states_bytes([account]) == before
    both.evict(account, discard_changes=True)
    assert account not in both.shadow.store
