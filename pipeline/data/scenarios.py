"""The fraud scenarios behind `pipeline.data.generate`, and the vectorised sampling helpers they share with it.

Shape letters: A accounts, M terminals, D days, N events, E scenario episodes, P points on the grid.
Every function draws from the Generator it is given, in a fixed order, so a seed fixes the output.
"""

from dataclasses import dataclass

import numpy as np

from pipeline.data.world import DAY_SECONDS, DAY_US, GRID_SIZE, US_PER_SECOND, GenerateConfig, World

# Handbook time of day: N(noon, 20000 s), redrawn until it falls inside the day.
TIME_OF_DAY_MEAN_SECONDS = 43_200.0
TIME_OF_DAY_STD_SECONDS = 20_000.0
# After this many redraws a point keeps whatever terminal it has: only a grid with hardly any far
# terminals gets there, and then a near one is the best on offer.
UNUSUAL_TERMINAL_TRIES = 100

# Codes of the scenario column (see pipeline.data.generate.SCENARIOS); a higher code wins when several apply.
LEGIT, DRIFT, HIGH_AMOUNT = 0, 1, 2  # codes from HIGH_AMOUNT up are fraud
COMPROMISED_TERMINAL, COMPROMISED_ACCOUNT, ACCOUNT_TAKEOVER, CARD_TESTING = 3, 4, 5, 6


@dataclass(frozen=True)
class Events:
    """Events as parallel arrays, all (N,): account index, terminal index, time, amount, scenario code."""

    acc: np.ndarray  # int64
    term: np.ndarray  # int64
    ts_us: np.ndarray  # int64, microseconds since the Unix epoch
    amount: np.ndarray  # float64, rounded to cents
    code: np.ndarray  # int8

    @staticmethod
    def concat(parts: list["Events"]) -> "Events":
        return Events(
            acc=np.concatenate([p.acc for p in parts]).astype(np.int64),
            term=np.concatenate([p.term for p in parts]).astype(np.int64),
            ts_us=np.concatenate([p.ts_us for p in parts]).astype(np.int64),
            amount=np.concatenate([p.amount for p in parts]).astype(np.float64),
            code=np.concatenate([p.code for p in parts]).astype(np.int8),
        )


@dataclass(frozen=True)
class Reach:
    """Terminals within the radius of each of P points, as CSR: p reaches indices[indptr[p]:indptr[p+1]]."""

    indptr: np.ndarray  # (P + 1,) int64
    indices: np.ndarray  # (nnz,) int64, ascending within a point

    def counts(self) -> np.ndarray:
        return np.diff(self.indptr)

    def pick(self, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
        """A terminal chosen uniformly among those point `rows[i]` reaches, from uniforms `u[i]` in [0, 1).

        Every row must reach at least one terminal.
        """
        start = self.indptr[rows]
        n = self.indptr[rows + 1] - start
        return self.indices[start + (u * n).astype(np.int64)]


def terminals_within(points: np.ndarray, terminal_xy: np.ndarray, radius: float) -> Reach:
    """CSR of the terminals within `radius` of each point; points (P, 2) and terminal_xy (M, 2) on the grid."""
    # Terminals bucketed into square cells of side >= radius: a point's terminals lie in its own cell or the
    # 8 around it, so the work grows with P x (terminals per 9 cells), not with P x M.
    M = len(terminal_xy)
    n_side = max(1, min(int(GRID_SIZE // radius), 1024))  # cells per side
    side = GRID_SIZE / n_side

    def cell_of(xy: np.ndarray) -> np.ndarray:  # (n, 2) -> (n, 2) cell coordinates
        return np.clip((xy // side).astype(np.int64), 0, n_side - 1)

    tc = cell_of(terminal_xy)
    t_cell = tc[:, 0] * n_side + tc[:, 1]
    by_cell = np.argsort(t_cell, kind="stable")  # terminals grouped by cell
    cell_start = np.searchsorted(t_cell[by_cell], np.arange(n_side * n_side + 1))  # (cells + 1,)
    pc = cell_of(points)
    # Chunks of points bound the candidate (point, terminal) pairs held at once to a few million.
    chunk = max(1, 4_000_000 // (9 * M // (n_side * n_side) + 1))
    counts, found = np.zeros(len(points), dtype=np.int64), []
    for lo in range(0, len(points), chunk):
        cx, cy = pc[lo : lo + chunk, 0], pc[lo : lo + chunk, 1]
        cand_p, cand_t = [], []
        for dx in (-1, 0, 1):
            for dy in (-1, 0, 1):
                nx, ny = cx + dx, cy + dy
                inside = (nx >= 0) & (nx < n_side) & (ny >= 0) & (ny < n_side)
                cell = np.where(inside, nx * n_side + ny, 0)
                first, n = cell_start[cell], np.where(inside, cell_start[cell + 1] - cell_start[cell], 0)
                cand_p.append(np.repeat(np.arange(lo, lo + cx.size), n))
                cand_t.append(by_cell[np.repeat(first, n) + ragged_arange(n)])
        p, t = np.concatenate(cand_p), np.concatenate(cand_t)
        gap = points[p] - terminal_xy[t]
        near = gap[:, 0] ** 2 + gap[:, 1] ** 2 <= radius * radius
        key = np.sort(p[near] * M + t[near])  # by point, then terminal
        counts[lo : lo + cx.size] = np.bincount(key // M - lo, minlength=cx.size)
        found.append(key % M)
    indptr = np.zeros(len(points) + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    return Reach(indptr=indptr, indices=indices)


def ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """0..n-1 for each group of length n, concatenated: [2, 3] -> [0, 1, 0, 1, 2]."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts


def ragged_cumsum(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Running sum of `values` restarted at each group; `lengths` are the group sizes, all >= 1."""
    if not len(values):
        return np.asarray(values, dtype=np.float64)
    cs = np.cumsum(values)
    ends = np.cumsum(lengths)
    before = np.concatenate(([0.0], cs[ends[:-1] - 1]))  # sum of all earlier groups
    return cs - np.repeat(before, lengths)


def draw_time_of_day(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n,) seconds after midnight from N(43200, 20000), redrawn until inside [0, 86400)."""
    seconds = rng.normal(TIME_OF_DAY_MEAN_SECONDS, TIME_OF_DAY_STD_SECONDS, size=n)
    bad = np.flatnonzero((seconds < 0) | (seconds >= DAY_SECONDS))
    while bad.size:  # ~3% are outside each round, so a handful of rounds suffices
        seconds[bad] = rng.normal(TIME_OF_DAY_MEAN_SECONDS, TIME_OF_DAY_STD_SECONDS, size=bad.size)
        bad = bad[(seconds[bad] < 0) | (seconds[bad] >= DAY_SECONDS)]
    return seconds


def draw_amounts(rng: np.random.Generator, mean: np.ndarray) -> np.ndarray:
    """(N,) amounts ~ N(mean, mean / 2) in cents; negatives redrawn from U(0, 2 mean) as the Handbook does."""
    amount = rng.normal(mean, mean / 2)
    neg = np.flatnonzero(amount < 0)
    amount[neg] = rng.uniform(0.0, 2 * mean[neg])
    # Rounding can make a tiny amount 0.00; a transaction moves at least a cent.
    return np.maximum(np.round(amount, 2), 0.01)


def event_times(day: np.ndarray, seconds: np.ndarray, start_us: int) -> np.ndarray:
    """(N,) microseconds since the epoch for a day index and seconds after that day's midnight."""
    return start_us + day.astype(np.int64) * DAY_US + (seconds * US_PER_SECOND).astype(np.int64)


def active_days(n_rows: int, days: int, rows: np.ndarray, first_day: np.ndarray, n_days: int) -> np.ndarray:
    """(n_rows, D) bool: row r is active from each of its first days for n_days (cut at the period's end)."""
    # +1 where a window opens, -1 where it closes, then a running sum along the days counts open windows.
    edges = np.zeros((n_rows, days + 1), dtype=np.int32)
    np.add.at(edges, (rows, first_day), 1)
    np.add.at(edges, (rows, np.minimum(first_day + n_days, days)), -1)
    return np.cumsum(edges[:, :days], axis=1) > 0


def daily_starts(rng: np.random.Generator, per_day: float, days: int) -> np.ndarray:
    """The day of each episode: Poisson(per_day) episodes start on each day; (E,) day indices, ascending."""
    return np.repeat(np.arange(days), rng.poisson(per_day, size=days))


def compromised_terminals(cfg: GenerateConfig, rng: np.random.Generator) -> np.ndarray:
    """(M, D) bool: Handbook scenario 2; each day some terminals are compromised for the next 28 days."""
    first = daily_starts(rng, cfg.compromised_terminals_per_day * cfg.terminal_scale, cfg.days)
    term = rng.integers(0, cfg.n_terminals, size=first.size)
    return active_days(cfg.n_terminals, cfg.days, term, first, cfg.compromised_terminal_days)


def compromised_accounts(cfg: GenerateConfig, rng: np.random.Generator) -> np.ndarray:
    """(A, D) bool: Handbook scenario 3; each day some accounts are compromised for the next 14 days."""
    first = daily_starts(rng, cfg.compromised_accounts_per_day * cfg.account_scale, cfg.days)
    acc = rng.integers(0, cfg.accounts, size=first.size)
    return active_days(cfg.accounts, cfg.days, acc, first, cfg.compromised_account_days)


def pick_unusual_terminals(
    rng: np.random.Generator, world: World, acc: np.ndarray, day: np.ndarray, min_distance: float
) -> np.ndarray:
    """(E,) a random terminal at least `min_distance` from each account's home on that day."""
    home = world.home_xy(acc, day)  # (E, 2)
    term = rng.integers(0, len(world.terminal_xy), size=acc.size)
    todo = np.arange(acc.size)
    for _ in range(UNUSUAL_TERMINAL_TRIES):
        gap = world.terminal_xy[term[todo]] - home[todo]
        todo = todo[np.hypot(gap[:, 0], gap[:, 1]) < min_distance]
        if not todo.size:
            break
        term[todo] = rng.integers(0, len(world.terminal_xy), size=todo.size)
    return term


def account_takeovers(
    cfg: GenerateConfig, world: World, rng: np.random.Generator, candidates: np.ndarray, start_us: int
) -> Events:
    """Scenario 4: for a few days a fraudster far from home spends more, more often, on the account.

    The owner's own transactions go on meanwhile; only the injected events are fraud.
    """
    first = daily_starts(rng, cfg.takeover_accounts_per_day * cfg.account_scale, cfg.days)  # (E,)
    first = first if candidates.size else first[:0]  # no account can transact: nothing to take over
    acc = rng.choice(candidates, size=first.size)
    n_days = rng.integers(cfg.takeover_days_min, cfg.takeover_days_max + 1, size=first.size)
    n_days = np.minimum(n_days, cfg.days - first)
    factor = rng.uniform(cfg.takeover_amount_factor_min, cfg.takeover_amount_factor_max, size=first.size)
    far = pick_unusual_terminals(rng, world, acc, first, cfg.unusual_terminal_distance_min)
    reach = terminals_within(world.terminal_xy[far], world.terminal_xy, cfg.radius)  # P = E fraud locations

    # One row per (episode, day), then per event.
    ep_day_ep = np.repeat(np.arange(first.size), n_days)
    ep_day = first[ep_day_ep] + ragged_arange(n_days)
    rate = cfg.takeover_tx_per_day_factor * np.maximum(world.tx_per_day[acc[ep_day_ep]], 1.0)
    per_event = np.repeat(np.arange(ep_day.size), rng.poisson(rate))  # (N,) index into (episode, day)
    ep, day = ep_day_ep[per_event], ep_day[per_event]
    # Fraudsters keep no office hours: the time of day is uniform, another shift from the owner's habits.
    seconds = rng.uniform(0, DAY_SECONDS, size=ep.size)
    amount = draw_amounts(rng, world.mean_amount_at(acc[ep], day) * factor[ep])
    term = reach.pick(ep, rng.random(ep.size))
    return Events(
        acc=acc[ep],
        term=term,
        ts_us=event_times(day, seconds, start_us),
        amount=amount,
        code=np.full(ep.size, ACCOUNT_TAKEOVER, dtype=np.int8),
    )


def card_testing(
    cfg: GenerateConfig, world: World, rng: np.random.Generator, candidates: np.ndarray, start_us: int
) -> Events:
    """Scenario 5: tiny probes at one unusual terminal within minutes, then large cash-outs within hours."""
    # The last day starts no episode when there is another, so the cash-outs stay inside the period.
    first = daily_starts(rng, cfg.card_testing_accounts_per_day * cfg.account_scale, max(cfg.days - 1, 1))
    first = first if candidates.size else first[:0]
    acc = rng.choice(candidates, size=first.size)
    far = pick_unusual_terminals(rng, world, acc, first, cfg.unusual_terminal_distance_min)  # (E,)
    reach = terminals_within(world.terminal_xy[far], world.terminal_xy, cfg.radius)
    t0 = first * DAY_SECONDS + rng.uniform(0, DAY_SECONDS, size=first.size)  # (E,) seconds from day 0

    n_probes = rng.integers(cfg.card_testing_probes_min, cfg.card_testing_probes_max + 1, size=first.size)
    probe_ep = np.repeat(np.arange(first.size), n_probes)
    gaps = rng.uniform(1.0, cfg.card_testing_probe_gap_seconds_max, size=probe_ep.size)
    probe_t = t0[probe_ep] + ragged_cumsum(gaps, n_probes)
    probe_amount = np.round(
        rng.uniform(cfg.card_testing_probe_amount_min, cfg.card_testing_probe_amount_max, size=probe_ep.size),
        2,
    )
    last_probe_t = probe_t[np.cumsum(n_probes) - 1]  # (E,)

    n_cash = rng.integers(cfg.card_testing_cashouts_min, cfg.card_testing_cashouts_max + 1, size=first.size)
    cash_ep = np.repeat(np.arange(first.size), n_cash)
    delay_s = rng.uniform(60.0, cfg.card_testing_cashout_delay_hours_max * 3600, size=cash_ep.size)
    cash_t = last_probe_t[cash_ep] + delay_s
    cash_amount = np.round(
        rng.uniform(
            cfg.card_testing_cashout_amount_min, cfg.card_testing_cashout_amount_max, size=cash_ep.size
        ),
        2,
    )
    cash_term = reach.pick(cash_ep, rng.random(cash_ep.size))  # near the tested terminal; may be it

    ep = np.concatenate([probe_ep, cash_ep])
    seconds = np.concatenate([probe_t, cash_t])
    return Events(
        acc=acc[ep],
        term=np.concatenate([far[probe_ep], cash_term]),
        ts_us=start_us + (seconds * US_PER_SECOND).astype(np.int64),
        amount=np.concatenate([probe_amount, cash_amount]),
        code=np.full(ep.size, CARD_TESTING, dtype=np.int8),
    )
