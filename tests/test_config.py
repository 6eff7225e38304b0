"""Config parsing, overrides and validation messages (no ranks are started)."""

import pytest

from meshfit.config import ConfigError, load_config
from meshfit.parallel.dims import ParallelDims
from meshfit.train.shape import resolve_run
from meshfit.util.units import fmt_bytes, parse_bytes


def test_units():
    assert parse_bytes("300MiB") == 300 * 2**20
    assert parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1.5 GiB") == int(1.5 * 2**30)
    assert parse_bytes(1234) == 1234
    with pytest.raises(ValueError, match="MiB"):
        parse_bytes("12 parsecs")
    assert fmt_bytes(3 * 2**20) == "3.0 MiB"


def test_files_and_overrides(tmp_path):
    (tmp_path / "run.toml").write_text('[model]\npreset = "small"\n[train]\nsteps = 5\nmemory_budget = "300MiB"\n')
    (tmp_path / "run.yaml").write_text("train:\n  steps: 6\n  lr: 1.0e-3\n")
    cfg = load_config(tmp_path / "run.toml", ["train.steps=7", "parallel.dp_replicate=2", "train.lr=3e-4"])
    assert (cfg.model.preset, cfg.train.steps, cfg.parallel.dp_replicate) == ("small", 7, 2)
    assert cfg.train.memory_budget == 300 * 2**20 and cfg.train.lr == pytest.approx(3e-4)
    assert load_config(tmp_path / "run.yaml").train.steps == 6
    # The resolved config written into a run directory reads back to the same config.
    (tmp_path / "resolved.yaml").write_text(cfg.to_yaml())
    assert load_config(tmp_path / "resolved.yaml") == cfg


@pytest.mark.parametrize("override, field, hint", [
    ("train.precision=fp16", "train.precision", "fp32"),
    ("train.stpes=3", "train.stpes", "valid keys: steps"),
    ("train.memory_budget=lots", "train.memory_budget", "MiB"),
    ("train.steps=0", "train.steps", "positive"),
    ("parallel.tp=0", "parallel.tp", "-1"),
    ("data.source=csv", "data.source", "synthetic"),
])
def test_bad_values_name_the_field(override, field, hint):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value) and hint in str(err.value)


def test_bad_override_syntax_and_section():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["steps=3"])
    with pytest.raises(ConfigError, match="valid sections: model, parallel, pipeline, train, data"):
        load_config(None, ["optim.lr=3"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="bad.toml cannot be parsed"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "x.ini").write_text("")
    with pytest.raises(ConfigError, match=".toml, .yaml"):
        load_config(tmp_path / "x.ini")


def test_parallel_dims_resolution():
    assert ParallelDims.resolve(-1, 1, 1, 1, 4).dp_replicate == 4
    assert ParallelDims.resolve(2, -1, 1, 1, 8).dp_shard == 4
    with pytest.raises(ValueError, match=r"1 × 2 × 1 × 1 × 1 = 2, but the world size is 4"):
        ParallelDims.resolve(2, 1, 1, 1, 4)
    with pytest.raises(ValueError, match="at most one degree"):
        ParallelDims.resolve(-1, -1, 1, 1, 4)
    with pytest.raises(ValueError, match="divisors: 1, 2, 3, 6"):
        ParallelDims.resolve(-1, 4, 1, 1, 6)


def test_batch_validation_lists_valid_values():
    with pytest.raises(ConfigError, match="valid global_batch values are multiples of 4: 4, 8"):
        resolve_run(load_config(None, ["parallel.dp_replicate=4", "train.global_batch=10"]), 4)
    with pytest.raises(ConfigError, match="valid micro_batch values: 1, 2, 4"):
        resolve_run(load_config(None, ["parallel.dp_replicate=2", "train.micro_batch=3"]), 2)
    shape = resolve_run(load_config(None, ["parallel.dp_replicate=2", "train.micro_batch=2"]), 2)
    assert (shape.local_batch, shape.micro_batch, shape.accum_steps) == (4, 2, 2)


def test_model_and_data_validation(tmp_path):
    with pytest.raises(ConfigError, match="max_seq_len"):
        resolve_run(load_config(None, ["train.seq_len=100000"]), 1)
    with pytest.raises(ConfigError, match="model.preset.*tiny"):
        load_config(None, ["model.preset=huge"]).model.resolve()
    with pytest.raises(ConfigError, match="n_kv_heads"):
        resolve_run(load_config(None, ["model.n_kv_heads=3"]), 1)
    with pytest.raises(ConfigError, match="data.path is required"):
        resolve_run(load_config(None, ["data.source=tokens"]), 1)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_run(load_config(None, ["data.source=text", f"data.path={tmp_path / 'x.txt'}"]), 1)


@pytest.mark.parametrize("overrides, world, layout", [
    ([], 4, "dp_shard=4"),  # the default: FSDP over every rank
    (["parallel.zero_stage=0"], 4, "dp_replicate=4"),  # DDP replicas take the rest instead
    (["parallel.dp_replicate=2"], 4, "dp_replicate=2 × dp_shard=2"),  # HSDP
    (["parallel.tp=2"], 4, "dp_shard=2 × tp=2"),
    (["parallel.tp=-1"], 2, "tp=2"),  # another degree takes the rest
])
def test_an_unset_dp_shard_takes_the_ranks_the_other_degrees_leave(overrides, world, layout):
    assert resolve_run(load_config(None, overrides), world).dims.describe() == layout


def test_a_set_dp_replicate_under_ddp_is_not_completed_by_an_unset_dp_shard():
    """zero_stage=0 shards nothing: the error names the degrees given, not a dp_shard nobody set."""
    with pytest.raises(ConfigError, match=r"1 × 2 × 1 × 1 × 1 = 2, but the world size is 4"):
        resolve_run(load_config(None, ["parallel.dp_replicate=2", "parallel.zero_stage=0"]), 4)


@pytest.mark.parametrize("override, field, hint", [
    ("train.lr=inf", "train.lr", "finite"),
    ("train.lr=-inf", "train.lr", "finite"),
    ("train.lr=nan", "train.lr", "finite"),
    ("train.timeout_s=inf", "train.timeout_s", "finite"),
    ("train.grad_clip=inf", "train.grad_clip", "finite"),
    ("model.rope_theta=inf", "model.rope_theta", "finite"),
    ("train.steps=12345678901234567890", "train.steps", "at most 1,000,000,000"),
    ("parallel.tp=123456789012345678901", "parallel.tp", "at most 9,007,199,254,740,992"),
])
def test_infinite_and_absurd_values_are_refused(override, field, hint):
    with pytest.raises(ConfigError, match=f"{field}: .*{hint}"):
        load_config(None, [override])


@pytest.mark.parametrize("text, field", [("train:\n  steps: true\n", "train.steps"),
                                         ("train:\n  lr: false\n", "train.lr"),
                                         ("parallel:\n  tp: true\n", "parallel.tp")])
def test_booleans_are_never_read_as_numbers(tmp_path, text, field):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=f"{field}: must be a number, not the boolean"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "ok.yaml").write_text("checkpoint:\n  async_save: true\n")
    assert load_config(tmp_path / "ok.yaml").checkpoint.async_save is True


@pytest.mark.parametrize("name, text, message", [
    ("c.yaml", "train:\n  steps: 5\n  lr: 0.1\n  steps: 7\n", "key 'steps' is given twice (lines 2 and 4)"),
    ("c.yaml", "train:\n  steps: 5\ntrain:\n  lr: 0.1\n", "key 'train' is given twice (lines 1 and 3)"),
    ("c.json", '{"train": {"steps": 5,\n "steps": 7}}', "key 'steps' is given twice in one object (lines 1, 2)"),
    ("c.toml", "[train]\nsteps = 5\nsteps = 7\n", "key 'steps' is given twice (again at line 3)"),
])
def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path / name)
    assert message in str(caught.value) and str(tmp_path / name) in str(caught.value)
