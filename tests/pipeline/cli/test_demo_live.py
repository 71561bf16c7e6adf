"""The demo's alerts as an analyst reads them, without a broker (tests/test_demo.py runs the demo itself)."""

from pipeline.cli.demo_live import format_alert, pick_alerts


def alert(event: str, score: float, *tops: str) -> dict:
    reasons = [{"input": top, "text": f"{top} said so", "logit": 1.0 + i} for i, top in enumerate(tops)]
    return {
        "event_id": event, "account_id": "A7", "ts": "2025-03-01T10:00:00+00:00", "score": score,
        "alert": True, "reasons": reasons,
        "history": {"input": "history", "text": "this account's history (its recurrent state)", "logit": -0.25},
    }  # fmt: skip


def test_picks_the_highest_scores_with_another_top_reason_each_while_there_are_others():
    alerts = [
        alert("e1", 0.99, "amount"),
        alert("e2", 0.98, "amount"),
        alert("e3", 0.97, "new_terminal"),
        alert("e4", 0.50, "terminal_risk"),
        alert("e5", 0.999),  # no reasons (alert_reasons: 0): nothing to show
    ]
    assert [a["event_id"] for a in pick_alerts(alerts)] == ["e1", "e3", "e4"]
    # fewer distinct reasons than alerts shown: the rest by score
    assert [a["event_id"] for a in pick_alerts(alerts[:3])] == ["e1", "e2", "e3"]
    assert pick_alerts([]) == []


def test_an_alert_is_a_heading_then_one_line_per_reason_and_the_history():
    lines = format_alert(2, alert("e9", 0.9123, "amount", "gap"), True).splitlines()
    assert lines[0].startswith("alert 2: account A7, event e9 at 2025-03-01T10:00:00+00:00, score 0.912")
    assert "(fraud in the generated data)" in lines[0]
    assert [" ".join(line.split()[-2:]) for line in lines[1:]] == [
        "+1.00 logit",
        "+2.00 logit",
        "-0.25 logit",
    ]
    assert lines[1].strip().startswith("amount said so") and "recurrent state" in lines[3]
    assert len({line.index("logit") for line in lines[1:]}) == 1  # the figures line up
    assert "(not labelled in the generated data)" in format_alert(1, alert("e9", 0.9, "amount"), None)
