"""Reasons for alerts, in the scoring step: an alerted event's logit attributed with its account's state held
fixed (models/attribution.py), grouped and worded (pipeline/features/reasons.py), and the alert record that
carries them.

Only alerts are explained (about 1% of events). The state an alert is explained from is its account's
state just BEFORE the event, which the batched step overwrites in place; so before each step the scorer
copies the states of the batch's accounts (`snapshot`, into buffers kept from one batch to the next), and an
alert that is its account's k-th event of the batch gets its state by stepping that copy through the
account's k - 1 earlier events (one walk for all the account's alerts: _states_before). What this costs on
throughput: docs/benchmarks.md, "Reasons with every alert".
"""

import json
from typing import NamedTuple

import numpy as np
import torch

from models.attribution import DEFAULT_STEPS, attribute
from models.contract import RecurrentDetector, State, gather_states, rounds_of
from pipeline.features.reasons import Explanation, explain

ALERT_BLOCK = 64  # alerts per attribution call at most: bounds its memory (64 x steps rows)


class Snapshot(NamedTuple):
    """The states of a batch's accounts before its step: row of the store -> row of `states`."""

    index: dict[int, int]
    states: State  # [accounts of the batch, ...], views into the explainer's buffers


class AlertExplainer:
    """Explains alerted events of one detector: `top` reasons each, the path integral over `steps` points."""

    def __init__(self, detector: RecurrentDetector, top: int, steps: int = DEFAULT_STEPS):
        if top < 1:
            raise ValueError(f"alert reasons: top = {top!r}, expected an integer >= 1 (0 turns reasons off)")
        self.detector, self.top, self.steps = detector, top, steps
        self._buffers: State = {}

    @torch.inference_mode()
    def snapshot(self, table: State, rows: np.ndarray) -> Snapshot:
        """Copies of the states at `rows` [M] of the store's `table` (one per account), valid until the next
        snapshot."""
        unique = np.unique(rows)
        index = torch.from_numpy(unique).to(next(iter(table.values())).device)
        b = len(unique)
        if b > len(next(iter(self._buffers.values()), ())):
            # room for twice this batch's accounts: a fresh buffer now and then, not every batch
            self._buffers = {
                key: torch.empty((2 * b, *value.shape[1:]), dtype=value.dtype, device=value.device)
                for key, value in table.items()
            }
        states = {
            key: torch.index_select(table[key], 0, index, out=buffer[:b])
            for key, buffer in self._buffers.items()
        }
        return Snapshot(dict(zip(unique.tolist(), range(b), strict=True)), states)

    @torch.inference_mode()
    def explain(
        self, snapshot: Snapshot, rows: np.ndarray, x: torch.Tensor, features: np.ndarray, alerts: np.ndarray
    ) -> dict[int, Explanation]:
        """{position: Explanation} of the alerted events at `alerts` (positions in the batch's applied events):
        rows [M] their accounts' store rows, x [M, F + 1] the detector's inputs, features [M, F] the feature
        rows before normalisation, all in arrival order."""
        if len(alerts) == 0:
            return {}
        detector = self.detector
        x = x.to(device=detector.device, dtype=next(detector.parameters()).dtype)
        before = self._states_before(snapshot, rows, x, alerts)  # [A, ...]
        # One attribution call for up to ALERT_BLOCK alerts: ~5x cheaper per alert than one at a time.
        terms, history, base = [], [], []
        for start in range(0, len(alerts), ALERT_BLOCK):
            block = slice(start, start + ALERT_BLOCK)
            states = {key: value[block] for key, value in before.items()}
            a = attribute(detector, x[alerts[block]], states, self.steps)
            terms.append(a.inputs.double().cpu().numpy())
            history.append(a.history.double().cpu().numpy())
            base.append(a.base.double().cpu().numpy())
        explained = explain(
            np.concatenate(terms), np.concatenate(history), np.concatenate(base), features[alerts], self.top
        )
        return dict(zip(alerts.tolist(), explained, strict=True))

    def _states_before(
        self, snapshot: Snapshot, rows: np.ndarray, x: torch.Tensor, alerts: np.ndarray
    ) -> State:
        """The state of each alert's account just before it [A, ...], in the order of `alerts`.

        One copy per alerting account, stepped through its events of the batch up to its last alert, round
        by round (its r-th event in round r: rounds_of), each alert's state taken out as its round comes. So
        a batch costs one step per event of its busiest alerting account, and an account with k alerts k
        steps, not the k^2 / 2 of stepping a copy per alert through all its earlier events.
        """
        accounts = np.unique(rows[alerts])  # store rows of the alerting accounts
        copy_of = {row: j for j, row in enumerate(accounts.tolist())}
        last_alert = {int(rows[p]): p for p in sorted(alerts.tolist())}
        walk = np.array(
            [p for p in range(max(last_alert.values()) + 1) if last_alert.get(int(rows[p]), -1) >= p]
        )
        owner = torch.as_tensor([copy_of[int(rows[p])] for p in walk.tolist()], device=x.device)
        index = torch.as_tensor([snapshot.index[row] for row in accounts.tolist()])
        states = {
            key: value.index_select(0, index.to(value.device)) for key, value in snapshot.states.items()
        }
        is_alert = np.zeros(len(rows), dtype=bool)
        is_alert[alerts] = True
        taken_at, taken = [], []
        for positions in rounds_of(owner):
            events = walk[positions.cpu().numpy()]
            who = owner[positions]
            here = is_alert[events]
            if here.any():
                taken_at.append(events[here])
                taken.append(gather_states(states, who[torch.from_numpy(here).to(who.device)]))
            self.detector.step_in_place(x[torch.from_numpy(events).to(x.device)], states, who)
        rank = {p: i for i, p in enumerate(np.concatenate(taken_at).tolist())}
        order = torch.as_tensor([rank[p] for p in alerts.tolist()])
        return {
            key: torch.cat([t[key] for t in taken]).index_select(0, order.to(states[key].device))
            for key in states
        }


def encode_alert(score_value: bytes, explanation: Explanation | None) -> bytes:
    """The `alerts` message: the event's `scores` message with its reasons, history term and base logit added
    (no explanation: the scores message as it is)."""
    if explanation is None:
        return score_value
    extra = json.dumps(explanation.as_dict(), separators=(",", ":"), ensure_ascii=True)
    return score_value[:-1] + b"," + extra[1:].encode()
