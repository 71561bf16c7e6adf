"""An account's story as a figure: its events' amounts and the score trajectory the scorer gave them, and
its alerts' reasons as a table.

Used by the backtest notebook to look at alerted accounts one by one.
"""

from datetime import datetime

import polars as pl
from matplotlib.figure import Figure  # no pyplot: notebooks display the returned figure themselves


def alerted_accounts(scored: pl.DataFrame, start: datetime, end: datetime, n: int = 3) -> list[str]:
    """The `n` accounts with the highest single score in [start, end), fraudulent or not."""
    window = scored.filter((pl.col("ts") >= start) & (pl.col("ts") < end))
    best = (
        window.group_by("account_id")
        .agg(pl.col("score").max())
        .sort(["score", "account_id"], descending=[True, False])
    )
    return best.head(n)["account_id"].to_list()


def account_timeline(scored: pl.DataFrame, frame: pl.DataFrame, account_id: str, threshold: float) -> Figure:
    """Amounts (top) and scores (bottom) of one account's events over time; fraud events marked in red."""
    events = (
        scored.filter(pl.col("account_id") == account_id)
        .join(
            frame.select("event_id", "amount", *(c for c in ("scenario",) if c in frame.columns)),
            on="event_id",
        )
        .sort("ts")
    )
    if events.height == 0:
        raise ValueError(f"account {account_id!r} has no scored events")
    fraud = events["is_fraud"].to_numpy()
    ts = events["ts"].to_list()
    fig = Figure(figsize=(9, 4.5))
    amount_ax, score_ax = fig.subplots(2, 1, sharex=True)
    amount_ax.scatter(ts, events["amount"], s=8, c=["tab:red" if f else "tab:blue" for f in fraud])
    amount_ax.set(
        ylabel="amount", yscale="log", title=f"account {account_id}: events (fraud in red) and scores"
    )
    score_ax.plot(ts, events["score"], lw=0.8, color="tab:gray")
    score_ax.scatter(ts, events["score"], s=8, c=["tab:red" if f else "tab:blue" for f in fraud])
    score_ax.axhline(threshold, color="tab:orange", ls="--", lw=0.8, label=f"alert threshold {threshold:g}")
    score_ax.set(ylabel="score", ylim=(0, 1))
    score_ax.legend(loc="upper left", fontsize=8)
    fig.autofmt_xdate()
    return fig


def alert_reasons(
    scored: pl.DataFrame, start: datetime, end: datetime, accounts: list[str] | None = None
) -> pl.DataFrame:
    """One row per alerted event in [start, end) (of `accounts`, when given), in time order: ts, account_id,
    event_id, score, is_fraud, its reasons worded with what each adds to the logit ("reason 1" ...), and the
    account history's term. `scored`: BacktestResult.scored of a backtest with reasons."""
    if "reasons" not in scored.columns:
        raise ValueError("these scores carry no reasons: run the backtest with reasons > 0")
    alerts = scored.filter(pl.col("alert") & (pl.col("ts") >= start) & (pl.col("ts") < end))
    if accounts is not None:
        alerts = alerts.filter(pl.col("account_id").is_in(accounts))
    top = max((len(r) for r in alerts["reasons"].to_list() if r), default=0)
    worded = pl.col("reasons").list.eval(
        pl.element().struct.field("text")
        + pl.format(" ({})", pl.element().struct.field("logit").round(2).map_elements(_signed, pl.String))
    )
    return (
        alerts.sort("ts", "event_id")
        .with_columns(worded.alias("_worded"))
        .select(
            "ts",
            "account_id",
            "event_id",
            "score",
            *(["is_fraud"] if "is_fraud" in alerts.columns else []),
            *(pl.col("_worded").list.get(i, null_on_oob=True).alias(f"reason {i + 1}") for i in range(top)),
            pl.col("history_logit").map_elements(_signed, pl.String).alias("history"),
        )
    )


def _signed(logit: float) -> str:
    return f"{logit:+.2f}"
