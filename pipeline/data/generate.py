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

import numpy as np
import polars as pl

from pipeline.data import scenarios as sc
from pipeline.data.scenarios import Events
from pipeline.data.schema import TIMESTAMP
from pipeline.data.world import (
    DAY_US,
    GRID_SIZE,
    TX_PER_DAY_MAX,
    US_PER_SECOND,
    GenerateConfig,
    World,
    memory_bytes,
    size_problem,
)

# Index = the code in pipeline.data.scenarios; order = precedence (see the module docstring).
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
    tx_per_day = rng.uniform(0, TX_PER_DAY_MAX, size=A)
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
    day_us = float(DAY_US)
    delay = np.full(ts_us.size, cfg.legit_label_delay_days * day_us)
    shape = cfg.label_delay_gamma_shape
    gamma_days = rng.gamma(shape, cfg.label_delay_days_mean / shape, size=int(is_fraud.sum()))
    fraud_delay = cfg.label_delay_hours_min * 3600 * US_PER_SECOND + gamma_days * day_us
    delay[is_fraud] = np.minimum(fraud_delay, cfg.label_delay_days_max * day_us)
    return ts_us + delay.astype(np.int64)


def generate(cfg: GenerateConfig) -> pl.DataFrame:
    """Synthetic transactions in canonical columns (no optional ones), with is_fraud, label_ts and scenario.

    Sorted by (ts, event_id); event_id numbers the events in that order, so it is stable for a seed.
    Settings that would not fit in this machine's memory are refused first, with the estimate.
    """
    if problem := size_problem(cfg, memory_bytes()):
        raise ValueError(f"invalid GenerateConfig: {problem}")
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
    end_us = cfg.start_us + cfg.days * DAY_US
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
