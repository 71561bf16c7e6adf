"""An alert's reasons in words an analyst reads: the attribution's per-feature terms grouped into inputs.

models/attribution.py splits a logit into base + history + one term per feature column + residual. Several
columns describe one thing (log_amount and amount_z are the amount; hour_sin, hour_cos and is_night the time
of day): their terms add up, and an analyst reads one input, worded from the event's feature values as the
featurizer computed them (before normalisation), e.g. "amount 523.10, 6.1 sigma above this account's mean
so far", "first use of this terminal", "terminal reported 3 frauds in 7 days". The account's history (its
recurrent state) is one more term, beside the inputs.

The reasons of an event are its inputs that pushed its score up, largest first (an input that lowered it is
no reason for an alert).
"""

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pipeline.features.definitions import FEATURE_NAMES, WINDOW_DAYS

# Every feature in exactly one input (checked below).
INPUTS: dict[str, tuple[str, ...]] = {
    "amount": ("log_amount", "linear_amount", "amount_z"),
    "gap": ("log_gap_s", "is_first_event"),
    "new_terminal": ("new_terminal",),
    "terminal_risk": (
        *(f"terminal_log_reports_{d}d" for d in WINDOW_DAYS),
        *(f"terminal_risk_{d}d" for d in WINDOW_DAYS),
    ),
    "terminal_activity": tuple(f"terminal_log_count_{d}d" for d in WINDOW_DAYS),
    "account_activity": tuple(f"account_log_count_{d}d" for d in WINDOW_DAYS),
    "account_spend": tuple(f"account_log_mean_amount_{d}d" for d in WINDOW_DAYS),
    "time_of_day": ("hour_sin", "hour_cos", "is_night"),
    "day_of_week": ("weekday_sin", "weekday_cos", "is_weekend"),
}
HISTORY = "history"  # the term of the account's recurrent state
_grouped = sorted(name for names in INPUTS.values() for name in names)
if _grouped != sorted(FEATURE_NAMES):
    raise AssertionError(
        f"reasons.INPUTS must hold every feature once: {_grouped} vs {sorted(FEATURE_NAMES)}"
    )

_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


@dataclass(frozen=True)
class Reason:
    input: str  # a key of INPUTS, or HISTORY
    text: str
    logit: float  # what it adds to the event's logit

    def as_dict(self) -> dict:
        return {"input": self.input, "text": self.text, "logit": round(self.logit, 4)}


@dataclass(frozen=True)
class Explanation:
    """One alerted event's reasons: its top inputs, the history term, and the logit of an average event of
    an account with no history they add to (models/attribution.py)."""

    reasons: tuple[Reason, ...]  # inputs that raised the logit, largest first
    history: Reason
    base_logit: float

    def as_dict(self) -> dict:
        return {
            "reasons": [r.as_dict() for r in self.reasons],
            "history": self.history.as_dict(),
            "base_logit": round(self.base_logit, 4),
        }


def group_by_input(terms: np.ndarray) -> np.ndarray:
    """[N, F] per-feature terms, in FEATURE_NAMES order -> [N, G] per input, in INPUTS order."""
    column = {name: i for i, name in enumerate(FEATURE_NAMES)}
    return np.stack([terms[:, [column[n] for n in names]].sum(axis=1) for names in INPUTS.values()], axis=1)


def explain(
    terms: np.ndarray, history: np.ndarray, base: np.ndarray, features: np.ndarray, top: int = 3
) -> list[Explanation]:
    """Explanations of N events: per-feature attribution terms [N, F], history and base terms [N], and the
    events' feature rows before normalisation [N, F] (both in FEATURE_NAMES order); at most `top` reasons."""
    if terms.shape != features.shape or terms.shape[1:] != (len(FEATURE_NAMES),):
        raise ValueError(
            f"terms {terms.shape} and features {features.shape}: expected both [N, {len(FEATURE_NAMES)}] "
            "in FEATURE_NAMES order"
        )
    by_input = group_by_input(terms)  # [N, G]
    names = list(INPUTS)
    out = []
    for i in range(len(terms)):
        values = dict(zip(FEATURE_NAMES, features[i].tolist(), strict=True))
        order = [g for g in np.argsort(-by_input[i], kind="stable")[:top] if by_input[i, g] > 0]
        out.append(
            Explanation(
                reasons=tuple(
                    Reason(names[g], describe(names[g], values), float(by_input[i, g])) for g in order
                ),
                history=Reason(HISTORY, describe(HISTORY, values), float(history[i])),
                base_logit=float(base[i]),
            )
        )
    return out


def describe(input_name: str, values: Mapping[str, float]) -> str:
    """An input in words, from one event's feature values before normalisation ({feature name: value})."""
    v = values
    if input_name == "amount":
        amount = np.expm1(v["log_amount"])
        if v["is_first_event"]:
            return f"amount {_fixed(amount, ',.2f')} on the account's first transaction"
        z = v["amount_z"]
        side = "above" if z >= 0 else "below"
        return (
            f"amount {_fixed(amount, ',.2f')}, {_fixed(abs(z), '.1f')} sigma {side} this account's mean so far "
            "(log scale)"
        )
    if input_name == "gap":
        if v["is_first_event"]:
            return "first transaction of this account"
        return f"{_duration(np.expm1(v['log_gap_s']))} since the account's previous transaction"
    if input_name == "new_terminal":
        return "first use of this terminal" if v["new_terminal"] else "a terminal this account used before"
    if input_name == "terminal_risk":
        reports = {d: _count(v[f"terminal_log_reports_{d}d"]) for d in WINDOW_DAYS}
        if not any(reports.values()):
            return f"no fraud reported at this terminal in {WINDOW_DAYS[-1]} days"
        d = next(d for d in WINDOW_DAYS if reports[d])  # the shortest window with a report
        longer = [f"{reports[w]} {_within(w)}" for w in WINDOW_DAYS if w > d]
        detail = ", ".join([*longer, f"risk {_fixed(v[f'terminal_risk_{d}d'], '.2f')}"])
        return f"terminal reported {_plural(reports[d], 'fraud')} {_within(d)} ({detail})"
    if input_name == "terminal_activity":
        counts = ", ".join(f"{_count(v[f'terminal_log_count_{d}d'])} {_within(d)}" for d in WINDOW_DAYS)
        return f"terminal's transactions: {counts}"
    if input_name == "account_activity":
        counts = ", ".join(f"{_count(v[f'account_log_count_{d}d'])} {_within(d)}" for d in WINDOW_DAYS)
        return f"account's transactions (this one included): {counts}"
    if input_name == "account_spend":
        means = ", ".join(
            f"{_fixed(np.expm1(v[f'account_log_mean_amount_{d}d']), ',.2f')} {_within(d)}"
            for d in WINDOW_DAYS
        )
        return f"account's mean amount: {means}"
    if input_name == "time_of_day":
        seconds = (np.arctan2(v["hour_sin"], v["hour_cos"]) % (2 * np.pi)) * 86_400 / (2 * np.pi)
        minute = round(seconds / 60) % (24 * 60)
        night = " (night)" if v["is_night"] else ""
        return f"at {minute // 60:02d}:{minute % 60:02d} UTC{night}"
    if input_name == "day_of_week":
        day = round(np.arctan2(v["weekday_sin"], v["weekday_cos"]) % (2 * np.pi) * 7 / (2 * np.pi)) % 7
        return f"on a {_WEEKDAYS[day]}"
    if input_name == HISTORY:
        return "this account's history (its recurrent state)"
    raise ValueError(f"unknown input {input_name!r}; known: {[*INPUTS, HISTORY]}")


def _fixed(value: float, spec: str) -> str:
    """`value` formatted with `spec`, the same text whatever its last bits. A mean of cent amounts often
    lies on a half cent (179.33 / 2 = 89.665), where a sum in another order (the stream's batches are not the
    backtest's) rounds to 89.66 one way and 89.67 the other: snapping to 6 decimals first gives one double."""
    return format(round(float(value), 6), spec)


def _count(log1p_value: float) -> int:
    return round(np.expm1(log1p_value))


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _within(d: int) -> str:
    return "today" if d == 1 else f"in {d} days"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{_fixed(seconds, '.0f')} s"
    if seconds < 90 * 60:
        return f"{_fixed(seconds / 60, '.0f')} min"
    if seconds < 36 * 3600:
        return f"{_fixed(seconds / 3600, '.1f')} h"
    return f"{_fixed(seconds / 86_400, '.1f')} days"
