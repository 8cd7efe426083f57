"""Whole-run checkpoints: everything a run needs to continue after a crash, saved every K steps.

`<checkpoint.save_dir>/step_<N>/` holds the trainer's Megatron distributed checkpoint (model, optimizer in the
layout-independent format, LR scheduler), each rank's RNG state (`trainer/checkpoint.py`), and `run_state.json`: the step (= weight
version), the rollout buffer's contents, counters and data position. `<save_dir>/latest` names the last complete
one and is written last, atomically, so a crash while saving leaves the previous checkpoint in charge.

Nothing here unpickles: tensors load with `torch.load(weights_only=True)`, the rest is JSON.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from megatron_rl.errors import UserError

LATEST = "latest"
RUN_STATE = "run_state.json"
RUN_STATE_FORMAT = 1

log = logging.getLogger(__name__)


class ResumeError(UserError, RuntimeError):
    """No usable checkpoint or run record to resume from, or a fresh run pointed at another run's checkpoints; the
    message names the folder or file and what is wrong."""


def step_dir(save_dir: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after `step`."""
    return Path(save_dir) / f"step_{step:08d}"


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The last complete checkpoint under `save_dir`, or None when there is none yet."""
    marker = Path(save_dir) / LATEST
    if not marker.exists():
        return None
    folder = Path(save_dir) / marker.read_text().strip()
    if not (folder / RUN_STATE).exists():
        raise ResumeError(f"{marker} names {folder}, which has no {RUN_STATE} (deleted or not a run checkpoint)")
    return folder


def refuse_used_save_dir(save_dir: str | Path) -> None:
    """(A fresh run) raise ResumeError when `save_dir` already has a `latest` marker: until this run's first save
    it would name the previous run's checkpoint, which a later `--resume` would silently continue."""
    if not save_dir:
        return
    marker = Path(save_dir) / LATEST
    if marker.exists():
        raise ResumeError(
            f"checkpoint.save_dir={str(save_dir)!r} already holds a run's checkpoints ({marker} names "
            f"{marker.read_text().strip()!r}): pass --resume to continue that run, or choose another "
            "checkpoint.save_dir for a fresh one"
        )


def is_due(step: int, interval: int, last_step: int) -> bool:
    """Whether the checkpoint of `step` is taken: every `interval` steps and after the last one (0: last only)."""
    return step == last_step or (interval > 0 and step % interval == 0)


def read_run_state(folder: str | Path) -> dict:
    """The `run_state.json` of a run checkpoint, checked for its format."""
    path = Path(folder) / RUN_STATE
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ResumeError(f"{path}: unreadable run state ({err})") from None
    if state.get("format") != RUN_STATE_FORMAT:
        raise ResumeError(f"{path}: run-state format {state.get('format')!r}, this code reads {RUN_STATE_FORMAT}")
    return state


def write_run_state(folder: str | Path, step: int, buffer_state: dict | None, extra: dict | None = None) -> None:
    """(Rank 0) write the JSON part of a run checkpoint."""
    state = {"format": RUN_STATE_FORMAT, "step": step, "version": step, "buffer": buffer_state, **(extra or {})}
    write_atomically(Path(folder) / RUN_STATE, json.dumps(state))


def mark_latest(save_dir: str | Path, folder: str | Path) -> None:
    """(Rank 0, after every rank finished writing) make `folder` the checkpoint a resume starts from."""
    write_atomically(Path(save_dir) / LATEST, Path(folder).name + "\n")


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary sibling and a rename: readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "config.yaml")
"""Files whose presence says a run folder holds a run."""


def refuse_used_run_dir(run_dir: str | Path, resume: bool, overwrite: bool) -> None:
    """(Before anything is written) raise ResumeError when `run_dir` holds an earlier run and this one neither
    continues it (`resume`) nor replaces it (`overwrite`): a fresh run would otherwise empty its metrics and
    replace its config, even if it then failed to start."""
    run_dir = Path(run_dir)
    found = [name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if found and not (resume or overwrite):
        raise ResumeError(
            f"{run_dir} holds an earlier run ({', '.join(found)}): pass --resume to continue it, --overwrite to "
            "replace it, or choose another name= (or output_dir=)"
        )


def truncate_metrics(path: str | Path, last_step: int) -> int:
    """Keep the metric records up to `last_step` (a resumed run redoes the later ones); returns how many stay.

    An unparseable last line (a crash in the middle of writing it) is dropped with a warning; an unparseable line
    before it raises ResumeError naming the file and line. A fresh run (`last_step` 0) keeps nothing, unread.
    """
    path = Path(path)
    if not path.exists():
        return 0
    if last_step <= 0:  # every record has a step >= 1
        write_atomically(path, "")
        return 0
    lines = path.read_text().splitlines()
    last = max((number for number, line in enumerate(lines, 1) if line.strip()), default=0)
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _metrics_record(line)
        if record is None and number == last:
            log.warning("%s: dropping its unparseable last line %d (torn by a crash while writing it)", path, number)
            break
        if record is None:
            raise ResumeError(f"{path}: line {number} is not a JSON record (only a torn last line is dropped)")
        if record.get("step", 0) <= last_step:
            kept.append(line)
    write_atomically(path, "".join(line + "\n" for line in kept))
    return len(kept)


def _metrics_record(line: str) -> dict | None:
    """One metrics.jsonl line as a dict, or None when it is not one."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None
