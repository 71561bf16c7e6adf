"""Synthetic transactions with known fraud, for `txsentinel generate`.

The legit behaviour and scenarios 1-3 follow the Fraud Detection Handbook's simulator (Le Borgne et al.,
"Reproducible Machine Learning for Credit Card Fraud Detection - Practical Handbook", ch. 3): accounts and
terminals uniform on a 100 x 100 grid, each account using the terminals within `radius` of its home.
txsentinel adds what only an account's history reveals: account takeover, card testing, and a slow
drift of some accounts that is NOT fraud.

`scenario` precedence, lowest to highest, the higher winning when several apply to one event:
legit < drift < high_amount < compromised_terminal < compromised_account < account_takeover < card_testing.
Among an account's own events this is the Handbook's order (its scenario 3 overwrites 2, which overwrites 1);
takeover and card-testing events exist only because of their scenario, so nothing else can claim them;
"drift" marks the legit events of drifting accounts. The amount > 220 rule does not apply to drifting
accounts: their large amounts are what their history led up to, which is the point of the drift scenario.

Vectorised throughout (5000 accounts x 180 days, ~1.7M events, in a few seconds): no Python loop runs over
events or (account, day) pairs. Shape letters: A accounts, M terminals, D days, N events, P points.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, date, datetime

import numpy as np
import polars as pl

from pipeline import generate_scenarios as sc
from pipeline.generate_scenarios import GRID_SIZE, Events
from pipeline.schema import TIMESTAMP

# Scenario rates in GenerateConfig are per day for the Handbook's 5000 customers and 10000 terminals.
REFERENCE_ACCOUNTS = 5000
REFERENCE_TERMINALS = 10000
# Index = the code in pipeline.generate_scenarios; order = precedence (see the module docstring).
SCENARIOS: tuple[str, ...] = (
    "legit",
    "drift",
    "high_amount",
    "compromised_terminal",
    "compromised_account",
    "account_takeover",
    "card_testing",
)
FRAUD_SCENARIOS: tuple[str, ...] = SCENARIOS[sc.HIGH_AMOUNT :]


@dataclass(frozen=True)
class GenerateConfig:
    accounts: int = 5000
    days: int = 180
    seed: int = 0
    start_date: date = date(2026, 1, 1)  # day 0, from its UTC midnight
    terminals: int | None = None  # None: 2 x accounts, the Handbook's ratio (5000 customers, 10000 terminals)
    radius: float = 5.0  # grid units; an account uses the terminals this close to its home

    # Handbook scenarios 1-3. Rates per day are for 5000 accounts / 10000 terminals, scaled linearly to the
    # actual sizes and drawn as Poisson counts per day, so small datasets still get some fraud.
    high_amount_threshold: float = 220.0
    compromised_terminals_per_day: float = 2.0
    compromised_terminal_days: int = 28
    compromised_accounts_per_day: float = 3.0
    compromised_account_days: int = 14
    compromised_account_fraud_fraction: float = 1 / 3
    compromised_account_amount_factor: float = 5.0

    # Account takeover: injected events far from home, amounts x U(min, max) the usual, and
    # factor x max(usual rate, 1) extra events per day, for U{days_min..days_max} days.
    takeover_accounts_per_day: float = 0.5
    takeover_days_min: int = 3
    takeover_days_max: int = 10
    takeover_amount_factor_min: float = 3.0
    takeover_amount_factor_max: float = 6.0
    takeover_tx_per_day_factor: float = 2.0

    # Card testing: probes of tiny amounts seconds apart at one unusual terminal, then large cash-outs.
    card_testing_accounts_per_day: float = 1.0
    card_testing_probes_min: int = 3
    card_testing_probes_max: int = 8
    card_testing_probe_amount_min: float = 0.5
    card_testing_probe_amount_max: float = 3.0
    card_testing_probe_gap_seconds_max: float = 120.0
    card_testing_cashouts_min: int = 1
    card_testing_cashouts_max: int = 3
    card_testing_cashout_amount_min: float = 100.0
    card_testing_cashout_amount_max: float = 800.0
    card_testing_cashout_delay_hours_max: float = 6.0
    unusual_terminal_distance_min: float = 25.0  # grid units from home, for takeover and card testing

    # Legit drift: a fraction of accounts whose mean amount grows linearly to U(min, max) x by the last day,
    # and/or whose home moves in a straight line at up to this speed, in steps of whole weeks (so each step
    # has one fixed set of terminals in reach, like a home).
    drift_account_fraction: float = 0.10
    drift_amount_factor_min: float = 1.5
    drift_amount_factor_max: float = 2.5
    drift_home_units_per_day_max: float = 0.15
    drift_home_step_days: int = 7

    # Labels: fraud is known after hours_min + Gamma(shape, mean / shape) days, at most days_max in all;
    # legit is known when the chargeback window closes without one.
    label_delay_hours_min: float = 1.0
    label_delay_days_mean: float = 3.5
    label_delay_gamma_shape: float = 2.0
    label_delay_days_max: float = 30.0
    legit_label_delay_days: float = 7.0

    def __post_init__(self) -> None:
        problems = []
        for name in ("accounts", "days", "compromised_terminal_days", "compromised_account_days"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r}, expected an integer >= 1")
        if self.terminals is not None and self.terminals < 1:
            problems.append(f"terminals={self.terminals!r}, expected an integer >= 1 or None (2 x accounts)")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not (np.isfinite(value) and value >= 0):
                problems.append(f"{f.name}={value!r}, expected a finite number >= 0")
        for lo, hi in _RANGES:
            if getattr(self, lo) > getattr(self, hi):
                problems.append(f"{lo}={getattr(self, lo)!r} > {hi}={getattr(self, hi)!r}")
        for name in ("drift_account_fraction", "compromised_account_fraud_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name}={getattr(self, name)!r}, expected a fraction in [0, 1]")
        if self.radius <= 0 or self.drift_home_step_days < 1 or self.takeover_days_min < 1:
            problems.append("radius, drift_home_step_days and takeover_days_min must be > 0")
        if self.card_testing_probes_min < 1 or self.card_testing_cashouts_min < 0:
            problems.append("card testing needs at least one probe (probes_min >= 1, cashouts_min >= 0)")
        if problems:
            raise ValueError("invalid GenerateConfig: " + "; ".join(problems))

    @property
    def n_terminals(self) -> int:
        return self.terminals if self.terminals is not None else 2 * self.accounts

    @property
    def account_scale(self) -> float:
        return self.accounts / REFERENCE_ACCOUNTS

    @property
    def terminal_scale(self) -> float:
        return self.n_terminals / REFERENCE_TERMINALS

    @property
    def start_us(self) -> int:
        midnight = datetime(self.start_date.year, self.start_date.month, self.start_date.day, tzinfo=UTC)
        return int(midnight.timestamp()) * sc.US_PER_SECOND


_RANGES = [
    (f"{p}_min", f"{p}_max")
    for p in (
        "takeover_days",
        "takeover_amount_factor",
        "card_testing_probes",
        "card_testing_probe_amount",
        "card_testing_cashouts",
        "card_testing_cashout_amount",
        "drift_amount_factor",
    )
]


@dataclass(frozen=True)
class World:
    """Who transacts where and how: the fixed profiles behind the events."""

    account_xy: np.ndarray  # (A, 2) home on day 0
    terminal_xy: np.ndarray  # (M, 2)
    mean_amount: np.ndarray  # (A,) on day 0; the std is always mean / 2
    tx_per_day: np.ndarray  # (A,) Poisson rate
    drift: np.ndarray  # (A,) bool
    drift_amount_per_day: np.ndarray  # (A,) growth of the mean per day, as a fraction of the day-0 mean
    drift_home_per_day: np.ndarray  # (A, 2) grid units per day
    home_step_days: int

    def home_xy(self, acc: np.ndarray, day: np.ndarray) -> np.ndarray:
        """(N, 2) home of account acc[i] on day[i]; a moving home jumps in whole steps, kept on the grid."""
        moved_days = (np.asarray(day) // self.home_step_days) * self.home_step_days
        xy = self.account_xy[acc] + self.drift_home_per_day[acc] * moved_days[:, None]
        return np.clip(xy, 0.0, GRID_SIZE)

    def mean_amount_at(self, acc: np.ndarray, day: np.ndarray) -> np.ndarray:
        return self.mean_amount[acc] * (1.0 + self.drift_amount_per_day[acc] * day)


def _rngs(cfg: GenerateConfig) -> dict[str, np.random.Generator]:
    # Independent streams per stage: changing one stage (say, card testing) leaves the others' draws alone.
    stages = ("world", "legit", "handbook", "takeover", "card_testing", "labels")
    seeds = np.random.SeedSequence(cfg.seed).spawn(len(stages))
    return {s: np.random.Generator(np.random.PCG64(seed)) for s, seed in zip(stages, seeds, strict=True)}


def build_world(cfg: GenerateConfig) -> World:
    """The account and terminal profiles for `cfg`; `generate(cfg)` uses exactly this world."""
    rng = _rngs(cfg)["world"]
    A, D = cfg.accounts, cfg.days
    account_xy = rng.uniform(0, GRID_SIZE, size=(A, 2))
    mean_amount = rng.uniform(5, 100, size=A)
    tx_per_day = rng.uniform(0, 4, size=A)
    terminal_xy = rng.uniform(0, GRID_SIZE, size=(cfg.n_terminals, 2))

    drift = rng.random(A) < cfg.drift_account_fraction
    # A drifting account's amounts drift (kind 0), its home moves (kind 1), or both (kind 2).
    kind = rng.integers(0, 3, size=A)
    factor = rng.uniform(cfg.drift_amount_factor_min, cfg.drift_amount_factor_max, size=A)
    amount_drifts = drift & (kind != 1)
    drift_amount_per_day = np.where(amount_drifts, (factor - 1) / max(D - 1, 1), 0.0)
    angle = rng.uniform(0, 2 * np.pi, size=A)
    speed = rng.uniform(0.3, 1.0, size=A) * cfg.drift_home_units_per_day_max
    home_moves = drift & (kind != 0)
    velocity = np.stack([np.cos(angle), np.sin(angle)], axis=1) * np.where(home_moves, speed, 0.0)[:, None]
    return World(
        account_xy=account_xy,
        terminal_xy=terminal_xy,
        mean_amount=mean_amount,
        tx_per_day=tx_per_day,
        drift=drift,
        drift_amount_per_day=drift_amount_per_day,
        drift_home_per_day=velocity,
        home_step_days=cfg.drift_home_step_days,
    )


def _home_rows(cfg: GenerateConfig, world: World) -> tuple[sc.Reach, np.ndarray]:
    """Every home an account has over the period, with the terminals each reaches.

    Returns the Reach over P points: rows 0..A-1 are the day-0 homes, then K = ceil(D / step) homes per
    moving account; and (A,) each account's rank among the moving ones, or -1.
    """
    moving = np.flatnonzero(np.any(world.drift_home_per_day != 0, axis=1))
    K = -(-cfg.days // cfg.drift_home_step_days)
    step_acc = np.repeat(moving, K)
    step_day = np.tile(np.arange(K) * cfg.drift_home_step_days, moving.size)
    points = np.concatenate([world.account_xy, world.home_xy(step_acc, step_day)])
    rank = np.full(cfg.accounts, -1, dtype=np.int64)
    rank[moving] = np.arange(moving.size)
    return sc.terminals_within(points, world.terminal_xy, cfg.radius), rank


def _account_events(
    cfg: GenerateConfig, world: World, rngs: dict[str, np.random.Generator], reach: sc.Reach, rank: np.ndarray
) -> Events:
    """Each account's own transactions with Handbook scenarios 1-3 applied, and the drift marked.

    `reach` and `rank` are `_home_rows`' answers for this world.
    """
    rng = rngs["legit"]
    A, D = cfg.accounts, cfg.days
    counts = rng.poisson(world.tx_per_day[:, None], size=(A, D))  # (A, D) events per account and day
    acc = np.repeat(np.arange(A), counts.sum(axis=1))  # (N,)
    day = np.repeat(np.tile(np.arange(D), A), counts.ravel())  # (N,)
    seconds = sc.draw_time_of_day(rng, acc.size)
    amount = sc.draw_amounts(rng, world.mean_amount_at(acc, day))
    u_terminal = rng.random(acc.size)

    K = -(-D // cfg.drift_home_step_days)
    row = np.where(rank[acc] >= 0, A + rank[acc] * K + day // cfg.drift_home_step_days, acc)
    # Handbook: an account with no terminal in reach makes no transactions (here: while its home is there).
    keep = reach.counts()[row] > 0
    acc, day, seconds, amount, row, u_terminal = (
        x[keep] for x in (acc, day, seconds, amount, row, u_terminal)
    )
    term = reach.pick(row, u_terminal)

    code = np.where(world.drift[acc], sc.DRIFT, sc.LEGIT).astype(np.int8)
    code[(amount > cfg.high_amount_threshold) & ~world.drift[acc]] = sc.HIGH_AMOUNT
    hb = rngs["handbook"]
    code[sc.compromised_terminals(cfg, hb)[term, day]] = sc.COMPROMISED_TERMINAL
    stolen = sc.compromised_accounts(cfg, hb)[acc, day] & (
        hb.random(acc.size) < cfg.compromised_account_fraud_fraction
    )
    code[stolen] = sc.COMPROMISED_ACCOUNT
    amount[stolen] = np.round(amount[stolen] * cfg.compromised_account_amount_factor, 2)
    return Events(
        acc=acc, term=term, ts_us=sc.event_times(day, seconds, cfg.start_us), amount=amount, code=code
    )


def _label_times(
    cfg: GenerateConfig, ts_us: np.ndarray, is_fraud: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """(N,) microseconds when each label became known; always >= ts."""
    day_us = float(sc.DAY_US)
    delay = np.full(ts_us.size, cfg.legit_label_delay_days * day_us)
    shape = cfg.label_delay_gamma_shape
    gamma_days = rng.gamma(shape, cfg.label_delay_days_mean / shape, size=int(is_fraud.sum()))
    fraud_delay = cfg.label_delay_hours_min * 3600 * sc.US_PER_SECOND + gamma_days * day_us
    delay[is_fraud] = np.minimum(fraud_delay, cfg.label_delay_days_max * day_us)
    return ts_us + delay.astype(np.int64)


def generate(cfg: GenerateConfig) -> pl.DataFrame:
    """Synthetic transactions in canonical columns (no optional ones), with is_fraud, label_ts and scenario.

    Sorted by (ts, event_id); event_id numbers the events in that order, so it is stable for a seed.
    """
    rngs = _rngs(cfg)
    world = build_world(cfg)
    # Takeover and card testing strike accounts that transact at all (some terminal in reach from home).
    reach, rank = _home_rows(cfg, world)
    candidates = np.flatnonzero((reach.counts()[: cfg.accounts] > 0) & (world.tx_per_day > 0))
    events = Events.concat(
        [
            _account_events(cfg, world, rngs, reach, rank),
            sc.account_takeovers(cfg, world, rngs["takeover"], candidates, cfg.start_us),
            sc.card_testing(cfg, world, rngs["card_testing"], candidates, cfg.start_us),
        ]
    )
    # Card-testing cash-outs on a one-day period could spill past its end; keep every event inside.
    end_us = cfg.start_us + cfg.days * sc.DAY_US
    ts_us = np.minimum(events.ts_us, end_us - 1)
    order = np.lexsort((events.term, events.acc, ts_us))  # stable, so ties keep a seed-fixed order
    ts_us, acc, term = ts_us[order], events.acc[order], events.term[order]
    amount, code = events.amount[order], events.code[order]
    is_fraud = code >= sc.HIGH_AMOUNT
    label_us = _label_times(cfg, ts_us, is_fraud, rngs["labels"])

    return pl.DataFrame(
        {
            "event_id": _ids("E", np.arange(ts_us.size), 9, ts_us.size),
            "account_id": _ids("A", acc, 5, cfg.accounts),
            "ts": pl.Series(ts_us).cast(TIMESTAMP),
            "amount": pl.Series(amount, dtype=pl.Float64),
            "terminal_id": _ids("T", term, 5, cfg.n_terminals),
            "is_fraud": pl.Series(is_fraud, dtype=pl.Boolean),
            "label_ts": pl.Series(label_us).cast(TIMESTAMP),
            "scenario": pl.Series(SCENARIOS).gather(pl.Series(code)),
        }
    )


def _ids(prefix: str, numbers: np.ndarray, width: int, count: int) -> pl.Series:
    # Zero-padded to one width per column ("A00042"), so ids sort like their numbers; wider for big counts.
    width = max(width, len(str(max(count - 1, 0))))
    return prefix + pl.Series(numbers).cast(pl.String).str.zfill(width)


def scenario_summary(frame: pl.DataFrame) -> pl.DataFrame:
    """Per scenario (fixed order, zeros included) and in all: transactions, frauds, and their shares of all.

    `share` is the scenario's fraction of all transactions (for a fraud scenario, its fraud rate);
    `fraud_share` its frauds' fraction of all transactions, which sums to the overall fraud rate.
    """
    total = max(frame.height, 1)
    counts = frame.group_by("scenario").agg(
        transactions=pl.len().cast(pl.Int64), frauds=pl.col("is_fraud").sum().cast(pl.Int64)
    )
    per = pl.DataFrame({"scenario": list(SCENARIOS)}).join(counts, on="scenario", how="left").fill_null(0)
    extra = counts.filter(~pl.col("scenario").is_in(list(SCENARIOS)))  # none from generate; kept if any
    rows = pl.concat([per, extra])
    everything = pl.DataFrame(
        {"scenario": ["all"], "transactions": [frame.height], "frauds": [int(frame["is_fraud"].sum())]},
        schema=rows.schema,
    )
    return pl.concat([rows, everything]).with_columns(
        share=pl.col("transactions") / total, fraud_share=pl.col("frauds") / total
    )


__all__ = [
    "FRAUD_SCENARIOS",
    "SCENARIOS",
    "GenerateConfig",
    "World",
    "build_world",
    "generate",
    "scenario_summary",
]
