"""Whole-run checkpoints: everything a run needs to continue after a crash, saved every K steps.

`<checkpoint.save_dir>/step_<N>/` holds the trainer's Megatron distributed checkpoint (model, optimizer in the
layout-independent format, LR scheduler), each rank's RNG state (`trainer/checkpoint.py`), `run_state.json`: the
step (= weight version), the rollout buffer's contents, counters and data position, and `checksums.json` (size
and SHA-256 of every file, checked before anything is loaded). `save_run_checkpoint` writes it into a hidden
`.step_<N>.partial/`, fsyncs it, renames it to `step_<N>/`, then moves `<save_dir>/latest` (written atomically)
and removes all but the last `checkpoint.keep_last`: a crash or a full disk while saving leaves the previous
checkpoint in charge, and a folder named `step_<N>` is always complete.

Nothing here runs code from the files: `.metadata` goes through an allow-listed unpickler
(`parallel/patches/torch_distributed.py`), tensors load with `torch.load(weights_only=True)`, the rest is JSON.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from megatron_rl.errors import UserError
from megatron_rl.models.base import CheckpointError

LATEST = "latest"
RUN_STATE = "run_state.json"
RUN_STATE_FORMAT = 1
PARTIAL_SUFFIX = ".partial"
"""Suffix of the hidden folder a checkpoint is written into before it is renamed to `step_<N>`."""
REWOUND_METRICS = "metrics.rewound.jsonl"
"""Where a resume appends the metric records after its checkpoint's step (`truncate_metrics`)."""
REWOUND = "rewound.json"
"""The step of the run's last honoured `checkpoint.resume_step` (`continue_from`), in `save_dir`."""
ABANDONED = "abandoned"
"""Folder of `save_dir` that a resume from an earlier step moves the later step folders into."""

log = logging.getLogger(__name__)


class ResumeError(UserError, RuntimeError):
    """No usable checkpoint or run record to resume from, or a fresh run pointed at another run's checkpoints; the
    message names the folder or file and what is wrong."""


def step_dir(save_dir: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after `step`."""
    return Path(save_dir) / f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder's name (`step_<N>`), or None for any other name."""
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def staging_dir(save_dir: str | Path, step: int) -> Path:
    """The hidden folder the checkpoint of `step` is written into before it becomes `step_dir`."""
    return Path(save_dir) / f".{step_dir(save_dir, step).name}{PARTIAL_SUFFIX}"


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The last complete checkpoint under `save_dir`, or None when there is none yet."""
    marker = Path(save_dir) / LATEST
    if not marker.exists():
        return None
    name = marker.read_text().strip()
    folder = Path(save_dir) / name
    if step_of(name) is None:  # a resume takes the step from the name
        raise ResumeError(f"{marker} names {name!r}, not a step_<N> folder; {other_checkpoints(save_dir, folder)}")
    if not (folder / RUN_STATE).exists():
        raise ResumeError(
            f"{marker} names {folder}, which has no {RUN_STATE} (deleted or not a run checkpoint);"
            f" {other_checkpoints(save_dir, folder)}"
        )
    return folder


def _step_folders(save_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every `step_<N>` folder under `save_dir`, complete or not, oldest first."""
    folders = Path(save_dir).glob("step_*")
    return sorted((step, p) for p in folders if (step := step_of(p.name)) is not None and p.is_dir())


def checkpoint_steps(save_dir: str | Path) -> list[int]:
    """The steps of the complete checkpoints under `save_dir` (folders `step_<N>` with a run state), oldest first."""
    return [step for step, folder in _step_folders(save_dir) if (folder / RUN_STATE).is_file()]


def resume_checkpoint(save_dir: str | Path, step: int) -> Path | None:
    """The checkpoint a resume continues from: that of `step` (ResumeError naming the others when it is not a
    complete checkpoint), or with `step` 0 the one `latest` names (None when there is none yet)."""
    if not step:
        return latest_checkpoint(save_dir)
    folder = step_dir(save_dir, step)
    if not (folder / RUN_STATE).is_file():
        raise ResumeError(
            f"checkpoint.resume_step={step}: {folder} is not a complete checkpoint (no {RUN_STATE});"
            f" {other_checkpoints(save_dir, folder)}"
        )
    return folder


def other_checkpoints(save_dir: str | Path, failed: str | Path) -> str:
    """What else a resume can start from when checkpoint folder `failed` cannot be used, for its error message."""
    steps = [step for step in checkpoint_steps(save_dir) if step_dir(save_dir, step) != Path(failed)]
    if not steps:
        return f"{save_dir} holds no other complete checkpoint"
    listed = ", ".join(str(step) for step in reversed(steps))
    return f"{save_dir} also holds the checkpoints of steps {listed}: checkpoint.resume_step=<step> resumes from one"


def continue_from(save_dir: str | Path, folder: str | Path, rewind: bool = False) -> list[Path]:
    """(Rank 0, once every rank loaded checkpoint `folder`) make `folder` the run's `latest`, then move the step
    folders after it, a history the resumed run leaves, into a new `save_dir/abandoned/<UTC time>/`: kept, but
    never pruned in place of the run's own checkpoints nor resumed from; returns where they went. `rewind` (a
    `checkpoint.resume_step` honoured) records the step in `save_dir/rewound.json`, which a requeued job reads."""
    save_dir, folder = Path(save_dir), Path(folder)
    step = step_of(folder.name)
    marker = save_dir / LATEST
    if not marker.exists() or marker.read_text().strip() != folder.name:
        write_atomically(marker, folder.name + "\n")  # first: a crash below leaves a resumable run
    if rewind:
        write_atomically(save_dir / REWOUND, json.dumps({"step": step, "at": time.time()}))
    later = [path for number, path in _step_folders(save_dir) if number > step]
    if not later:
        return []
    target = _new_folder(save_dir / ABANDONED / time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
    for path in later:
        os.replace(path, target / path.name)
    _fsync_dir(save_dir)
    log.warning("resumed from step %d: moved the later step folders %s to %s", step, [p.name for p in later], target)
    return [target / path.name for path in later]


def rewound_to(save_dir: str | Path) -> int | None:
    """The step the run's last honoured `checkpoint.resume_step` rewound it to (`continue_from`), or None."""
    try:
        return int(json.loads((Path(save_dir) / REWOUND).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _new_folder(base: Path) -> Path:
    """Create and return `base`, or `base-1`, `base-2`... when it exists."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        candidate = base if n == 0 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"{base}: a thousand folders of that name exist")


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


def check_save_dir(save_dir: str | Path) -> None:
    """Raise ResumeError unless `save_dir` is, or can be made, a folder this process can write in: a path that
    cannot hold checkpoints would otherwise fail only at the run's first save (with the default interval, after
    its last step)."""
    if not save_dir:
        return
    path = Path(save_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ResumeError(
            f"checkpoint.save_dir={str(save_dir)!r} cannot hold checkpoints: {type(err).__name__}: "
            f"{err.strerror or err}{f' ({err.filename})' if err.filename else ''}"
        ) from None


def is_due(step: int, interval: int, last_step: int) -> bool:
    """Whether the checkpoint of `step` is taken: every `interval` steps and after the last one (0: last only)."""
    return step == last_step or (interval > 0 and step % interval == 0)


def read_run_state(folder: str | Path) -> dict:
    """The `run_state.json` of a run checkpoint, checked against its recorded checksum and for its format."""
    path = Path(folder) / RUN_STATE
    try:
        _check_recorded(Path(folder), RUN_STATE)
        state = json.loads(path.read_text())
    except ResumeError as err:  # it differs from its checksum: another checkpoint may be sound
        raise ResumeError(f"{err}; {other_checkpoints(Path(folder).parent, folder)}") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ResumeError(
            f"{path}: unreadable run state ({err}); {other_checkpoints(Path(folder).parent, folder)}"
        ) from None
    if not isinstance(state, dict):
        raise ResumeError(f"{path}: a run state is a JSON object, not a {type(state).__name__}")
    if state.get("format") != RUN_STATE_FORMAT:
        raise ResumeError(f"{path}: run-state format {state.get('format')!r}, this code reads {RUN_STATE_FORMAT}")
    step, buffer = state.get("step"), state.get("buffer")
    if type(step) is not int or step < 0 or not (buffer is None or isinstance(buffer, dict)):
        raise ResumeError(
            f"{path}: 'step' must be a step number and 'buffer' an object or null (got {step!r} and a "
            f"{type(buffer).__name__}); {other_checkpoints(Path(folder).parent, folder)}"
        )
    return state


def write_run_state(folder: str | Path, step: int, buffer_state: dict | None, extra: dict | None = None) -> None:
    """(Rank 0) write the JSON part of a run checkpoint."""
    state = {"format": RUN_STATE_FORMAT, "step": step, "version": step, "buffer": buffer_state, **(extra or {})}
    write_atomically(Path(folder) / RUN_STATE, json.dumps(state))


def mark_latest(save_dir: str | Path, folder: str | Path) -> None:
    """(Rank 0, after every rank finished writing) make `folder` the checkpoint a resume starts from: the files
    not yet in its `checksums.json` (RNG states, run state) are recorded, and `latest` is replaced durably."""
    if Path(folder).is_dir():
        seal_rest(folder)
    write_atomically(Path(save_dir) / LATEST, Path(folder).name + "\n")


def seal_rest(folder: str | Path) -> None:
    """(One process) record the size and SHA-256 of every file of `folder` that `checksums.json` lacks."""
    from megatron_rl.trainer import checkpoint as ckpt  # torch: this module is imported for `megatron-rl --help`

    folder = Path(folder)
    known = ckpt.read_checksums(folder) or {}
    todo = [name for name in ckpt.checkpoint_files(folder) if name not in known]
    ckpt.write_checksums(folder, known | {name: ckpt.file_digest(folder / name) for name in todo})


def _check_recorded(folder: Path, name: str) -> None:
    """ResumeError when `folder/name` differs from its digest in the folder's `checksums.json` (if recorded)."""
    from megatron_rl.trainer import checkpoint as ckpt  # torch: this module is imported for `megatron-rl --help`

    try:
        files = ckpt.read_checksums(folder) or {}
        problem = ckpt.check_files(folder, files, [name]) if name in files else None
    except CheckpointError as err:
        problem = str(err)
    if problem:
        raise ResumeError(problem)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary sibling, fsync it, rename it over `path` and fsync the folder:
    after a crash (even of the machine) readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin_checkpoint(save_dir: str | Path, step: int) -> Path:
    """(Rank 0, before any rank writes) an empty staging folder for the checkpoint of `step` (a stale one, left by
    a save that crashed, is removed first); returns it."""
    staging = staging_dir(save_dir, step)
    if staging.exists():
        log.warning("%s: removing a partial checkpoint (a save of step %d that did not finish)", staging, step)
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit_checkpoint(save_dir: str | Path, staging: str | Path, step: int, keep_last: int) -> Path:
    """(Rank 0, after every rank finished writing into `staging`) record the remaining checksums, rename the
    folder to `step_dir` (an older folder of that name, from a run that was resumed from an earlier step, is
    replaced), make it `latest`, and remove all but the newest `keep_last` checkpoints (0: keep all); returns it."""
    save_dir, staging = Path(save_dir), Path(staging)
    seal_rest(staging)
    final = step_dir(save_dir, step)
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old)
    else:
        os.replace(staging, final)
    _fsync_dir(save_dir)
    write_atomically(save_dir / LATEST, final.name + "\n")
    prune_checkpoints(save_dir, keep_last)
    return final


def prune_checkpoints(save_dir: str | Path, keep_last: int) -> list[Path]:
    """Remove the checkpoints of `save_dir` older than its newest `keep_last` ones (0: none), never the one
    `latest` names; returns the removed folders."""
    save_dir = Path(save_dir)
    if keep_last <= 0:
        return []
    marker = save_dir / LATEST
    current = marker.read_text().strip() if marker.exists() else None
    steps = [folder for _, folder in _step_folders(save_dir)]
    removed = [p for p in steps[:-keep_last] if p.name != current]
    for folder in removed:
        shutil.rmtree(folder)
    if removed:
        log.info("removed %d old checkpoint(s) (checkpoint.keep_last=%d): %s", len(removed), keep_last, removed)
    return removed


def save_run_checkpoint(
    save_dir: str | Path,
    step: int,
    keep_last: int,
    write_trainer: Callable[[Path], None],
    buffer_state: Callable[[], dict | None] | None,
    write_more: Callable[[Path], None] | None = None,
) -> Path:
    """(Every rank) the whole-run checkpoint of `step`, staged, written and committed (see the module docstring);
    returns its folder.

    `write_trainer(folder)` writes this rank's trainer state (`Learner.save`), then `write_more(folder)` (every
    rank, when given: e.g. the Hugging Face export); `buffer_state` (rank 0 only, None on the other ranks) returns
    the buffer's state for `run_state.json`. The ranks agree after each part, so a
    failure on any rank raises the same CheckpointError on every rank (none waits for a rank that gave up), and
    that error says which previous checkpoint stays in charge.
    """
    from megatron_rl.trainer.checkpoint import agree  # torch: this module is imported for `megatron-rl --help`

    is_rank0 = buffer_state is not None
    staging = staging_dir(save_dir, step)
    agree(attempt(lambda: begin_checkpoint(save_dir, step)) if is_rank0 else None)
    try:
        agree(attempt(lambda: write_trainer(staging)))
        if write_more is not None:
            agree(attempt(lambda: write_more(staging)))
        agree(attempt(lambda: write_run_state(staging, step, buffer_state())) if is_rank0 else None)
        agree(attempt(lambda: seal_rest(staging)) if is_rank0 else None)
    except UserError as err:
        if is_rank0:
            shutil.rmtree(staging, ignore_errors=True)  # the space it took is what a full disk needs back
        raise type(err)(f"saving the checkpoint of step {step} failed: {err}; {_previous_note(save_dir)}") from None
    agree(attempt(lambda: commit_checkpoint(save_dir, staging, step, keep_last)) if is_rank0 else None)
    return step_dir(save_dir, step)


def attempt(action: Callable[[], object]) -> str | None:
    """Run `action`; its error as one line (naming the error type unless it is a UserError), or None."""
    try:
        action()
    except UserError as err:
        return str(err)
    except Exception as err:  # any failure of this rank's part must reach the other ranks, not strand them
        return f"{type(err).__name__}: {err}"
    return None


def _previous_note(save_dir: str | Path) -> str:
    """What a failed save leaves in charge, for its error message."""
    marker = Path(save_dir) / LATEST
    if marker.exists():
        name = marker.read_text().strip()
        return f"the previous checkpoint {Path(save_dir) / name} is intact and `--resume` continues from it"
    return "there is no earlier checkpoint of this run"


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
    """Keep the metric records up to `last_step` (a resumed run redoes the later ones) and append the later ones,
    each with `rewound_to`, to `metrics.rewound.jsonl` beside it (nothing recorded is lost, e.g. when that resume
    fails); returns how many stay.

    An unparseable last line (a crash in the middle of writing it) is dropped with a warning; an unparseable line
    before it raises ResumeError naming the file and line. A fresh run (`last_step` 0) keeps nothing, unread.
    """
    path = Path(path)
    if not path.exists():
        return 0
    if last_step <= 0:  # every record has a step >= 1; a fresh run also leaves no earlier run's rewound records
        path.with_name(REWOUND_METRICS).unlink(missing_ok=True)
        write_atomically(path, "")
        return 0
    lines = path.read_text().splitlines()
    last = max((number for number, line in enumerate(lines, 1) if line.strip()), default=0)
    kept, cut = [], []
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
        else:
            cut.append(json.dumps(record | {"rewound_to": last_step}))
    if cut:
        with path.with_name(REWOUND_METRICS).open("a") as rewound:
            rewound.write("".join(line + "\n" for line in cut))
            rewound.flush()
            os.fsync(rewound.fileno())
    write_atomically(path, "".join(line + "\n" for line in kept))
    return len(kept)


def _metrics_record(line: str) -> dict | None:
    """One metrics.jsonl line as a dict, or None when it is not one."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None
