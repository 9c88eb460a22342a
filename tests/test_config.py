"""Config loading, overrides, name resolution, and every validation error's message."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from megafp8.config import (
    AttentionConfig, Config, ConfigError, GqaConfig, MlaConfig, ModelConfig, MoeConfig, ignored_settings,
    load_config, parse_overrides, validate_for_world,
)
from megafp8.config.loader import (REPO_CONFIG_DIR, available_configs, model_config_from_saved, repeated_overrides,
                                   resolve_config_path)
from megafp8.config.schema import field_doc
from tests.conftest import REPO, torchrun_env


def test_every_shipped_config_loads():
    names = available_configs()
    assert "tiny_dense.yaml" in names
    for name in names:
        cfg = load_config(name)
        assert cfg.run_name == name.removesuffix(".yaml")


def test_bare_name_resolves_with_or_without_suffix():
    assert resolve_config_path("tiny_dense") == REPO_CONFIG_DIR / "tiny_dense.yaml"
    assert resolve_config_path("tiny_dense.yaml") == REPO_CONFIG_DIR / "tiny_dense.yaml"


def test_yaml_values_and_named_size():
    cfg = load_config("tiny_dense")
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.attention.num_kv_heads) == (256, 4, 2)
    assert cfg.optimizer.lr == pytest.approx(2e-3)


def test_dotted_overrides_win_and_are_typed():
    cfg = load_config("tiny_dense", ["model.num_layers=2", "optimizer.lr=1e-3", "checkpoint.dir=null",
                                     "training.device=cpu"])
    assert cfg.model.num_layers == 2 and isinstance(cfg.model.num_layers, int)
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)  # "1e-3" is a string to PyYAML
    assert cfg.checkpoint.dir is None


def test_explicit_model_keys_beat_the_named_size():
    cfg = load_config(None, ["model.size=1b", "model.num_layers=3"])
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 2048


def test_every_field_has_a_doc():
    checked = []

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            assert field_doc(f), f"{prefix}{f.name} has no doc"
            checked.append(prefix + f.name)
            value = getattr(obj, f.name)
            if isinstance(value, AttentionConfig):
                for kind in AttentionConfig.kinds().values():
                    walk(kind(), f"{prefix}{f.name}.")
            elif dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")

    walk(Config(), "")
    assert {"model.hidden_size", "optimizer.lr", "model.attention.kv_lora_rank", "model.moe.top_k"} <= set(checked)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.num_layer=2"], "unknown config key 'model.num_layer'. Did you mean 'model.num_layers'?"),
        (["modle.num_layers=2"], "unknown config key 'modle'. Did you mean 'model'?"),
        (["model.num_layers=four"], "model.num_layers: expected int, got str ('four')"),
        (["optimizer.lr=fast"], "optimizer.lr: expected float, got str ('fast')"),
        (["precision.recipe=bf61"], "is not one of 'auto' | 'bf16' | 'fp8' | 'fp16' | 'fp32' (did you mean 'bf16'?)"),
        (["model.num_heads=6"], "model.num_heads=6 does not divide model.hidden_size=256"),
        (["model.attention.num_kv_heads=3"], "model.attention.num_kv_heads=3 must divide model.num_heads=4"),
        (["model.size=1bb"], "unknown size '1bb'. Did you mean '1b'?"),
        (["training.global_batch_size=10"], "global_batch_size=10 is not a multiple of training.micro_batch_size=4"),
        (["optimizer.warmup_steps=500"], "optimizer.warmup_steps=500 exceeds training.steps=200"),
        (["optimizer.min_lr=1.0"], "optimizer.min_lr=1.0 must be between 0 and optimizer.lr"),
        (["optimizer.bucket_size_mb=0"], "optimizer.bucket_size_mb must be positive, got 0"),
        (["data.seq_len=0"], "data.seq_len must be positive"),
        (["model=3"], "model: expected a mapping"),
        (["num_layers"], "is not of the form section.key=value"),
        (["training.steps=1e3"], "training.steps: expected int, got str ('1e3'): write it as 1000"),
        (["training.steps=1000.0"], "training.steps: expected int, got float (1000.0): write it as 1000"),
        (["training.compile_mode=reduce-overhead"], "training.compile_mode=reduce-overhead needs training.compile=true"),
        (["training.compile=true", "training.compile_mode=fast"], "is not one of 'default' | 'reduce-overhead'"),
        (["model.rope_scaling.factor=8"], "model.rope_scaling.factor=8.0 has no effect with model.rope_scaling.type=none"),
        (["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8", "model.rope_scaling.mscale=1"],
         "model.rope_scaling.mscale=1.0 has no effect with model.rope_scaling.type=llama3"),
        (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=0.5"], "model.rope_scaling.factor must be >= 1"),
        (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.beta_fast=0.5"],
         "model.rope_scaling needs 0 < beta_slow < beta_fast"),
        (["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8", "model.rope_scaling.low_freq_factor=4"],
         "model.rope_scaling needs 0 < low_freq_factor < high_freq_factor"),
        (["model.rope_scaling.kind=yarn"], "unknown config key 'model.rope_scaling.kind'"),
    ],
)
def test_bad_settings_give_one_clear_error(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_dense", overrides)
    assert expected in str(err.value)


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hiden_size: 512\n")
    with pytest.raises(ConfigError, match=r"'model.hiden_size'. Did you mean 'model.hidden_size'\?.*bad.yaml"):
        load_config(str(path))


def test_a_yaml_syntax_error_is_one_line_naming_where(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  size: tiny\n  hidden_size: 256\n  num_layers 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value) == (f"{path}: not valid YAML: line 4, column 3: could not find expected ':' (while "
                              "scanning a simple key)")  # was five lines, naming "<unicode string>"


@pytest.mark.parametrize("text, line, key, first", [
    ("model:\n  size: tiny\nmodel:\n  num_layers: 2\n", 3, "model", 1),  # PyYAML kept the second: size dropped
    ("training:\n  steps: 3\n  lr_decay_steps: 3\n  steps: 4\n", 4, "steps", 2),
])
def test_a_key_given_twice_in_a_yaml_file_is_refused_not_overwritten(tmp_path, text, line, key, first):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value) == (f"{path}: not valid YAML: line {line}, column {1 if key == 'model' else 3}: '{key}' is "
                              f"given twice (first on line {first}); merge the two into one")


def test_yaml_merge_keys_still_let_a_section_override_what_it_merges(tmp_path):
    path = tmp_path / "merged.yaml"
    path.write_text("model: &m\n  size: tiny\n  num_layers: 2\nmodel_again_for_yaml_only: &o\n  <<: *m\n"
                    "  num_layers: 3\n")
    from megafp8.config.loader import read_config_file

    assert read_config_file(path)["model_again_for_yaml_only"] == {"size": "tiny", "num_layers": 3}


def test_a_config_that_is_not_utf8_or_is_a_directory_is_one_clear_error(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("# café\nmodel:\n  size: tiny\n".encode("latin-1"))
    with pytest.raises(ConfigError) as err:  # was UnicodeDecodeError's traceback
        load_config(str(latin1))
    assert str(err.value) == f"{latin1}: not UTF-8 text (byte 5 is 0xe9); a config is a YAML file saved as UTF-8"
    (tmp_path / "a.yaml").write_text("model:\n  size: tiny\n")
    with pytest.raises(ConfigError) as err:  # was "not found"
        load_config(str(tmp_path))
    assert str(err.value) == f"config '{tmp_path}' is a directory; give one of its files (a.yaml, latin1.yaml)"
    with pytest.raises(ConfigError, match=r"^the config name is empty: give a file or one of .*tiny_dense.yaml"):
        load_config("")  # was "config '' is a directory" (the working directory's files)


@pytest.mark.parametrize("override, problem", [
    ("optimizer.lr=[1",
     "line 1, column 1: expected ',' or ']', but got '<stream end>' (while parsing a flow sequence)"),
    ("run_name=*exp", "line 1, column 1: found undefined alias 'exp'"),
])
def test_an_override_value_that_is_not_yaml_is_one_line_not_a_traceback(override, problem):
    with pytest.raises(ConfigError) as err:  # was yaml's own exception: a traceback from launch/pretrain.py
        load_config("tiny_dense", [override])
    key, _, text = override.partition("=")
    assert str(err.value).startswith(f"override '{override}': its value is not valid YAML ({problem}); ")
    assert str(err.value).endswith(f"'{key}=\"{text}\"'")
    assert load_config("tiny_dense", ["run_name=\"*exp\""]).run_name == "*exp"


@pytest.mark.parametrize("override, problem", [
    ("data.paths=[a,b",
     "line 1, column 1: expected ',' or ']', but got '<stream end>' (while parsing a flow sequence)"),
    ("precision.bf16_layers=[*.attn.*]",
     "line 1, column 2: expected alphabetic or numeric character, but found '.' (while scanning an alias)"),
])
def test_a_list_written_wrong_is_told_how_to_write_a_list_not_to_quote_it(override, problem):
    """`data.paths=[a,b` was told to quote its value ('data.paths="[a,b"'): a one-item list of the text "[a,b"."""
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as err:
        load_config("tiny_dense", [override])
    assert str(err.value) == (f"override '{override}': {key} is a list, and this value is not a valid YAML list "
                              f"({problem}): write it as '{key}=[a, b]', its items between [ and ] separated by "
                              "commas, an item holding YAML's special characters (e.g. * : # ,) in double quotes")
    written = load_config("tiny_dense", ['precision.bf16_layers=["*.attn.*", x]'])  # as the message says
    assert written.precision.bf16_layers == ["*.attn.*", "x"]


def test_missing_config_name_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"config 'tiny_dens' not found.*Did you mean 'tiny_dense.yaml'"):
        load_config("tiny_dens")


def test_non_mapping_yaml_is_rejected(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(str(path))


def test_world_size_checks():
    cfg = load_config("tiny_dense")  # global 16, micro 4
    assert validate_for_world(cfg, 1) == 4
    assert validate_for_world(cfg, 2) == 2
    with pytest.raises(ConfigError, match=r"must be a multiple of micro_batch_size x data-parallel ranks = 4 x 3 = 12"):
        validate_for_world(cfg, 3)
    cfg = load_config("tiny_dense", ["parallel.dp=4"])
    with pytest.raises(ConfigError, match="parallel.dp=4 but 2 rank"):
        validate_for_world(cfg, 2)


# 128 q and kv features per rank at TP=2
TP_READY = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128"]


def test_tensor_parallel_layout_checks():
    cfg = load_config("tiny_dense", TP_READY + ["parallel.tp=2"])
    assert validate_for_world(cfg, 4) == 2  # dp 2: 16 / (4 x 2)
    with pytest.raises(ConfigError, match=r"3 rank\(s\) cannot be split into tp=2 .* change parallel.tp"):
        validate_for_world(cfg, 3)
    with pytest.raises(ConfigError, match=r"model.num_heads=4 is not divisible by parallel.tp=3.*set parallel.tp"):
        validate_for_world(load_config("tiny_dense", ["parallel.tp=3"]), 3)
    # tiny's 2 kv heads x 64 give 64 key/value features per rank at TP=2: not whole FP8 tiles.
    with pytest.raises(ConfigError, match=r"key/value features\) = 128 splits into 64 per rank.*multiple of 256.*"
                                          r"change model.attention.num_kv_heads or model.attention.head_dim"):
        validate_for_world(load_config("tiny_dense", ["parallel.tp=2"]), 2)
    with pytest.raises(ConfigError, match=r"model.ffn_hidden_size = 640 splits into 320 per rank"):
        validate_for_world(load_config("tiny_dense", TP_READY + ["parallel.tp=2", "model.ffn_hidden_size=640"]), 2)
    # The vocabulary (BF16 embedding and LM head) only has to split evenly: 192 rows per rank are fine.
    assert validate_for_world(load_config("tiny_dense", TP_READY + ["parallel.tp=2", "model.vocab_size=384"]), 2)
    with pytest.raises(ConfigError, match=r"model.vocab_size=385 does not split evenly over parallel.tp=2"):
        validate_for_world(load_config("tiny_dense", TP_READY + ["parallel.tp=2", "model.vocab_size=385"]), 2)
    with pytest.raises(ConfigError, match=r"sequence_parallel splits each micro-batch's 1 x 255 tokens"):
        validate_for_world(load_config("tiny_dense", TP_READY + [
            "parallel.tp=2", "parallel.sequence_parallel=true", "data.seq_len=255", "training.micro_batch_size=1"]), 2)


def test_parse_overrides_nests():
    assert parse_overrides(["a.b=1", "a.c=x", "d=[1, 2]"]) == {"a": {"b": 1, "c": "x"}, "d": [1, 2]}


@pytest.mark.parametrize("script", ["launch/pretrain.py", "tools/plan.py"])
def test_usage_and_config_errors_answer_before_torch_is_imported(script):
    """--help, a usage error and a config that does not load are reported without importing torch (seconds, more
    from a cluster's shared file system, for a typo): the entry scripts load the config through
    `megafp8.train.command_line`, which stays free of it, before `megafp8.train.main`."""
    for argv, status, said in ((["--help"], 0, "usage: "), (["--config", "tiny_dense", "--training.steps=3"], 2,
                                                            "settings are overrides without dashes"),
                               (["--config", "tiny_dense", "model.no_such_key=1"], 2,
                                "unknown config key 'model.no_such_key'"),
                               (["--config", "no_such_config"], 2, "config 'no_such_config' not found")):
        result = subprocess.run([sys.executable, "-X", "importtime", script, *argv], cwd=REPO, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == status and said in result.stdout + result.stderr, (argv, result.stderr[-2000:])
        imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                    if line.startswith("import time:")}
        assert "megafp8.train.command_line" in imported and "torch" not in imported, argv


@pytest.mark.parametrize("script, options", [("launch/pretrain.py", ["--print-config"]),
                                             ("launch/pretrain.py", ["--dry-run", "--world-size", "2"]),
                                             ("tools/plan.py", ["--world-size", "2", "--layouts"])])
def test_printing_and_planning_a_config_import_neither_the_trainer_nor_checkpointing(script, options):
    """`--print-config`, `--dry-run` and `--layouts` go to `megafp8.train.preview` past the config: torch and the
    planner, not the trainer or torch.distributed.checkpoint (with DTensor ~1.1 s of a 2-core machine's start-up);
    what they print is what `megafp8.train.main`'s `main` and `plan_main` (which callers in Python use) print."""
    argv = ["--config", "tiny_dense", *options, "model.vocab_size=384"]
    result = subprocess.run([sys.executable, "-X", "importtime", script, *argv], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "megafp8.train.preview" in imported and "torch" in imported
    assert not imported & {"megafp8.train.main", "megafp8.train.trainer", "torch.distributed.checkpoint"}
    entry = "plan_main" if script == "tools/plan.py" else "main"
    through_main = subprocess.run([sys.executable, "-c", f"import sys; from megafp8.train.main import {entry}; "
                                   f"sys.exit({entry}(sys.argv[1:]))", *argv],
                                  cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert through_main.returncode == 0 and through_main.stdout == result.stdout, through_main.stderr[-2000:]


def test_a_key_given_twice_on_the_command_line_is_warned_of_with_the_value_used(capsys):
    """`optimizer.lr=1e-3 ... optimizer.lr=2e-3` took the last value without a word. It still does (a wrapper
    script's defaults, then its user's overrides, is how commands are layered), but now says so, once per key."""
    from megafp8.train.main import main, plan_main

    twice = ["optimizer.lr=1e-3", "model.num_layers=2", "optimizer.lr=2e-3", "model.num_layers=3", "optimizer.lr=3",
             "model.vocab_size=384"]
    for entry, options in ((main, ["--print-config"]), (plan_main, [])):
        assert entry(["--config", "tiny_dense", *options, *twice]) == 0
        out, err = capsys.readouterr()
        assert err == ("warning: override optimizer.lr is given 3 times (optimizer.lr=1e-3, optimizer.lr=2e-3, "
                       "optimizer.lr=3): optimizer.lr=3 is used\n"
                       "warning: override model.num_layers is given 2 times (model.num_layers=2, model.num_layers=3): "
                       "model.num_layers=3 is used\n"), err
    assert repeated_overrides(["a.b=1", "a.c=x"]) == []
    assert load_config("tiny_dense", twice).optimizer.lr == 3
    assert main(["--config", "tiny_dense", "--print-config", "optimizer.lr=2e-3", "model.num_layers=2"]) == 0
    assert capsys.readouterr().err == ""


def test_settings_the_rest_of_the_config_makes_inert_are_warned_of(capsys):
    """`precision.fp8_layers=...` or `precision.fp8_start_step=...` on a BF16 config trained BF16 without a word. A
    warning, not an error: `benchmarks/train_step.py --recipes bf16 fp8` runs both recipes with the same settings."""
    from megafp8.train.main import main

    given = ["precision.fp8_layers=[layers.*.mlp.*]", "precision.fp8_start_step=5", "precision.loss_scale_min=2"]
    assert main(["--config", "tiny_dense", "--print-config", *given]) == 0
    assert capsys.readouterr().err == (
        'warning: precision.fp8_start_step=5 has no effect with precision.recipe=bf16 (only fp8 reads it)\n'
        'warning: precision.fp8_layers=["layers.*.mlp.*"] has no effect with precision.recipe=bf16 (only fp8 reads '
        'it)\n'
        'warning: precision.loss_scale_min=2.0 has no effect with precision.recipe=bf16 (only fp16 reads it)\n')
    assert ignored_settings(load_config("tiny_dense_fp8", given[:2])) == []
    assert ignored_settings(load_config("tiny_dense", ["precision.recipe=auto", *given])) == []  # any
    assert ignored_settings(load_config("tiny_dense_fp8", ["precision.recipe=bf16"])) == []  # a baseline
    assert ignored_settings(load_config("tiny_dense", ["parallel.ep_dispatch_fp8=true",
                                                       "optimizer.wsd_decay_fraction=0.5"])) == [
        "parallel.ep_dispatch_fp8=true has no effect with precision.recipe=bf16 (tokens travel in the recipe's own "
        "format)",
        "optimizer.wsd_decay_fraction=0.5 has no effect with optimizer.decay_style=cosine (only wsd reads it)"]
    assert ignored_settings(load_config("tiny_dense_fp8", ["parallel.ep_dispatch_fp8=true", "optimizer.decay_style=wsd",
                                                           "optimizer.wsd_decay_fraction=0.5"])) == []


def test_an_empty_run_name_is_refused_not_run_in_a_directory_called_run(tmp_path, capsys):
    """`run_name=` printed '' as the run's name while the run wrote into `<logging.output_dir>/run`; only a
    run_name left out takes the config file's name."""
    from megafp8.train.main import main

    assert main(["--config", "tiny_dense", "--print-config", "run_name="]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(
        "error: run_name='' is empty: give the run a name (run_name=NAME), or leave run_name out to name the run "
        "after its config file (tiny_dense) [config: "), err
    path = tmp_path / "named.yaml"
    path.write_text('run_name: " "\n')
    with pytest.raises(ConfigError, match=r"^run_name=' ' is empty: .* after its config file \(named\)"):
        load_config(str(path))
    assert load_config(str(path), ["run_name=mine"]).run_name == "mine"
    assert load_config("tiny_dense").run_name == "tiny_dense"


@pytest.mark.parametrize("overrides, expected", [
    (["model.hidden_size=1099511627776"], "this model would have about 1.5e+25 parameters, more than 1e+15"),
    (["model.vocab_size=4611686018427387904"], "this model would have about 2.4e+21 parameters"),
    (["model.num_layers=1000000"], "model.num_layers=1000000 exceeds 1024"),
    (["data.seq_len=4294967296"], "a micro-batch of training.micro_batch_size x data.seq_len = 17179869184 tokens"),
    (["parallel.timeout_minutes=0"], "parallel.timeout_minutes must be above 0 and at most 10080 (a week), got 0"),
    (["parallel.timeout_minutes=-1"], "parallel.timeout_minutes must be above 0"),
    (["parallel.timeout_minutes=1e300"], "parallel.timeout_minutes must be above 0 and at most 10080 (a week), got 1e+300"),
    (["optimizer.lr=.inf"], "optimizer.lr: expected a finite number, got inf"),
    (["optimizer.weight_decay=.nan"], "optimizer.weight_decay: expected a finite number, got nan"),
    (["model.norm_eps=.nan"], "model.norm_eps: expected a finite number"),
    (["model.init_std=.inf"], "model.init_std: expected a finite number"),
    (["optimizer.grad_clip=.nan"], "optimizer.grad_clip: expected a finite number"),
    (["precision.recipe=fp16", "precision.loss_scale_initial=inf"], "precision.loss_scale_initial: expected a finite"),
    (["precision.recipe=fp16", "precision.loss_scale_initial=512", "precision.loss_scale_min=1024"],  # overflows raised
     "precision.loss_scale_min=1024 exceeds precision.loss_scale_initial=512: an overflow would raise the scale"),
    (["training.eval_iters=0"], "training.eval_iters=0: evaluation (training.eval_interval=50) needs at least 1"),
    (["training.eval_iters=-2"], "training.eval_iters must be >= 0, or -1 for the whole validation split, got -2"),
    (["logging.peak_tflops=-1"], "logging.peak_tflops must be positive (or null), got -1"),
    (["logging.fp8_health_interval=-1"], "logging.fp8_health_interval must be >= 0, got -1"),  # was never sampled
    (["training.max_consecutive_skips=0"], "training.max_consecutive_skips must be at least 1, got 0"),
    (["run_name=../escaped"], "run_name='../escaped' must be a plain name, not a path"),  # was a run outside
    (["run_name=.."], "run_name='..' must be a plain name"),                                  # output_dir
    (["logging.metrics_file="], "logging.metrics_file='' names no file: give a file name"),  # was IsADirectoryError
    (["logging.metrics_file=logs/.."], "logging.metrics_file='logs/..' names no file"),       # at the first record
    (["parallel.tp=0"], "parallel.tp must be positive, got 0"),  # was ZeroDivisionError padding a data vocabulary
    (["parallel.ep=0"], "parallel.ep must be positive, got 0"),
    (["training.global_batch_size=12"], "training.global_batch_size=12 must be a multiple of micro_batch_size x "
                                        "data-parallel ranks = 4 x 2 = 8"),
])
def test_the_dry_run_refuses_what_the_launch_refuses_in_one_line(capsys, overrides, expected):
    """Mutations of tiny_dense.yaml that 0800a78's dry run passed (to die at launch), answered with a traceback,
    or never finished planning."""
    from megafp8.train.main import main

    vocab = [] if any(o.startswith("model.vocab_size=") for o in overrides) else ["model.vocab_size=384"]
    assert main(["--config", "tiny_dense", "--dry-run", "--world-size", "2", *vocab, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err


@pytest.mark.parametrize("argv, expected", [
    (["--config", "tiny_dense", "--training.steps=10"],
     "unrecognized arguments: --training.steps=10 (settings are overrides without dashes, after the options: "
     "training.steps=10)"),
    (["--config", "tiny_dense", "--steps"], "unrecognized arguments: --steps (settings go after the options as "
                                            "section.key=value, e.g. training.steps=10; --print-config lists them)"),
    (["tiny_dense.yaml"], "the following arguments are required: --config (e.g. --config tiny_dense.yaml: a file in "
                          "configs/, or a path)"),
])
def test_a_usage_error_says_how_to_write_what_was_meant(capsys, argv, expected):
    """argparse alone said 'unrecognized arguments: --training.steps=10' and stopped there."""
    from megafp8.train.main import main, plan_main

    for entry in (main, plan_main):
        with pytest.raises(SystemExit) as exit:
            entry(argv)
        assert exit.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(f"error: {expected}")


# -------------------------------------------------------------------------------- model sections

@pytest.mark.parametrize("overrides, expected", [
    (["model.moe_top_k=4"], "model.moe_top_k moved: use model.moe.top_k ["),
    (["model.kv_lora_rank=256"], "model.kv_lora_rank moved: use model.attention.kv_lora_rank ["),
    (["model.num_kv_heads=2"], "model.num_kv_heads moved: use model.attention.num_kv_heads ["),
    (["model.attention=mla"], "model.attention=mla moved: use model.attention.kind=mla ["),
    (["model.moe_num_experts=8", "model.moe_top_k=4"],
     "model.moe_num_experts moved: use model.moe.num_experts (and model.moe_top_k -> model.moe.top_k) ["),
])
def test_an_old_flat_model_key_names_its_new_place(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_dense", overrides)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_an_old_flat_config_file_is_refused_in_one_line(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("model:\n  attention: mla\n  kv_lora_rank: 512\n  moe_num_experts: 8\n")
    with pytest.raises(ConfigError, match=r"^model.attention=mla moved: use model.attention.kind=mla \(and "
                                          r"model.kv_lora_rank -> model.attention.kv_lora_rank, model.moe_num_experts "
                                          r"-> model.moe.num_experts\) \[config: .*old.yaml\]$"):
        load_config(str(path))


def test_nested_model_sections_take_dotted_overrides():
    cfg = load_config("tiny_moe_fp8", ["model.moe.top_k=4", "model.moe.score_func=softmax"])
    assert (cfg.model.moe.top_k, cfg.model.moe.score_func, cfg.model.moe.num_experts) == (4, "softmax", 8)
    assert load_config("tiny_dense", ["model.moe.num_experts=4"]).model.moe.num_experts == 4


def test_another_attention_kind_drops_the_earlier_kinds_settings():
    """tiny's size sets the GQA kv heads; switching the kind on the command line leaves them behind, and a setting the
    new kind has survives even when given before the switch."""
    cfg = load_config("tiny_dense", ["model.attention.kv_lora_rank=256", "model.attention.num_kv_heads=1",
                                     "model.attention.kind=mla", "model.attention.v_head_dim=64"])
    assert cfg.model.attention == MlaConfig(kv_lora_rank=256, v_head_dim=64)
    assert load_config("tiny_dense", ["model.attention.kind=gqa"]).model.attention == GqaConfig(num_kv_heads=2)
    # An override switching back to GQA drops the file's MLA ranks.
    cfg = load_config("tiny_mla_moe_mtp_fp8", ["model.attention.kind=gqa", "model.attention.num_kv_heads=2"])
    assert cfg.model.attention == GqaConfig(num_kv_heads=2)


@pytest.mark.parametrize("overrides, expected", [
    (["model.attention.kv_lora_rank=256"], "model.attention.kv_lora_rank is a setting of model.attention.kind=mla, "
                                           "not of kind gqa: remove it, or set model.attention.kind=mla"),
    (["model.attention.kind=mla", "model.attention.num_kv_heads=2"],
     "model.attention.num_kv_heads is a setting of model.attention.kind=gqa, not of kind mla"),
    (["model.attention.kind=mlaa"], "model.attention.kind: 'mlaa' is not one of 'gqa' | 'mla' (did you mean 'mla'?)"),
    (["model.attention.num_kv_head=2"], "unknown config key 'model.attention.num_kv_head'. Did you mean "
                                        "'model.attention.num_kv_heads'?"),
    (["model.moe.topk=2"], "unknown config key 'model.moe.topk'. Did you mean 'model.moe.top_k'?"),
    (["model.moe.num_experts=8", "model.moe.top_k=9"], "model.moe.top_k=9 exceeds model.moe.num_experts=8"),
    (["model.moe.num_experts=8", "model.moe.routed_scaling_factor=0"],  # routed experts silently multiplied by 0
     "model.moe.routed_scaling_factor=0 must be positive"),
    (["model.moe.num_experts=8", "model.moe.first_dense_layers=4"],  # no MoE block: a RuntimeError at the first step
     "model.moe.first_dense_layers=4 must be between 0 and model.num_layers - 1 = 3, leaving at least one MoE block"),
    (["model.attention.kind=mla", "model.attention.qk_rope_head_dim=63"],
     "model.attention.qk_rope_head_dim=63 must be even for RoPE"),
])
def test_bad_model_sections_give_one_clear_error(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_dense", overrides)
    assert expected in str(err.value)


def test_a_config_saved_in_the_flat_layout_reads_as_todays():
    """Checkpoints and run directories written before the model sections hold every key flat, the other attention
    kind's at its defaults."""
    flat = {"size": None, "vocab_size": 384, "hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
            "head_dim": None, "attention": "gqa", "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128, "ffn_hidden_size": 768, "rope_scaling": {"type": "none"},
            "moe_num_experts": 8, "moe_top_k": 2, "moe_score_func": "softmax", "moe_bias_update_rate": 0.0,
            "a_key_of_a_later_version": 1}
    cfg = model_config_from_saved(flat)
    assert cfg == ModelConfig(vocab_size=384, hidden_size=256, num_layers=4, num_heads=4,
                              attention=GqaConfig(num_kv_heads=2), ffn_hidden_size=768,
                              moe=MoeConfig(num_experts=8, top_k=2, score_func="softmax", bias_update_rate=0.0))
    mla = model_config_from_saved({**flat, "attention": "mla", "q_lora_rank": 128})
    assert mla.attention == MlaConfig(q_lora_rank=128)
    assert model_config_from_saved(dataclasses.asdict(mla)) == mla  # today's layout reads as itself


def test_the_printed_config_loads_back(tmp_path):
    from megafp8.config import dump_config

    cfg = load_config("tiny_mla_moe_mtp_fp8")
    path = tmp_path / "printed.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(str(path)).model == cfg.model


def test_layer_spec_says_which_blocks_hold_experts():
    from megafp8.config import layer_spec, mtp_layer_spec

    cfg = load_config("tiny_mla_moe_mtp_fp8").model  # 4 layers, the first dense
    specs = [layer_spec(cfg, i) for i in range(cfg.num_layers)]
    assert [s.is_moe for s in specs] == [False, True, True, True]
    assert specs[0].mlp.ffn_hidden_size == 768 and specs[1].mlp is cfg.moe and specs[0].attention is cfg.attention
    assert mtp_layer_spec(cfg).is_moe
    assert not any(layer_spec(load_config("tiny_dense").model, i).is_moe for i in range(4))


def test_the_blocks_describe_themselves_in_one_line():
    from megafp8.config import describe_blocks

    assert describe_blocks(load_config("tiny_dense").model) == "4 layers, hidden 256, 4 heads / 2 kv, ffn 768"
    assert describe_blocks(load_config("671b_fp8").model) == ("61 layers, hidden 7168, 128 heads MLA (q/kv ranks "
                                                              "1536/512), ffn 18432, 256 experts top-8 (ffn 2048)")


@pytest.mark.parametrize("overrides, asked, suggested", [
    # 6 heads / 2 kv heads of 128 at tp=4: whole heads fail; tp=2 splits heads but leaves 128 kv features per rank
    (["model.num_heads=6", "model.hidden_size=768", "model.attention.num_kv_heads=2"], 4, "1 or 2"),
    (["model.num_heads=6", "model.hidden_size=384", "model.attention.num_kv_heads=2"], 4, "1"),
    (["model.num_heads=16", "model.hidden_size=4096", "model.attention.num_kv_heads=8",
      "model.ffn_hidden_size=1024"], 3, "1, 2, 4 or 8"),
])
def test_a_tensor_parallel_size_that_does_not_split_the_model_suggests_only_sizes_that_do(overrides, asked,
                                                                                          suggested):
    """The suggestion used to list the head count's divisors (tp=2 for 6 heads of 64 wide), which then failed the
    128-wide shard check: it lists only sizes that pass every check."""
    cfg = load_config("tiny_dense", overrides + ["model.vocab_size=512", f"parallel.tp={asked}"])
    with pytest.raises(ConfigError, match=rf"set parallel.tp to one that splits this model: {suggested}$"):
        validate_for_world(cfg, world_size=asked * 2)


def test_the_tensor_parallel_suggestion_leaves_out_sizes_the_vocabulary_does_not_split():
    """A configured model.vocab_size splits evenly over parallel.tp, or the run is refused: the suggestion for 16
    heads at tp=3 listed 4 and 8, which a vocabulary of 50,258 rows then refused."""
    cfg = load_config("tiny_dense", ["model.num_heads=16", "model.hidden_size=4096", "model.attention.num_kv_heads=8",
                                     "model.ffn_hidden_size=1024", "model.vocab_size=50258", "parallel.tp=3"])
    with pytest.raises(ConfigError, match=r"set parallel.tp to one that splits this model: 1 or 2$"):
        validate_for_world(cfg, world_size=6)
