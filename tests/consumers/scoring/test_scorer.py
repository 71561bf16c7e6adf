"""The micro-batched scorer: what the service and the backtest run, checked against the parallel forward.

Every registered detector, no exemptions: a tiny freshly built detector (float32, the serving dtype) over a
small generated dataset whose micro-batches hold several events of one account.
"""

import dataclasses
from datetime import timedelta

import numpy as np
import polars as pl
import pytest
import torch

from consumers.scoring.account_state import AccountRecord, decode_account_record
from consumers.scoring.messages import Transaction, transactions_from_frame
from consumers.scoring.scorer import Scorer
from models.registry import REGISTRY, build_detector
from models.state_codec import encode_account_state
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features import TERMINAL_BUCKET_COLUMN, FeatureSpec, compute_features, fit_feature_spec
from pipeline.registry.artifact import LoadedModel

DETECTORS = sorted(REGISTRY)
TINY = {"num_features": 26, "d_model": 8, "num_layers": 1, "dropout": 0.0}
# Short Transformer window, so account histories run well past it.
OVERRIDES = {"transformer": {"window_events": 8}}
BATCH_EVENTS = 97  # not a divisor of anything: batches cut account histories at odd places


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:
    return generate(GenerateConfig(accounts=40, days=30, seed=5)).sort("ts", "event_id")


@pytest.fixture(scope="module")
def features(frame: pl.DataFrame) -> pl.DataFrame:
    return compute_features(frame)


@pytest.fixture(scope="module")
def spec(frame: pl.DataFrame, features: pl.DataFrame) -> FeatureSpec:
    start = frame["ts"].min()
    return fit_feature_spec(features, start, start + timedelta(days=20))


def make_model(name: str, spec: FeatureSpec, seed: int = 0, **overrides) -> LoadedModel:
    torch.manual_seed(seed)
    detector = build_detector(name, {**TINY, **OVERRIDES.get(name, {}), **overrides})
    return LoadedModel(detector=detector, spec=spec)


def logits(records) -> np.ndarray:
    return np.array([r.logit for r in records])


def changed_accounts(scorer: Scorer) -> frozenset[str]:
    # Accounts with events applied since the last take_changed(), without taking them.
    return frozenset(scorer._changed)


# -- parity with training ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DETECTORS)
def test_replay_equals_parallel_forward_over_each_account_history(name, frame, features, spec):
    # Several events of one account per micro-batch, or the rounds would never be exercised.
    per_batch = frame.with_row_index("i").group_by(pl.col("i") // BATCH_EVENTS, "account_id").len()
    assert per_batch["len"].max() >= 5

    model = make_model(name, spec)
    scored = Scorer(model).replay(frame, batch_events=BATCH_EVENTS)
    assert scored["event_id"].to_list() == features["event_id"].to_list()
    assert scored.columns == ["event_id", "account_id", "ts", "score", "logit", "alert", "is_fraud"]
    np.testing.assert_allclose(scored["score"], 1 / (1 + np.exp(-scored["logit"].to_numpy())), rtol=1e-12)

    lengths = features.group_by("account_id").len().sort("len", "account_id")
    chosen = lengths["account_id"].gather([0, len(lengths) // 3, len(lengths) // 2, len(lengths) - 1])
    assert len(set(lengths.filter(pl.col("account_id").is_in(chosen.implode()))["len"])) >= 3
    for account in chosen:
        rows = features.filter(pl.col("account_id") == account)  # (ts, event_id) order
        buckets = rows[TERMINAL_BUCKET_COLUMN].to_numpy()[:, None].astype(np.float32)
        x = torch.from_numpy(np.concatenate([spec.matrix(rows), buckets], axis=1))  # [T, F + 1]
        with torch.inference_mode():
            parallel, _ = model.detector(x[None])
        stepped = scored.filter(pl.col("account_id") == account)["logit"].to_numpy()
        np.testing.assert_allclose(stepped, parallel[0].double().numpy(), rtol=0, atol=1e-5)


# -- exactly-once and ordering -------------------------------------------------------------------------


@pytest.mark.parametrize("name", DETECTORS)
def test_duplicate_delivery_changes_nothing(name, frame, spec):
    model = make_model(name, spec)
    txs = transactions_from_frame(frame.head(450))
    positions = [(0, i) for i in range(len(txs))]
    scorer = Scorer(model)
    first = scorer.score(txs[:300], positions[:300])
    assert [r.event_id for r in first] == [t.event_id for t in txs[:300]]
    assert first[7].position == (0, 7)
    scorer.take_changed()
    before = {a: scorer.account_state_bytes(a) for a in scorer.accounts_in_memory}
    # One gather and encode for all accounts gives each account's own record, in the order asked.
    backwards = sorted(before, reverse=True)
    assert scorer.account_states_bytes(backwards) == [before[a] for a in backwards]

    assert scorer.score(txs[:300], positions[:300]) == []  # the whole poll again, e.g. after a crash
    assert scorer.stats.duplicates_dropped == 300
    assert changed_accounts(scorer) == frozenset()
    assert {a: scorer.account_state_bytes(a) for a in scorer.accounts_in_memory} == before

    # A redelivery overlapping new events applies the new ones only, exactly as a clean delivery would.
    overlap = scorer.score(txs[200:450], positions[200:450])
    clean = Scorer(model)
    clean.score(txs[:300], positions[:300])
    expected = clean.score(txs[300:450], positions[300:450])
    assert [r.event_id for r in overlap] == [t.event_id for t in txs[300:450]]
    np.testing.assert_array_equal(logits(overlap), logits(expected))

    # The same message twice within one poll is applied once.
    extra = Transaction("E-new", txs[0].account_id, txs[-1].ts_us + 1, 12.0, txs[0].terminal_id)
    twice = scorer.score([extra, extra], [(0, 450), (0, 450)])
    assert [r.event_id for r in twice] == ["E-new"]


@pytest.mark.parametrize("name", DETECTORS)
def test_out_of_order_events_are_flagged_and_scored(name, frame, spec):
    txs = transactions_from_frame(frame.head(300))
    scorer = Scorer(make_model(name, spec))
    assert not any(r.out_of_order for r in scorer.score(txs))  # time order: nothing late
    account, terminal, newest = txs[-1].account_id, txs[-1].terminal_id, txs[-1].ts_us
    hour = 3_600_000_000
    batch = [
        Transaction("late", account, newest - hour, 10.0, terminal),
        Transaction("same-ts", account, newest, 10.0, terminal),  # not older: not late
        Transaction("next", account, newest + hour, 10.0, terminal),
        Transaction("late-in-batch", account, newest + hour // 2, 10.0, terminal),  # older than "next"
        Transaction("other", "A-new", newest - 10 * hour, 10.0, terminal),  # a new account has no past
    ]
    records = scorer.score(batch)
    assert [r.out_of_order for r in records] == [True, False, False, True, False]
    assert all(np.isfinite(r.logit) for r in records)
    assert scorer.stats.out_of_order == 2


# -- state records ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DETECTORS)
def test_evicted_and_restored_account_scores_as_if_never_evicted(name, frame, spec):
    model = make_model(name, spec)
    txs = transactions_from_frame(frame.head(1200))
    positions = [(3, 1000 + i) for i in range(len(txs))]
    straight, evicting = Scorer(model), Scorer(model)
    batches = [slice(s, s + 150) for s in range(0, len(txs), 150)]
    parked: dict[str, bytes] = {}
    for k, part in enumerate(batches):
        expected = straight.score(txs[part], positions[part])
        got = evicting.score(txs[part], positions[part])
        np.testing.assert_array_equal(logits(got), logits(expected))
        evicting.take_changed()  # as the service does once the records are produced
        in_next = {t.account_id for t in txs[batches[k + 1]]} if k + 1 < len(batches) else set()
        # Accounts parked last time come back in another order than they left (free rows get reused).
        for account in sorted(parked, reverse=True):
            evicting.restore_account(account, parked.pop(account))
        # Park a few accounts absent from the next batch; restore any that the next batch needs now.
        leaving = sorted(evicting.accounts_in_memory)[k::4][:3]
        parked.update(zip(leaving, evicting.account_states_bytes(leaving), strict=True))
        for account in leaving:
            evicting.evict(account)
            assert account not in evicting.accounts_in_memory
            if account in in_next:
                evicting.restore_account(account, parked.pop(account))
    assert evicting.stats.events_applied == len(txs)
    for account, data in parked.items():
        evicting.restore_account(account, data)

    # The position travels with the record: a restored account still drops its redelivered events.
    account = txs[-1].account_id
    data = evicting.account_state_bytes(account)
    evicting.evict(account)
    evicting.restore_account(account, data)
    assert evicting.score(txs[-1:], positions[-1:]) == []


@pytest.mark.parametrize("name", DETECTORS)
def test_batched_state_records_are_account_records_byte_for_byte(name, frame, spec):
    scorer = Scorer(make_model(name, spec))
    txs = transactions_from_frame(frame.head(300))
    scorer.score(txs, [(i % 3, 1_000 + i) for i in range(300)])
    accounts = sorted(scorer.accounts_in_memory)
    records = scorer.account_states_bytes(accounts)
    last = {t.account_id: (i % 3, 1_000 + i, t.ts_us) for i, t in enumerate(txs)}  # each account's last event
    for account, data in zip(accounts, records, strict=True):
        record = decode_account_record(data, account)
        assert (record.partition, record.offset, record.last_ts_us) == last[account]
        assert record.model == scorer.model_fingerprint
        assert record.detector == encode_account_state(
            scorer.detector, scorer.store.gather(scorer.store.rows([account]))
        )
        assert AccountRecord(**dataclasses.asdict(record)).to_bytes() == data  # the one-record layout


@pytest.mark.parametrize("name", DETECTORS)
def test_record_of_another_model_is_refused_with_a_clear_message(name, frame, spec):
    txs = transactions_from_frame(frame.head(200))
    source = Scorer(make_model(name, spec))
    source.score(txs)
    account = txs[0].account_id
    data = source.account_state_bytes(account)
    other_name = next(n for n in DETECTORS if n != name)
    refusals = {
        f"state of detector '{name}', but this model is '{other_name}'": make_model(other_name, spec),
        "config fingerprint": make_model(name, spec, d_model=16),
        f"another '{name}' model with the same config": make_model(name, spec, seed=1),
    }
    for message, model in refusals.items():
        target = Scorer(model)
        with pytest.raises(ValueError, match=message) as refused:
            target.restore_account(account, data)
        assert account in str(refused.value) and "replaying" in str(refused.value)
        assert list(target.accounts_in_memory) == []  # refused: nothing changed

    with pytest.raises(ValueError, match="not a txsentinel account state"):
        source.restore_account(account, b"XXXX" + data[4:])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        source.restore_account(account, data[:-1])
    fresh = Scorer(make_model(name, spec))
    fresh.restore_account(account, data)
    np.testing.assert_array_equal(fresh.account_state_bytes(account), data)


def test_evicting_unsaved_changes_is_refused(frame, spec):
    scorer = Scorer(make_model(DETECTORS[0], spec))
    txs = transactions_from_frame(frame.head(50))
    scorer.score(txs, [(0, i) for i in range(50)])
    account = txs[0].account_id
    with pytest.raises(ValueError, match="take_changed"):
        scorer.evict(account)
    assert set(scorer.accounts_in_partition(0)) == set(scorer.accounts_in_memory)
    assert scorer.accounts_in_partition(1) == []
    scorer.evict(account, discard_changes=True)
    with pytest.raises(KeyError, match="not in memory"):
        scorer.account_state_bytes(account)


# -- alerts and model checks -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", DETECTORS)
def test_alert_follows_the_threshold(name, frame, spec):
    model = make_model(name, spec)
    txs = transactions_from_frame(frame.head(400))
    scores = np.array([r.score for r in Scorer(model).score(txs)])
    threshold = float(np.median(scores))
    records = Scorer(model, threshold=threshold).score(txs)
    assert [r.alert for r in records] == [r.score >= threshold for r in records]
    assert 0 < sum(r.alert for r in records) < len(records)

    model.meta["threshold"] = 0.25
    assert Scorer(model).threshold == 0.25
    assert Scorer(model, threshold=0.75).threshold == 0.75
    with pytest.raises(ValueError, match="probability"):
        Scorer(model, threshold=1.5)


def test_model_and_spec_must_agree(spec):
    with pytest.raises(ValueError, match="feature spec gives 26"):
        Scorer(make_model(DETECTORS[0], spec, num_features=5))
    half = make_model(DETECTORS[0], spec)
    half.detector.half()
    with pytest.raises(ValueError, match="float32 at least"):
        Scorer(half)
