"""Champion/challenger: the pure rule that decides whether a newly trained model replaces the model of record."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

FIRST_MODEL = "first_model"
PROMOTE = "promote"
KEEP_CHAMPION = "keep_champion"
CHAMPION_MOVED = "champion_moved"  # it won, but another run moved the champion first (pipeline/registry.py)


@dataclass(frozen=True)
class Decision:
    decision: str  # FIRST_MODEL, PROMOTE or KEEP_CHAMPION
    reason: str
    margin: float
    challenger: dict[str, Any]
    champion: dict[str, Any] | None

    @property
    def promotes(self) -> bool:
        return self.decision in (FIRST_MODEL, PROMOTE)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _figure(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def decide(evaluation: Mapping[str, Any], min_auc_gain: float, champion_version: Any = None) -> Decision:
    """Promote the challenger when there is no champion, or when its holdout AUC beats the champion's on the
    same holdout rows by at least ``min_auc_gain``; otherwise keep the champion and say why.

    :param evaluation: ``jobs/evaluate.py``'s result: ``challenger`` and ``champion`` (or None) with auc/log_loss.
    """
    challenger = {k: evaluation["challenger"].get(k) for k in ("auc", "log_loss")}
    champion_eval = evaluation.get("champion")
    champion = None if champion_eval is None else {
        "auc": champion_eval.get("auc"), "log_loss": champion_eval.get("log_loss"), "version": champion_version}
    rows = evaluation.get("holdout_rows")
    if challenger["auc"] is None:
        return Decision(KEEP_CHAMPION, f"the challenger's holdout AUC is undefined ({rows} holdout rows with one "
                        "class): nothing to promote", min_auc_gain, challenger, champion)
    if champion is None:
        return Decision(FIRST_MODEL, f"no model of record yet: the challenger (AUC {_figure(challenger['auc'])} on "
                        f"{rows} holdout rows) becomes the first", min_auc_gain, challenger, None)
    if champion["auc"] is None:
        return Decision(PROMOTE, "the champion's AUC is undefined on this holdout; the challenger's is "
                        f"{_figure(challenger['auc'])}", min_auc_gain, challenger, champion)
    gain = challenger["auc"] - champion["auc"]
    compared = (f"challenger AUC {_figure(challenger['auc'])} vs champion v{champion_version} AUC "
                f"{_figure(champion['auc'])} on the same {rows} holdout rows (gain {gain:+.4f}, margin "
                f"{min_auc_gain:.4f})")
    if gain >= min_auc_gain:
        return Decision(PROMOTE, f"promote: {compared}", min_auc_gain, challenger, champion)
    return Decision(KEEP_CHAMPION, f"keep the champion: {compared}", min_auc_gain, challenger, champion)
