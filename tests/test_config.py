"""fedmask_app.run.config: pyproject defaults, overrides, and a ConfigError naming key and value."""

from __future__ import annotations

import re

import pytest

from fedmask_app.run.config import (
    PROJECT_ROOT,
    ConfigError,
    RunConfig,
    load_run_config,
    parse_overrides,
    pyproject_defaults,
    run_config_from_values,
    toml_value,
)
from fedmask_app.sweep.grid import load_grid


@pytest.fixture(autouse=True)
def _data_dir(tmp_path, monkeypatch):
    """An empty, writable data dir, so the default data-dir does not depend on this machine."""
    monkeypatch.setenv("FEDMASK_DATA_DIR", str(tmp_path / "data"))


def test_defaults_are_the_paper_protocol():
    cfg = load_run_config([])
    assert cfg.num_clients == 100
    assert cfg.clients_per_round == 10
    assert cfg.num_rounds == 200
    assert cfg.lr == 0.01
    assert cfg.momentum == 0.0 and cfg.weight_decay == 0.0  # plain SGD (PAPER.md's project choice)
    assert cfg.batch_size == 32
    assert cfg.local_epochs == 2
    assert cfg.alpha == 100.0
    assert cfg.mask_mode == "none"
    assert cfg.aggregation == "weighted"
    assert cfg.seed == 0
    assert cfg.min_partition_size == 10
    assert cfg.identical_shards is False
    assert cfg.model == "resnet18-gn"
    assert load_run_config(None) == cfg


def test_defaults_come_from_pyproject():
    defaults = pyproject_defaults()
    cfg = load_run_config([])
    assert cfg.to_mapping() == defaults
    assert RunConfig.from_mapping(defaults) == cfg


def test_key_value_overrides():
    cfg = load_run_config(["num-rounds=5 alpha=0.1", "mask-mode='independent'", "keep-prob=0.25", "lr=1"])
    assert cfg.num_rounds == 5
    assert cfg.alpha == 0.1
    assert cfg.mask_mode == "independent"
    assert cfg.keep_prob == 0.25
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)  # an integer for a float key is fine
    assert cfg.num_clients == 100  # untouched


def test_toml_file_overrides_then_pairs_in_order(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('num-clients = 20\nclients-per-round = 4\nbatch-size = "full"\nlocal-epochs = 5\n')
    cfg = load_run_config([str(path)])
    assert (cfg.num_clients, cfg.clients_per_round, cfg.batch_size, cfg.local_epochs) == (20, 4, None, 5)
    later = load_run_config([str(path), "local-epochs=1"])
    assert later.local_epochs == 1


def test_missing_toml_file_raises(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_run_config([str(tmp_path / "nope.toml")])


def test_full_batch():
    cfg = load_run_config(['batch-size="full"'])
    assert cfg.batch_size is None
    assert cfg.to_mapping()["batch-size"] == "full"
    assert RunConfig.from_mapping(cfg.to_mapping()) == cfg
    assert "bsfull" in cfg.name


def test_name_describes_the_run():
    cfg = load_run_config(["mask-mode='synchronized'", "keep-prob=0.5", "alpha=1"])
    assert cfg.name == "resnet18-gn_a1_bs32_tau2_synchronized_p0.5_seed0"
    assert load_run_config(["run-name='mine'"]).name == "mine"


def test_not_a_pair_raises():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["justaword"])


def test_unparseable_value_names_the_key():
    with pytest.raises(ConfigError, match="mask-mode"):
        parse_overrides(["mask-mode=independent"])  # a TOML string needs quotes


BAD = [
    # (override, key, the bad value as the message shows it)
    ("keep-prob=0", "keep-prob", "0.0"),
    ("keep-prob=1.5", "keep-prob", "1.5"),
    ("keep-prob=-0.5", "keep-prob", "-0.5"),
    ("batch-size=0", "batch-size", "0"),
    ("batch-size=-3", "batch-size", "-3"),
    ("batch-size='big'", "batch-size", "'big'"),
    ("batch-size=2.5", "batch-size", "2.5"),
    ("clients-per-round=101", "clients-per-round", "101"),
    ("clients-per-round=0", "clients-per-round", "0"),
    ("alpha=0", "alpha", "0.0"),
    ("alpha=-1", "alpha", "-1.0"),
    ("local-epochs=0", "local-epochs", "0"),
    ("mask-mode='sometimes'", "mask-mode", "'sometimes'"),
    ("aggregation='median'", "aggregation", "'median'"),
    ("num-rounds='ten'", "num-rounds", "'ten'"),
    ("num-rounds=2.0", "num-rounds", "2.0"),
    ("num-rounds=true", "num-rounds", "True"),
    ("lr='fast'", "lr", "'fast'"),
    ("lr=0", "lr", "0.0"),
    ("identical-shards=1", "identical-shards", "1"),
    ("num-clients=0", "num-clients", "0"),
    ("min-clients=11", "min-clients", "11"),
    ("min-partition-size=0", "min-partition-size", "0"),
    ("model='resnet50'", "model", "'resnet50'"),
    ("device='tpu'", "device", "'tpu'"),
    ("test-subset=10001", "test-subset", "10001"),
    ("round-timeout=0", "round-timeout", "0.0"),
    ("run-name='a/b'", "run-name", "'a/b'"),
    ("inject-fault='explode:1:2'", "inject-fault", "'explode:1:2'"),
    ("seed=-1", "seed", "-1"),
    ("cuda-graphs=true device='cpu'", "cuda-graphs", "True"),
    ("client-processes=-1", "client-processes", "-1"),
    ("client-processes=2 vectorize=true", "client-processes", "2"),
    ("client-processes=0 device='cuda'", "client-processes", "0"),
    ("momentum=1", "momentum", "1.0"),
    ("momentum=-0.1", "momentum", "-0.1"),
    ("weight-decay=-1", "weight-decay", "-1.0"),
    ("weight-decay=inf", "weight-decay", "inf"),
    ("momentum=0.9 cuda-graphs=true device='cuda'", "momentum", "0.9"),
    ("momentum=0.9 client-streams=2 device='cuda'", "momentum", "0.9"),
]


@pytest.mark.parametrize(("override", "key", "shown"), BAD, ids=[b[0] for b in BAD])
def test_bad_value_names_key_and_value(override, key, shown):
    with pytest.raises(ConfigError) as info:
        load_run_config(override.split(" "))
    message = str(info.value)
    assert re.search(rf"\b{re.escape(key)} = {re.escape(shown)}", message), message


def test_bad_value_in_a_toml_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("keep-prob = 1.5\n")
    with pytest.raises(ConfigError, match=r"keep-prob = 1\.5"):
        load_run_config([str(path)])


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown run-config key\(s\) learning-rate"):
        load_run_config(["learning-rate=0.1"])
    values = {**pyproject_defaults(), "learning-rate": 0.1}
    with pytest.raises(ConfigError, match="learning-rate"):
        RunConfig.from_mapping(values)


def test_missing_key_is_named():
    values = pyproject_defaults()
    del values["keep-prob"]
    with pytest.raises(ConfigError, match="missing keep-prob"):
        RunConfig.from_mapping(values)


def test_data_dir_with_the_file_is_accepted(tmp_path):
    data_dir = tmp_path / "has"
    data_dir.mkdir()
    (data_dir / "cifar10.npz").write_bytes(b"")
    assert load_run_config([f"data-dir='{data_dir}'"]).data_dir == str(data_dir)


def test_data_dir_that_can_be_created_is_accepted(tmp_path):
    # Missing folders are fine when the nearest existing parent is a writable folder.
    load_run_config([f"data-dir='{tmp_path / 'new' / 'deeper'}'"])


def test_data_dir_that_can_never_hold_the_file_raises(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    bad = blocker / "sub"
    with pytest.raises(ConfigError) as info:
        load_run_config([f"data-dir='{bad}'"])
    message = str(info.value)
    assert "data-dir" in message and str(bad) in message
    with pytest.raises(ConfigError, match="data-dir"):
        load_run_config([f"data-dir='{blocker}'"])  # a file, not a folder


def test_the_readme_table_lists_every_key_with_its_default():
    """README's "Run configuration" table: one row per key of [tool.flwr.app.config], its default as TOML writes it."""
    readme = (PROJECT_ROOT / "README.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9-]+)` \| ([^|]+?) \|", readme, flags=re.MULTILINE))
    for key, value in pyproject_defaults().items():
        shown = f"`{toml_value(value)}`" if isinstance(value, str) else toml_value(value)
        assert rows.get(key) == shown, f"README's table: {key} is {rows.get(key)!r}, pyproject.toml says {shown!r}"


@pytest.mark.parametrize(
    "grid", sorted(p.relative_to(PROJECT_ROOT).as_posix() for p in (PROJECT_ROOT / "conf").rglob("*.toml")
                   if p.name != "quick.toml")
)
def test_every_committed_grid_file_gives_valid_run_configs(grid):
    """The README's sweep commands read these files: each run in them must pass validation, as
    fedmask-sweep would check it at start (a typo in a grid otherwise shows only when it runs)."""
    runs = load_grid(PROJECT_ROOT / grid)
    assert runs
    for run in runs:
        cfg = run_config_from_values(run.overrides)
        assert cfg.run_name == run.name
