"""The micro-batched scorer: what the service and the backtest run, checked against the parallel forward.

Every registered detector, no exemptions: a tiny freshly built detector (float32, the serving dtype) over a
small generated dataset whose micro-batches hold several events of one account.
"""

import dataclasses
import struct
from datetime import timedelta

import numpy as np
import polars as pl
import pytest
import torch

from consumers.scoring.account_state import RECENT_EVENT_IDS, AccountRecord, decode_account_record
from consumers.scoring.messages import Transaction, transactions_from_frame
from consumers.scoring.scorer import Scorer
from models.registry import REGISTRY, build_detector
from models.state_codec import encode_account_state
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features import (
    FEATURE_NAMES,
    TERMINAL_BUCKET_COLUMN,
    FeatureSpec,
    compute_features,
    fit_feature_spec,
)
from pipeline.features.definitions import FEATURE_VERSION
from pipeline.features.state import STATE_VERSION as FEATURIZER_STATE_VERSION
from pipeline.registry.artifact import LoadedModel

DETECTORS = sorted(REGISTRY)
TINY = {"num_features": len(FEATURE_NAMES), "d_model": 8, "num_layers": 1, "dropout": 0.0}
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


def test_a_fitted_hybrid_replays_as_it_runs_in_parallel(frame, features, spec):
    from tests.models.test_hybrid import fitted_hybrid  # trees fitted over a tiny base's scores

    model = LoadedModel(
        detector=fitted_hybrid("linear_transformer", terminal_buckets=spec.terminal_buckets).float(),
        spec=spec,
    )
    scored = Scorer(model).replay(frame, batch_events=BATCH_EVENTS)
    for account in features["account_id"].unique(maintain_order=True).head(4):
        rows = features.filter(pl.col("account_id") == account)
        buckets = rows[TERMINAL_BUCKET_COLUMN].to_numpy()[:, None].astype(np.float32)
        x = torch.from_numpy(np.concatenate([spec.matrix(rows), buckets], axis=1))[None]  # [1, T, F + 1]
        with torch.inference_mode():
            parallel, _ = model.detector(x)
            base, _ = model.detector.base(x)
        stepped = scored.filter(pl.col("account_id") == account)["logit"].to_numpy()
        np.testing.assert_allclose(stepped, parallel[0].double().numpy(), rtol=0, atol=1e-5)
        assert not np.allclose(stepped, base[0].double().numpy(), atol=1e-3)  # the trees scored, not the base


# -- exactly-once and ordering -------------------------------------------------------------------------


def test_a_last_applied_position_past_every_offset_read_is_repaired_not_a_silent_drop(frame, spec):
    # A corrupt changelog record could claim any offset: trusted, it would drop the account's events unseen.
    scorer = Scorer(make_model("lstm", spec))
    txs = transactions_from_frame(frame.head(300))
    scorer.score(txs[:200], [(0, i) for i in range(200)])
    account = txs[200].account_id
    row = scorer.store.rows([account])[0]
    scorer.store.offset[row] = 2**62  # what such a record restores
    scored = scorer.score(txs[200:300], [(0, i) for i in range(200, 300)])
    assert [r.event_id for r in scored] == [t.event_id for t in txs[200:300]]
    assert (scorer.stats.positions_repaired, scorer.stats.duplicates_dropped) == (1, 0)
    assert scorer.store.offset[row] == max(i for i in range(200, 300) if txs[i].account_id == account)
    assert scorer.score(txs[200:300], [(0, i) for i in range(200, 300)]) == []  # redelivered: dropped
    assert scorer.stats.duplicates_dropped == 100

    # A service restoring states ahead of its group's committed offsets (offsets that expired, a new
    # group_id) reads old events again: told the log's end, it drops them as applied, repairing nothing.
    accounts = sorted(scorer.accounts_in_memory)
    restored = Scorer(make_model("lstm", spec))
    restored.restore_accounts(accounts, scorer.account_states_bytes(accounts))
    restored.note_log_ends({0: 300})
    assert restored.score(txs[:100], [(0, i) for i in range(100)]) == []  # the oldest third again
    assert (restored.stats.positions_repaired, restored.stats.duplicates_dropped) == (0, 100)


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


def test_an_event_after_one_stamped_past_the_clock_s_day_is_out_of_order_against_its_stamp(frame, spec):
    # At 23:30 an event stamped 00:20 tomorrow scores as of today's last microsecond (score's docstring);
    # after midnight one stamped 00:10 was still made before it, by the stamps its producer wrote.
    scorer = Scorer(make_model("lstm", spec))
    minute = 60_000_000
    clock = 20_000 * 86_400_000_000 + 23 * 60 * minute + 30 * minute
    ahead = scorer.score_batch(
        [Transaction("E1", "A", clock + 50 * minute, 10.0, "T")], clock_us=clock
    ).records
    after = scorer.score_batch(
        [
            Transaction("E2", "A", clock + 40 * minute, 10.0, "T"),  # 00:10, older than E1's 00:20
            Transaction("E3", "A", clock + 55 * minute, 10.0, "T"),  # 00:25
        ],
        clock_us=clock + 45 * minute,
    ).records
    assert [r.out_of_order for r in ahead + after] == [False, True, False]
    assert [r.ts_us for r in ahead] == [clock + 50 * minute]  # its own ts in the output


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
    with pytest.raises(ValueError, match=f"feature spec gives {len(FEATURE_NAMES)}"):
        Scorer(make_model(DETECTORS[0], spec, num_features=5))
    half = make_model(DETECTORS[0], spec)
    half.detector.half()
    with pytest.raises(ValueError, match="float32 at least"):
        Scorer(half)


# -- hostile input: replays and extreme amounts --------------------------------------------------------


def on_own_terminal(txs: list[Transaction], account: str, amount: float | None) -> list[Transaction]:
    """txs with `account`'s events at a terminal of its own (terminal counts are shared by design, amounts
    are not) and, unless None, at `amount`."""
    return [
        t._replace(terminal_id="own", amount=t.amount if amount is None else amount)
        if t.account_id == account
        else t
        for t in txs
    ]


@pytest.mark.parametrize("name", DETECTORS)
@pytest.mark.parametrize("amount", [1e15, 2e15, 1e308])
def test_one_accounts_extreme_amounts_leave_every_other_accounts_scores_bit_for_bit(
    name, amount, frame, spec
):
    txs = transactions_from_frame(frame.head(900))
    chosen = max({t.account_id for t in txs}, key=[t.account_id for t in txs].count)
    model = make_model(name, spec)
    extreme, normal = Scorer(model), Scorer(model)
    got, expected, rejected = [], [], []
    for start in range(0, len(txs), BATCH_EVENTS):
        part = txs[start : start + BATCH_EVENTS]
        scored = extreme.score_batch(on_own_terminal(part, chosen, amount))
        got += scored.records
        rejected += [r.reason for r in scored.rejected]
        # The same micro-batch at ordinary amounts, less the events refused: a batched matmul's rounding
        # may depend on how many rows it has, so the batches keep their sizes.
        refused = {r.index for r in scored.rejected}
        expected += normal.score(
            [t for i, t in enumerate(on_own_terminal(part, chosen, None)) if i not in refused]
        )
    others = [r for r in expected if r.account_id != chosen]
    assert len(others) > 800
    assert [r for r in got if r.account_id != chosen] == others  # every field, every bit
    mine = [r for r in got if r.account_id == chosen]
    assert all(np.isfinite(r.logit) and 0.0 <= r.score <= 1.0 for r in got)
    if amount == 1e15:  # large but within MAX_AMOUNT: applied, finite
        assert len(mine) == sum(t.account_id == chosen for t in txs) and rejected == []
    else:  # above it (the service's decoder refuses it too): refused with the reason, nothing of it applied
        assert len(rejected) == sum(t.account_id == chosen for t in txs) and mine == []
        assert all(f"the amount {amount!r} of event " in r and "0..1e+15" in r for r in rejected)
        assert extreme.stats.amounts_refused == len(rejected) and extreme.stats.not_finite == 0
    restored = Scorer(model)  # every state it wrote restores: none holds what a restore refuses
    for account in sorted(extreme.accounts_in_memory):
        restored.restore_account(account, extreme.account_state_bytes(account))
        recurrent = extreme.store.gather(extreme.store.rows([account]))
        assert all(torch.isfinite(tensor).all() for tensor in recurrent.values())


@pytest.mark.parametrize("name", DETECTORS[:1])
def test_an_event_id_applied_already_is_not_applied_again_even_after_a_restore(name, frame, spec):
    txs = transactions_from_frame(frame.head(200))
    scorer = Scorer(make_model(name, spec))
    scorer.score(txs, [(0, i) for i in range(200)])
    retry = txs[150]  # a producer's retry: the same event at a later offset
    scored = scorer.score_batch([retry, txs[199]._replace(event_id="new")], [(0, 200), (0, 201)])
    assert [r.event_id for r in scored.records] == ["new"]
    assert [(r.index, r.replay) for r in scored.rejected] == [(0, True)]
    assert (
        repr(retry.event_id) in scored.rejected[0].reason and "not applied again" in scored.rejected[0].reason
    )
    assert scorer.stats.replays_dropped == 1

    # The window travels with the account's record, and holds its last RECENT_EVENT_IDS events only.
    account = retry.account_id
    mine = [t for t in txs if t.account_id == account]
    data = scorer.account_state_bytes(account)
    scorer.take_changed()
    scorer.evict(account)
    scorer.restore_account(account, data)
    assert scorer.score_batch([mine[-1]], [(1, 5)]).rejected  # another partition, same id: still a replay
    record = decode_account_record(data, account)
    assert record.recent_ids != bytes(len(record.recent_ids))

    fresh = Scorer(make_model(name, spec))
    many = [Transaction(f"N{i}", "A-many", txs[0].ts_us + i, 1.0, "T") for i in range(RECENT_EVENT_IDS + 3)]
    fresh.score(many[:5])
    fresh.score(many[5:])  # a ring: the first three fell out
    again = fresh.score_batch([many[0], many[3], many[3]])
    assert [r.index for r in again.rejected] == [1, 2]  # the ring's own, then the batch's own repeat
    assert [r.event_id for r in again.records] == ["N0"]


def test_a_record_of_version_1_is_read_with_an_empty_window(frame, spec):
    scorer = Scorer(make_model(DETECTORS[0], spec))
    txs = transactions_from_frame(frame.head(50))
    scorer.score(txs)
    account = txs[0].account_id
    record = decode_account_record(scorer.account_state_bytes(account), account)
    v1 = struct.pack(
        "<4sHHH8siqqII", b"TXSA", 1, FEATURIZER_STATE_VERSION, FEATURE_VERSION, record.model, record.partition,
        record.offset, record.last_ts_us, len(record.features), len(record.detector),
    ) + record.features + record.detector  # fmt: skip
    old = decode_account_record(v1, account)
    assert old == dataclasses.replace(record, recent_ids=bytes(8 * RECENT_EVENT_IDS), recent_next=0)


@pytest.mark.parametrize("name", DETECTORS[:1])
def test_a_rollback_puts_accounts_and_terminals_back_exactly(name, frame, spec):
    txs = transactions_from_frame(frame.head(300))
    scorer = Scorer(make_model(name, spec))
    scorer.featurizer.terminal_journal = []
    scorer.score(txs[:200])
    part = [*txs[200:260], Transaction("brand-new", "A-new", txs[-1].ts_us, 5.0, "T-new")]
    accounts = [t.account_id for t in part]
    terminals = [t.terminal_id for t in part]
    held = sorted(scorer.accounts_in_memory)
    before = dict(zip(held, scorer.account_states_bytes(held), strict=True))
    terminal_before = {t: scorer.featurizer.terminals.get_bytes(t) for t in terminals}
    changed, journal = set(scorer._changed), len(scorer.featurizer.terminal_journal)
    stats = dataclasses.replace(scorer.stats)

    checkpoint = scorer.checkpoint(accounts, terminals)
    scorer.score(part)
    scorer.rollback(checkpoint)
    assert sorted(scorer.accounts_in_memory) == held  # the new account is gone
    assert dict(zip(held, scorer.account_states_bytes(held), strict=True)) == before
    assert {t: scorer.featurizer.terminals.get_bytes(t) for t in terminals} == terminal_before
    assert scorer._changed == changed and len(scorer.featurizer.terminal_journal) == journal
    assert scorer.stats == stats
    # and what comes next scores as if the rolled-back batch had never been
    straight = Scorer(make_model(name, spec))
    straight.score(txs[:200])
    np.testing.assert_array_equal(logits(scorer.score(txs[260:])), logits(straight.score(txs[260:])))


def test_replay_refuses_a_dataset_it_cannot_apply(frame, spec):
    bad = frame.head(100).with_columns(pl.lit(2e15).alias("amount"))
    with pytest.raises(
        ValueError, match=r"replay: .* not applied, first row 0: the amount 2000000000000000.0 of"
    ):
        Scorer(make_model(DETECTORS[0], spec)).replay(bad)
