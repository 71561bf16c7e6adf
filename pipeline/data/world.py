"""What the generator builds on: its settings and the world they make, accounts and terminals on the grid.

`pipeline.data.generate` draws the events of this world; `pipeline.data.scenarios` the frauds in them.
Shape letters: A accounts, M terminals.
"""

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Self

import numpy as np

from models.checks import is_finite_number, is_integer, read_number, read_setting, read_yaml_file
from pipeline.data.schema import EARLIEST_TS, LATEST_TS, MAX_LABEL_DELAY_DAYS, TS_RANGE

GRID_SIZE = 100.0  # accounts and terminals live on a GRID_SIZE x GRID_SIZE square
# The farthest from its centre a point of the grid can be (half its diagonal): any home has grid points at
# least this far away, and a home at the centre none farther.
FARTHEST_FROM_ANY_HOME = GRID_SIZE * 2**0.5 / 2
DAY_SECONDS = 86_400
US_PER_SECOND = 1_000_000
DAY_US = DAY_SECONDS * US_PER_SECOND

# Scenario rates in GenerateConfig are per day for the Handbook's 5000 customers and 10000 terminals.
REFERENCE_ACCOUNTS = 5000
REFERENCE_TERMINALS = 10000


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
        for f in fields(self):
            if f.type is float:  # YAML 1.1 reads 5e0 and 1e9 as strings
                object.__setattr__(self, f.name, read_number(getattr(self, f.name)))
            value = getattr(self, f.name)
            if f.type is int:
                least = 1 if f.name in _AT_LEAST_ONE else 0
                if not is_integer(value) or value < least:
                    problems.append(f"{f.name}={value!r}, expected an integer >= {least}")
            elif f.type is float and not (is_finite_number(value) and value >= 0):
                problems.append(f"{f.name}={value!r}, expected a finite number >= 0")
        if self.terminals is not None and (not is_integer(self.terminals) or self.terminals < 1):
            problems.append(f"terminals={self.terminals!r}, expected an integer >= 1 or None (2 x accounts)")
        if not isinstance(self.start_date, date):
            problems.append(f"start_date={self.start_date!r}, expected a date such as 2026-01-01")
        if problems:  # the checks below compare fields, which needs them to be numbers
            raise ValueError("invalid GenerateConfig: " + "; ".join(problems))
        for lo, hi in _RANGES:
            if getattr(self, lo) > getattr(self, hi):
                problems.append(f"{lo}={getattr(self, lo)!r} > {hi}={getattr(self, hi)!r}")
        for name in ("drift_account_fraction", "compromised_account_fraud_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name}={getattr(self, name)!r}, expected a fraction in [0, 1]")
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)!r}, expected > 0")
        if self.unusual_terminal_distance_min > FARTHEST_FROM_ANY_HOME:
            problems.append(
                f"unusual_terminal_distance_min={self.unusual_terminal_distance_min!r}, expected at most "
                f"{FARTHEST_FROM_ANY_HOME:.2f}: on the {GRID_SIZE:g} x {GRID_SIZE:g} grid no terminal is farther "
                "from a home at its centre (its largest distance, the diagonal, is "
                f"{2 * FARTHEST_FROM_ANY_HOME:.2f}), and a takeover there would silently get a random terminal"
            )
        problems += self._upper_bound_problems() + self._period_problems()
        if problems:
            raise ValueError("invalid GenerateConfig: " + "; ".join(problems))

    def _upper_bound_problems(self) -> list[str]:
        """Durations, amounts and amount factors past which a time or an amount no longer fits (see below)."""
        problems = []
        for name, unit_days in _DURATIONS.items():
            if getattr(self, name) * unit_days > MAX_LABEL_DELAY_DAYS:
                most = MAX_LABEL_DELAY_DAYS / unit_days
                problems.append(
                    f"{name}={getattr(self, name)!r}, expected at most {most:g} ({MAX_LABEL_DELAY_DAYS} days)"
                )
        for name in _AMOUNT_FACTORS:
            if getattr(self, name) > MAX_AMOUNT_FACTOR:
                problems.append(f"{name}={getattr(self, name)!r}, expected at most {MAX_AMOUNT_FACTOR:g}")
        for name in _AMOUNTS:
            if getattr(self, name) > MAX_AMOUNT:
                problems.append(
                    f"{name}={getattr(self, name)!r}, expected at most {MAX_AMOUNT:g} (the service's default max_amount)"
                )
        return problems

    def _period_problems(self) -> list[str]:
        """Every event, and every label time, in 1970..2099 (pipeline/data/schema.py); in ordinals, as a date
        this late cannot be added to."""
        first_day = self.start_date.toordinal()
        if first_day < _EARLIEST_DAY or first_day + self.days > _LATEST_DAY:
            return [
                f"start_date={self.start_date.isoformat()} with days={self.days}, expected days within {TS_RANGE}"
            ]
        delay_days = max(self.legit_label_delay_days, self.label_delay_days_max)
        if first_day + self.days + math.ceil(delay_days) > _LATEST_DAY:
            return [
                f"start_date={self.start_date.isoformat()} with days={self.days} and labels up to {delay_days:g} "
                "days later (legit_label_delay_days, label_delay_days_max), expected label times within "
                f"{TS_RANGE}"
            ]
        return []

    def with_settings(self, settings: Iterable[str]) -> Self:
        """This config with `KEY=VALUE` texts applied in order (`txsentinel generate --set`), each VALUE read
        as YAML (models.checks.read_setting): `takeover_accounts_per_day=0`, `terminals=null`,
        `start_date=2026-03-01`."""
        changes = {}
        for item in settings:
            key, value = read_setting(item, "takeover_accounts_per_day=0")
            changes[self._known(key, f"--set {item!r}")] = value
        return replace(self, **changes)

    def with_file(self, path: Path) -> Self:
        """This config with a YAML mapping of settings applied (`txsentinel generate --config`), each value as
        `--set` reads it: configs/generate/handbook.yaml is one."""
        loaded = read_yaml_file(path, "generator settings")
        changes: dict[str, Any] = {self._known(str(key), str(path)): value for key, value in loaded.items()}
        return replace(self, **changes)

    def _known(self, key: str, where: str) -> str:
        known = {f.name for f in fields(self)}
        if key not in known:
            raise ValueError(f"{where}: GenerateConfig has no field {key!r}; known: {sorted(known)}")
        return key

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
        return int(midnight.timestamp()) * US_PER_SECOND


_EARLIEST_DAY, _LATEST_DAY = EARLIEST_TS.date().toordinal(), LATEST_TS.date().toordinal()

# What the size check counts. An account makes Poisson(U(0, TX_PER_DAY_MAX)) events a day. At its peak the
# generator holds about 270 bytes an event (measured at 0.2M and 1M events) and writing the dataset sorts a
# copy: BYTES_PER_EVENT covers both. A (row, day) cell holds a count and a scenario window's edges; a (home,
# terminal) pair of reach its index and its candidates' (measured: about 20 bytes a pair at 17M pairs).
TX_PER_DAY_MAX = 4.0
MEAN_TX_PER_DAY = TX_PER_DAY_MAX / 2
BYTES_PER_EVENT = 400
BYTES_PER_CELL = 24
BYTES_PER_REACH = 24

# Durations, each in days per unit of its setting: at most MAX_LABEL_DELAY_DAYS, ten years, as ingest's label
# delay; far beyond, a time no longer fits numpy's int64 microseconds.
_DURATIONS = {
    "label_delay_hours_min": 1 / 24,
    "label_delay_days_mean": 1.0,
    "label_delay_days_max": 1.0,
    "legit_label_delay_days": 1.0,
    "card_testing_probe_gap_seconds_max": 1 / DAY_SECONDS,
    "card_testing_cashout_delay_hours_max": 1 / 24,
}
# Amounts: a factor of an account's usual amount, or an amount itself, up to the service's default max_amount
# (consumers/scoring/message_limits.py), so that any event generated would be scored live, not dead-lettered.
MAX_AMOUNT = 1e9
MAX_AMOUNT_FACTOR = 1000.0
_AMOUNT_FACTORS = (
    "compromised_account_amount_factor",
    "takeover_amount_factor_max",
    "drift_amount_factor_max",
)
_AMOUNTS = ("card_testing_probe_amount_max", "card_testing_cashout_amount_max")


def size_problem(cfg: GenerateConfig, memory_bytes: int | None) -> str:
    """Why `cfg` would not fit in `memory_bytes` (this machine's memory; None: unknown), naming the settings
    that size what does not fit, with the estimate; "" when it fits."""
    terms = _memory_terms(cfg)
    needed = sum(count * size for _, count, size in terms)
    if memory_bytes is None or needed <= memory_bytes:
        return ""
    big = sorted((t for t in terms if t[1] * t[2] >= needed / 10), key=lambda t: -t[1] * t[2])
    shown = "; ".join(f"{what}: {count:.3g}, {_bytes(count * size)}" for what, count, size in big)
    return (
        f"these settings need about {_bytes(needed)} of memory to generate, more than this machine's "
        f"{_bytes(memory_bytes)}: {shown}. Lower those settings"
    )


def _memory_terms(cfg: GenerateConfig) -> list[tuple[str, float, int]]:
    """(what, how many, bytes each) of what generating `cfg` holds, at the most its settings allow."""
    a, d = f"accounts={cfg.accounts:,}", f"days={cfg.days:,}"
    takeovers = cfg.takeover_accounts_per_day * cfg.account_scale * cfg.days
    card_tests = cfg.card_testing_accounts_per_day * cfg.account_scale * cfg.days
    windows = cfg.compromised_terminals_per_day * cfg.terminal_scale
    windows += cfg.compromised_accounts_per_day * cfg.account_scale
    # Every home an account has (a moving one, one a step), each with the terminals within radius of it.
    homes = cfg.accounts * (1 + cfg.drift_account_fraction * math.ceil(cfg.days / cfg.drift_home_step_days))
    share = min(1.0, math.pi * cfg.radius**2 / GRID_SIZE**2)
    return [
        (
            f"events: {a} x {d} x {MEAN_TX_PER_DAY:g} a day",
            cfg.accounts * cfg.days * MEAN_TX_PER_DAY,
            BYTES_PER_EVENT,
        ),
        (
            "events of takeovers: takeover_accounts_per_day x days x takeover_days_max x takeover_tx_per_day_factor",
            takeovers * cfg.takeover_days_max * cfg.takeover_tx_per_day_factor * TX_PER_DAY_MAX,
            BYTES_PER_EVENT,
        ),
        (
            "events of card tests: card_testing_accounts_per_day x days x (card_testing_probes_max + "
            "card_testing_cashouts_max)",
            card_tests * (cfg.card_testing_probes_max + cfg.card_testing_cashouts_max),
            BYTES_PER_EVENT,
        ),
        (
            f"day cells: ({a} + terminals={cfg.n_terminals:,}) x {d}",
            (cfg.accounts + cfg.n_terminals) * cfg.days,
            BYTES_PER_CELL,
        ),
        (
            "compromised windows: (compromised_terminals_per_day + compromised_accounts_per_day) x days",
            windows * cfg.days,
            BYTES_PER_CELL,
        ),
        (
            f"terminals in reach of a home: {a}'s homes x terminals={cfg.n_terminals:,} within radius={cfg.radius:g}",
            homes * cfg.n_terminals * share,
            BYTES_PER_REACH,
        ),
    ]


def _bytes(size: float) -> str:
    scaled = size / 2**30
    for unit in ("GiB", "TiB", "PiB"):
        if scaled < 1024:
            return f"{scaled:,.1f} {unit}"
        scaled /= 1024
    return f"{scaled:,.3g} EiB"


def memory_bytes() -> int | None:
    """This machine's memory, or None where the system does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


_AT_LEAST_ONE = {
    "accounts",
    "days",
    "compromised_terminal_days",
    "compromised_account_days",
    "takeover_days_min",
    "drift_home_step_days",
    "card_testing_probes_min",
}

# Greater than 0, not only >= 0: the reach of a home, and the shape of the Gamma the fraud label delays are
# drawn from (its scale is mean / shape).
_POSITIVE = ("radius", "label_delay_gamma_shape")

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
