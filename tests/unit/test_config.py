"""Config schema: every shipped YAML loads, overrides apply, errors name field, value and what is allowed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config, parse_override
from megatron_rl.config.loader import explain

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("**/*.yaml"))


def test_configs_exist():
    assert CONFIGS, "configs/ ships no YAML"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    config = load_config(path)
    assert config.steps >= 1


def test_dotted_overrides_apply_with_yaml_types():
    config = load_config(
        None, ["trainer.parallel.ep=2", "model.dtype=float32", "algorithm.is_cap=1.5", "trainer.parallel.dp="]
    )
    assert config.trainer.parallel.ep == 2
    assert config.model.dtype == "float32"
    assert config.algorithm.is_cap == 1.5


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.paralel.ep=2", "trainer.paralel: unknown field; did you mean 'trainer.parallel'"),
        ("trainer.parallel.ep=0", "trainer.parallel.ep: Input should be greater than or equal to 1 \\(got 0\\)"),
        ("model.dtype=fp8", "model.dtype: must be one of 'float32' or 'bfloat16' \\(got 'fp8'\\)"),
        ("mode=fast", "mode: must be one of 'sync', 'one_step_off' or 'async'"),
        ("steps=many", "steps: .*integer.*\\(got 'many'\\)"),
        ("steps=yes", "steps: must be a number, not true/false \\(got True\\)"),
        ("trainer.parallel.tp=true", "trainer.parallel.tp: must be a number, not true/false"),
        ("algorithm.is_cap=false", "algorithm.is_cap: must be a number, not true/false"),
        ("model.make_tiny=true", "model.make_tiny=true needs model.family"),
        ("rollout.top_p=0", "rollout.top_p: Input should be greater than 0"),
        ("rollout.top_k=0", "rollout.top_k: must be -1 \\(off\\) or at least 1 \\(got 0\\)"),
        ("rollout.top_p=0.9", "rollout.top_p=0.9 with algorithm.sampling_mask needs rollout.top_k"),
        ("rollout.temperature=0", "rollout.temperature: Input should be greater than 0"),
        ("checkpoint.load_dir=/ckpt", "checkpoint.load_dir: unknown field"),
        ("trainer.timeout_s=.inf", "trainer.timeout_s: Input should be a finite number \\(got inf\\)"),
        ("sync.timeout_s=.nan", "sync.timeout_s: Input should be a finite number"),
        ("sync.bind_host='not a host!!'", "sync.bind_host: must be an IP address, a host name .* or 'auto'"),
        ("name=../..", "name: must be a folder name .*no '/' and not '..'"),
        ("name=a/b", "name: must be a folder name"),
        ("algorithm.is_cap_low=3", "algorithm: is_cap_low=3.0 must be at most is_cap=2.0"),
        ("algorithm.veto_max=0.5", "algorithm: veto_max=0.5 must be above 1: every on-policy sequence"),
        ("algorithm.veto_min=5", "algorithm: veto_min=5.0 must be below 1"),
        ("algorithm.is_cap=0.5", None),  # a truncation below 1 only scales the weights
        ("algorithm.correction=seq_mis", None),
        ("trainer.cpu_affinity=[0,-1]", "trainer.cpu_affinity.1: Input should be greater than or equal to 0"),
        ("rollout.cpu_affinity=[-2]", "rollout.cpu_affinity.0: Input should be greater than or equal to 0"),
        ("buffer.max_staleness=0", "mode=async generates at least one step ahead .* buffer.max_staleness=0 forbids"),
    ],
)
def test_errors_name_field_value_and_allowed(override, message):
    if message is None:  # accepted
        load_config(None, [override])
        return
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_only_sync_mode_runs_with_no_staleness_at_all():
    assert load_config(None, ["mode=sync", "buffer.max_staleness=0"]).buffer.max_staleness == 0
    with pytest.raises(ConfigError, match="mode=one_step_off generates at least one step ahead"):
        load_config(None, ["mode=one_step_off", "buffer.max_staleness=0"])


@pytest.mark.parametrize("correction", ["mis", "seq_mis", "geo_mis"])
def test_masking_bounds_that_leave_out_an_on_policy_ratio_are_refused(correction):
    with pytest.raises(ConfigError, match=f"correction={correction} keeps ratios in \\[2, 0.5\\] .* leaves out 1"):
        load_config(None, [f"algorithm.correction={correction}", "algorithm.is_cap=0.5"])
    with pytest.raises(ConfigError, match=r"keeps ratios in \[1.5, 2\]"):
        load_config(None, [f"algorithm.correction={correction}", "algorithm.is_cap_low=1.5"])
    load_config(None, [f"algorithm.correction={correction}", "algorithm.is_cap=1", "algorithm.is_cap_low=1"])


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        parse_override("trainer.parallel.ep")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["steps=3", "steps.x=1"])


def test_an_override_indexes_a_list_the_config_holds(tmp_path):
    config = tmp_path / "mix.yaml"
    config.write_text("task:\n  name: dataset\n  datasets:\n    - {path: a.jsonl}\n    - {path: b.jsonl}\n")
    cfg = load_config(config, ["task.datasets.1.weight=2", "task.datasets.0.answer_key=solution"])
    assert [(d.path, d.weight, d.answer_key) for d in cfg.task.datasets] == [
        ("a.jsonl", 1.0, "solution"), ("b.jsonl", 2.0, None)  # None: task.answer_key
    ]  # fmt: skip
    for key in ("task.datasets.2.weight", "task.datasets.first"):
        with pytest.raises(
            ConfigError, match=r"'task.datasets' is a list of 2: index it with 0 to 1, or set the whole"
        ):
            load_config(config, [f"{key}=2"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path)  # a folder
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"steps: \xff\xfe\n")
    with pytest.raises(ConfigError, match="binary.yaml: cannot read the config file"):
        load_config(binary)


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="buffer.capacity=4 must be at least prompts_per_step=8") as err:
        load_config(None, ["buffer.capacity=4", "prompts_per_step=8"])
    assert "(top level)" not in str(err.value) and "got {" not in str(err.value)  # not the whole config dumped


def test_a_prompt_and_its_response_must_fit_the_sequence_length():
    base = ["model.max_sequence_length=256", "task.name=dataset", "task.path=x.jsonl"]
    assert load_config(None, [*base, "rollout.max_new_tokens=56"]).task.max_prompt_tokens == 200  # the default fits
    with pytest.raises(ConfigError, match="task.max_prompt_tokens=250 \\+ rollout.max_new_tokens=8 exceeds model"):
        load_config(None, [*base, "rollout.max_new_tokens=8", "task.max_prompt_tokens=250"])
    with pytest.raises(ConfigError, match="rollout.max_new_tokens=256 leaves no room for a prompt"):
        load_config(None, ["model.max_sequence_length=256", "rollout.max_new_tokens=256"])


def test_keeping_stale_groups_needs_an_importance_correction():
    assert load_config(None, ["buffer.stale_policy=correct"]).algorithm.correction == "tis"
    for algorithm in (["algorithm.correction=none"], ["algorithm.loss=ppo"]):
        with pytest.raises(ConfigError, match="buffer.stale_policy=correct keeps groups past max_staleness"):
            load_config(None, ["buffer.stale_policy=correct", *algorithm])


def test_a_missing_checkpoint_is_an_error_unless_a_tiny_one_is_asked_for(tmp_path):
    from megatron_rl.launcher import ensure_model

    real = load_config("configs/qwen3_30b_a3b.yaml", [f"model.hf_path={tmp_path}/Qwen3-30B-A3B"])
    with pytest.raises(FileNotFoundError, match="no config.json there"):
        ensure_model(real)
    assert not (tmp_path / "Qwen3-30B-A3B").exists()  # no random stand-in made


def test_every_field_is_documented():
    undocumented = [line for line in explain() if line.endswith(": ")]
    assert not undocumented


def test_config_import_is_light():
    code = (
        "import sys, megatron_rl.config as c; c.load_config(None, ['steps=2']); "
        "heavy=[m for m in sys.modules if m.split('.')[0] in ('torch','megatron','vllm','ray','transformers')]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_host_names_addresses_and_auto_are_accepted():
    for host in ("127.0.0.1", "::1", "auto", "node-3.cluster.local", "gpu17"):
        assert load_config(None, [f"sync.bind_host={host}"]).sync.bind_host == host


@pytest.mark.parametrize(
    "argv, message",
    [
        (["verify", "parity", "--hf", "x", "--batch", "0"], "argument --batch: '0': must be at least 1"),
        (["verify", "parity", "--hf", "x", "--timeout", "nan"], "argument --timeout: 'nan': must be a finite number"),
        (["convert", "hf-to-mcore", "--hf", "x", "--out", "y", "--tp", "0"], "argument --tp: '0': must be at least 1"),
        (["verify", "sync", "--hf", "x", "--inflight-requests", "-1"], "--inflight-requests: '-1': must not be neg"),
        (["verify", "routing", "--hf", "x", "--perturb", "0"], "argument --perturb: '0': must be a finite number"),
        (["verify", "routing", "--hf", "x", "--ep", "-2"], "argument --ep: '-2': must be at least 1"),
    ],
)
def test_bad_flags_are_usage_errors_not_tracebacks(argv, message, capsys):
    from megatron_rl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_wandb_project_needs_wandb_installed_when_the_config_loads(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb_project: needs the wandb package: pip install -e \.\[cpu,wandb\]"):
        load_config(None, ["wandb_project=my-project"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else real(name, *a))
    assert load_config(None, ["wandb_project=my-project"]).wandb_project == "my-project"


def test_overrides_may_follow_a_commands_flags_and_anything_else_left_over_is_refused():
    """`train c.yaml --overwrite steps=5` was refused ("unrecognized arguments: steps=5")."""
    from megatron_rl.cli import parse  # as above: the commands' imports are the CLI's, not the config's

    args = parse(["train", "configs/quickstart.yaml", "steps=4", "--overwrite", "trainer.parallel.ep=1"])
    assert args.overwrite and args.overrides == ["steps=4", "trainer.parallel.ep=1"]
    assert parse(["config", "configs/quickstart.yaml", "--explain", "steps=3"]).overrides == ["steps=3"]
    for stray in (["--bogus"], ["--overwrite", "stray"]):
        with pytest.raises(SystemExit):
            parse(["train", "configs/quickstart.yaml", *stray])


def test_a_key_given_twice_and_a_file_without_settings_are_refused(tmp_path):
    """PyYAML keeps the last of two equal keys silently, and an empty file loaded as all the defaults."""
    twice = tmp_path / "twice.yaml"
    twice.write_text("steps: 5\ntrainer:\n  optimizer: {lr: 1.0e-4}\nsteps: 6\n")
    message = r"twice.yaml: not valid YAML \(line 4, column 1: the key 'steps' is given twice \(first at line 1\)\)$"
    with pytest.raises(ConfigError, match=message):
        load_config(twice)
    with pytest.raises(ConfigError, match=r"column 14: the key 'lr' is given twice \(first at line 1\)"):
        load_config(None, ["trainer.optimizer={lr: 1.0e-4, lr: 2.0e-4}"])
    for name, text in (("empty.yaml", ""), ("comment.yaml", "# steps: 5\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=f"{name}: the file holds no settings"):
            load_config(tmp_path / name)
    merged = tmp_path / "merged.yaml"  # a merge key's entries may be overridden: not a repeat
    merged.write_text("base: &b {lr: 1.0e-4, clip_grad: 1.0}\ntrainer:\n  optimizer: {<<: *b, lr: 2.0e-4}\n")
    with pytest.raises(ConfigError, match="base: unknown field"):  # the merge loaded; only `base` is unknown
        load_config(merged)


def test_an_unknown_field_in_a_list_of_sections_names_the_sections_fields():
    """The known fields were an empty list inside `task.rewards` / `task.datasets` entries."""
    with pytest.raises(ConfigError, match=r"task.rewards.0.fun: unknown field; did you mean 'task.rewards.0.fn'\? "
                       r"\(known: fn, name, weight\)"):  # fmt: skip
        load_config("configs/quickstart.yaml", ["task.rewards=[{fun: math}]"])
    with pytest.raises(
        ConfigError, match=r"task.datasets.0.wieght: unknown field; did you mean 'task.datasets.0.weight'"
    ):
        load_config("configs/quickstart.yaml", ["task.datasets=[{path: a.jsonl, wieght: 2}]"])
