"""Reasons for alerts in the scoring step (consumers/scoring/explain.py): only alerts carry them, each is
explained from its account's state just before the event however many of the account's events share its
micro-batch, and the alert record is the score record plus the reasons."""

import json
from datetime import timedelta

import numpy as np
import polars as pl
import pytest
import torch

from consumers.scoring.explain import AlertExplainer, encode_alert
from consumers.scoring.messages import transactions_from_frame
from consumers.scoring.outputs import encode_scores
from consumers.scoring.scorer import Scorer
from models.registry import REGISTRY, build_detector
from pipeline.data.generate import GenerateConfig, generate
from pipeline.features import FeatureSpec, compute_features, fit_feature_spec
from pipeline.features.reasons import HISTORY, INPUTS
from pipeline.registry.artifact import LoadedModel

DETECTORS = sorted(REGISTRY)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def frame() -> pl.DataFrame:
    return generate(GenerateConfig(accounts=40, days=30, seed=5)).sort("ts", "event_id")


@pytest.fixture(scope="module")
def spec(frame: pl.DataFrame) -> FeatureSpec:
    start = frame["ts"].min()
    return fit_feature_spec(compute_features(frame), start, start + timedelta(days=20))


def make_model(name: str, spec: FeatureSpec) -> LoadedModel:
    torch.manual_seed(0)
    config = {"num_features": spec.num_features, "d_model": 8, "num_layers": 1, "dropout": 0.0}
    if name == "transformer":
        config["window_events"] = 8  # histories run past the window
    return LoadedModel(detector=build_detector(name, config), spec=spec)


def _threshold(model, events) -> float:
    # about one alert in eight: enough of them, in batches where their accounts have earlier events
    scores = np.array([r.score for r in Scorer(model, reasons=0).score(events)])
    return float(np.quantile(scores, 0.875))


@pytest.mark.parametrize("name", DETECTORS)
def test_alerts_and_only_alerts_carry_reasons_from_the_state_before_their_event(name, frame, spec):
    model = make_model(name, spec)
    events = transactions_from_frame(frame.head(400))
    threshold = _threshold(model, events)
    batched, batched_reasons = [], {}
    scorer = Scorer(model, threshold)
    for start in range(0, len(events), 97):  # several events of one account per batch
        scored = scorer.score_batch(events[start : start + 97])
        batched_reasons.update((len(batched) + i, e) for i, e in scored.reasons.items())
        batched += scored.records
    alone, alone_reasons = Scorer(model, threshold), {}
    for n, event in enumerate(events):  # each event its own batch: the state before it is the stored one
        scored = alone.score_batch([event])
        assert scored.records[0].logit == pytest.approx(batched[n].logit, abs=1e-5)
        alone_reasons.update((n, e) for e in scored.reasons.values())

    alerts = [n for n, r in enumerate(batched) if r.alert]
    assert 20 <= len(alerts) < len(batched)
    assert sorted(batched_reasons) == alerts == sorted(alone_reasons)  # alerts and only alerts
    repeated = {r.account_id for r in batched[:97]}
    assert len(repeated) < 97  # accounts with several events in one batch are among them
    for n in alerts:
        got, want = batched_reasons[n], alone_reasons[n]
        assert 0 < len(got.reasons) <= 3
        assert [r.input for r in got.reasons] == [r.input for r in want.reasons]
        np.testing.assert_allclose([r.logit for r in got.reasons], [r.logit for r in want.reasons], atol=1e-4)
        assert got.history.logit == pytest.approx(want.history.logit, abs=1e-4)
        assert got.history.input == HISTORY
        assert all(r.input in INPUTS and r.logit > 0 and r.text for r in got.reasons)
        assert [r.logit for r in got.reasons] == sorted((r.logit for r in got.reasons), reverse=True)


@pytest.mark.parametrize("name", DETECTORS)
def test_each_alert_is_explained_from_the_state_just_before_it_however_many_its_account_has(name, spec):
    # 3 accounts, 40 events in a batch, most of them alerts (a burst): every alert's state is the one the
    # account's events before it in the batch leave, as stepping them one at a time gives.
    detector = make_model(name, spec).detector.eval()
    torch.manual_seed(1)
    rows = np.array([0, 1, 0, 0, 2, 0, 1, 0, 0, 0] * 4)
    x = torch.randn(len(rows), spec.num_features + 1)
    x[:, -1] = 0  # the terminal bucket column
    alerts = np.flatnonzero(np.arange(len(rows)) % 5 != 3)
    with torch.inference_mode():
        table = detector.init_state(3)
        detector.step_in_place(torch.randn(3, spec.num_features + 1).abs().floor(), table, torch.arange(3))
        explainer = AlertExplainer(detector, top=3)
        got = explainer._states_before(explainer.snapshot(table, rows), rows, x, alerts)
        want, state = [], {key: value.clone() for key, value in table.items()}
        for p in range(len(rows)):
            if p in set(alerts.tolist()):
                want.append({key: value[rows[p] : rows[p] + 1].clone() for key, value in state.items()})
            detector.step_in_place(x[p : p + 1], state, torch.as_tensor([rows[p]]))
    for key in got:
        expected = torch.cat([w[key] for w in want])
        torch.testing.assert_close(got[key].float(), expected.float(), rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[next(iter(got))][0], got[next(iter(got))][-1])  # the states did move


def test_no_reasons_when_turned_off_and_the_alert_record_is_the_score_record_plus_reasons(frame, spec):
    model = make_model(DETECTORS[0], spec)
    events = transactions_from_frame(frame.head(200))
    threshold = _threshold(model, events)
    assert Scorer(model, threshold, reasons=0).score_batch(events).reasons == {}
    scored = Scorer(model, threshold, reasons=2).score_batch(events)
    i, explanation = next(iter(scored.reasons.items()))
    (value,) = encode_scores([scored.records[i]], "7")
    message = json.loads(encode_alert(value, explanation))
    score_fields = {k: v for k, v in message.items() if k not in ("reasons", "history", "base_logit")}
    assert score_fields == json.loads(value) and message["alert"] is True
    assert message["reasons"] == [r.as_dict() for r in explanation.reasons] and len(message["reasons"]) <= 2
    assert message["history"]["input"] == HISTORY and isinstance(message["base_logit"], float)
    assert encode_alert(value, None) == value


def test_replay_gives_each_alert_its_reasons_on_request(frame, spec):
    model = make_model(DETECTORS[0], spec)
    history = frame.head(300)
    threshold = _threshold(model, transactions_from_frame(history))
    plain = Scorer(model, threshold).replay(history, batch_events=50)
    scored = Scorer(model, threshold).replay(history, batch_events=50, reasons=True)
    assert scored.drop("reasons", "history_logit").equals(plain)
    alerts = scored.filter(pl.col("alert"))
    assert alerts.height > 0 and alerts["reasons"].null_count() == 0
    assert scored.filter(~pl.col("alert"))["reasons"].null_count() == scored.height - alerts.height
    first = alerts["reasons"][0].to_list()
    assert first and set(first[0]) == {"input", "text", "logit"}
    with pytest.raises(ValueError, match="needs a Scorer that gives reasons"):
        Scorer(model, threshold, reasons=0).replay(history, reasons=True)


def _fitted_hybrid(spec: FeatureSpec) -> LoadedModel:
    from tests.models.test_hybrid import fitted_hybrid  # trees fitted over a tiny base's scores

    return LoadedModel(fitted_hybrid("lstm", terminal_buckets=spec.terminal_buckets).float(), spec)


def test_a_fitted_hybrids_alerts_carry_reasons_and_none_is_rejected(frame, spec):
    model = _fitted_hybrid(spec)  # trees: no gradient, so the inputs' terms come from moving them one by one
    events = transactions_from_frame(frame.head(400))
    threshold = _threshold(model, events)
    scorer, records, reasons = Scorer(model, threshold), [], {}
    for start in range(0, len(events), 97):
        scored = scorer.score_batch(events[start : start + 97])
        assert scored.rejected == []
        reasons.update((len(records) + i, e) for i, e in scored.reasons.items())
        records += scored.records
    alerts = [n for n, r in enumerate(records) if r.alert]
    assert len(records) == len(events) and 0 < len(alerts) < len(records)
    assert sorted(reasons) == alerts and scorer.stats.reasons_failed == 0
    assert any(e.reasons for e in reasons.values())
    for n in alerts:
        e = reasons[n]
        assert e.history.input == HISTORY and all(
            r.input in INPUTS and r.logit > 0 and r.text for r in e.reasons
        )
        assert np.isfinite([e.base_logit, e.history.logit]).all()


def test_an_explainer_that_raises_costs_no_alert_and_is_counted_and_logged_once_a_while(frame, spec, caplog):
    model = make_model(DETECTORS[0], spec)
    events = transactions_from_frame(frame.head(200))
    threshold = _threshold(model, events)
    scorer = Scorer(model, threshold)

    def broken(*args):
        raise RuntimeError("element 0 of tensors does not require grad")

    scorer.explainer.explain = broken
    plain = Scorer(model, threshold, reasons=0)
    with caplog.at_level("ERROR", logger="consumers.scoring.scorer"):
        for start in range(0, len(events), 50):
            scored = scorer.score_batch(events[start : start + 50])
            want = plain.score_batch(events[start : start + 50])
            assert scored.records == want.records and scored.rejected == [] and scored.reasons == {}
    alerts = sum(r.alert for r in Scorer(model, threshold, reasons=0).score(events))
    assert alerts > 0 and scorer.stats.reasons_failed == alerts
    failures = [r for r in caplog.records if "alert reasons" in r.getMessage()]
    assert len(failures) == 1 and "does not require grad" in failures[0].getMessage()
