"""`--report-to`: training metrics also go to an accelerate tracker (TensorBoard, W&B, MLflow, ...), beside the
run's log.jsonl. `hamburger train` logs through its Accelerator; `train-drafter` and `train-merger`, which run
without one, through a `Tracker`."""

from __future__ import annotations

from pathlib import Path

import torch

from hamburger.errors import HamburgerError


def check_tracker(name: str) -> str | None:
    """The accelerate tracker `--report-to` names, or None for "none"; a clear error if it is unknown or its
    package is not installed (accelerate itself would skip it silently)."""
    if name == "none":
        return None
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers  # noqa: PLC0415

    if name not in LOGGER_TYPE_TO_CLASS:
        raise HamburgerError(f"--report-to {name!r}: not a tracker accelerate knows; choose none or one of "
                             f"{', '.join(sorted(LOGGER_TYPE_TO_CLASS))}")
    if name not in [str(t) for t in get_available_trackers()]:
        raise HamburgerError(f"--report-to {name}: its package is not installed (pip install {name})")
    return name


class Tracker:
    """Rows of numbers to the tracker `name` names (under out/tracker/<project> for the file-based ones), by
    step; with "none" it does nothing. Only the numeric fields of a row are sent."""

    def __init__(self, name: str, out: Path, project: str, config: dict) -> None:
        self._acc = None
        if check_tracker(name) is None:
            return
        from accelerate import Accelerator  # noqa: PLC0415

        self._acc = Accelerator(log_with=name, project_dir=str(out / "tracker"), cpu=not torch.cuda.is_available())
        self._acc.init_trackers(project, config={k: v for k, v in config.items()
                                                 if isinstance(v, (int, float, str, bool))})

    def log(self, row: dict, step: int, prefix: str) -> None:
        if self._acc is not None:
            numbers = {f"{prefix}/{k}": float(v) for k, v in row.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
            self._acc.log(numbers, step=step)

    def end(self) -> None:
        if self._acc is not None:
            self._acc.end_training()
            self._acc = None
