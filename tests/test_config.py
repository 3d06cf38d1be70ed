import time
from pathlib import Path

import pytest
import yaml

from grpo_pipeline.config import SECTIONS, Params, ParamsError, Section, load_params
from grpo_pipeline.iterations import MARKER, rewrite, table

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path, obj) -> Path:
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(obj) if not isinstance(obj, str) else obj)
    return p


def test_repo_params_are_valid():
    p = load_params(ROOT / "params.yaml")
    assert p.iterations and p.evaluations
    assert p.advantage.std == "population"  # the spec's convention is the default


@pytest.mark.parametrize(
    "obj, key",
    [
        ({"sampling": {"group_siz": 4}}, "sampling.group_siz"),
        ({"samplng": {"group_size": 4}}, "samplng"),
        ({"update": {"klestimator": "k3"}}, "update.klestimator"),
        ({"reward": {"custom": [{"name": "x", "function": "m:f", "wieght": 1}]}}, "reward.custom.0.wieght"),
    ],
)
def test_unknown_keys_name_the_key_and_file(tmp_path, obj, key):
    path = write(tmp_path, obj)
    with pytest.raises(ParamsError) as e:
        load_params(path)
    assert key in str(e.value) and str(path) in str(e.value)


def test_typo_suggests_the_right_key(tmp_path):
    with pytest.raises(ParamsError, match="did you mean 'group_size'"):
        load_params(write(tmp_path, {"sampling": {"group_siz": 4}}))


@pytest.mark.parametrize(
    "obj, words",
    [
        ({"sampling": {"group_size": 1}}, ["sampling.group_size", "greater than or equal to 2"]),
        ({"update": {"epsilon": 1.5}}, ["update.epsilon", "less than 1"]),
        ({"advantage": {"std": "unbiased"}}, ["advantage.std", "population"]),
        ({"update": {"minibatch_size": 10, "micro_batch_size": 4}}, ["multiple"]),
        ({"reward": {"weights": {"acuracy": 1.0}}}, ["reward.weights", "acuracy", "registered", "tests"]),
        ({"update": {"kl_estimator": "k4"}}, ["update.kl_estimator", "k3"]),
        ({"data": {"source": "file"}}, ["data.path"]),
        ({"data": {"coding_kinds": ["nope"]}}, ["data.coding_kinds", "nope"]),
    ],
)
def test_bad_values_name_the_range(tmp_path, obj, words):
    with pytest.raises(ParamsError) as e:
        load_params(write(tmp_path, obj), sections=list(obj))
    for w in words:
        assert w in str(e.value)


def test_micro_batch_may_exceed_the_minibatch(tmp_path):
    """``-S update.minibatch_size=8`` with the default micro-batch of 16: one forward/backward of 8 rows per
    optimizer step, not an error (the split into micro-batches is what must divide evenly)."""
    cfg = load_params(write(tmp_path, {"update": {"minibatch_size": 8}}), sections=["update"]).update
    assert (cfg.minibatch_size, cfg.micro_batch_size) == (8, 16)
    with pytest.raises(ParamsError, match="multiple"):
        load_params(write(tmp_path, {"update": {"minibatch_size": 24}}), sections=["update"])


def _walk(model: type[Section], raw: dict, where: str) -> list[str]:
    """Differences between a params.yaml section and the schema's defaults, recursing into sub-sections."""
    diffs = [f"{where}.{k}: in the file, not in the schema" for k in raw if k not in model.model_fields]
    for name, field in model.model_fields.items():
        key = f"{where}.{name}"
        if name not in raw:
            diffs.append(f"{key}: missing from params.yaml (schema default {field.default!r})")
        elif isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            diffs += _walk(field.annotation, raw[name], key)
        elif raw[name] != model().model_dump()[name]:
            diffs.append(f"{key}: params.yaml {raw[name]!r} != config.py default {model().model_dump()[name]!r}")
    return diffs


def test_params_file_and_schema_defaults_agree_key_for_key():
    """One home for every default: params.yaml holds every key the stages read, each with the schema's default."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    diffs = [f"{s}: section missing" for s in SECTIONS if s not in raw]
    for section, field in Params.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section) and section in raw:
            diffs += _walk(field.annotation, raw[section], section)
    assert not diffs, "\n".join(diffs)
    assert Params.model_validate(raw).model_dump(exclude={"iterations", "evaluations"}) == \
        Params().model_dump(exclude={"iterations", "evaluations"})


def test_a_newly_registered_name_is_accepted(tmp_path, monkeypatch):
    from grpo_pipeline import advantages, losses

    path = write(tmp_path, {"advantage": {"estimator": "mine"}, "update": {"aggregation": "my_agg"}})
    with pytest.raises(ParamsError, match=r"advantage.estimator: unknown name\(s\) \['mine'\]; registered: \['grpo'"):
        load_params(path, sections=["advantage"])
    monkeypatch.setitem(advantages.ESTIMATORS, "mine", advantages.ESTIMATORS["grpo"])
    monkeypatch.setitem(losses.AGGREGATIONS, "my_agg", losses.AGGREGATIONS["token_mean"])
    assert load_params(path, sections=["advantage", "update"]).advantage.estimator == "mine"
    load_params(path)  # sections not read are not checked (a stage imports only its own registries)


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(write(tmp_path, "a: [1,\n"))
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml")


def test_typo_fails_fast_through_the_stage_script(tmp_path):
    import subprocess
    import sys

    path = write(tmp_path, {"sampling": {"temprature": 1.0}})
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(ROOT / "stages/sample.py"), "--params", str(path), "--iteration", "it0",
                        "--index", "0", "--policy", "x", "--prompts", "x", "--out", "x"], capture_output=True, text=True, check=False)
    assert r.returncode != 0 and "sampling.temprature" in r.stderr
    assert time.perf_counter() - t0 < 5


def test_iterations_table_chains_checkpoints(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("update:\n  lr: 1.0e-6  # keep me\n")
    rewrite(path, 3, eval_every=2)
    text = path.read_text()
    assert "# keep me" in text and text.count(MARKER) == 1
    p = load_params(path)
    assert list(p.iterations) == ["it0", "it1", "it2"]
    assert [i.policy for i in p.iterations.values()] == ["models/sft", "models/it1", "models/it2"]
    assert [i.next for i in p.iterations.values()] == ["models/it1", "models/it2", "models/it3"]
    assert list(p.evaluations) == ["base", "sft", "it1", "it2"]  # every 2nd, and always the last
    rewrite(path, 1)
    assert list(load_params(path).iterations) == ["it0"] and path.read_text().count(MARKER) == 1


def test_broken_chain_is_an_error(tmp_path):
    text = table(2).replace("policy: models/it1", "policy: models/it9")
    with pytest.raises(ParamsError, match="grpo-pipeline iterations"):
        load_params(write(tmp_path, text))


VARIANT_KEYS = ["loss", "cispo_epsilon_high", "importance_sampling_level", "sequence_epsilon", "sequence_epsilon_high",
                "rollout_correction", "rollout_correction_level", "rollout_correction_cap", "lora"]


def test_variant_options_are_in_params_yaml_with_the_config_default():
    from grpo_pipeline.config import UpdateConfig

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())["update"]
    defaults = UpdateConfig().model_dump()
    for key in VARIANT_KEYS:
        assert key in raw, f"params.yaml lacks update.{key}"
        assert raw[key] == defaults[key], key
    assert defaults["lora"]["rank"] == 16 and UpdateConfig(lora=None).lora is None  # LoRA by default, null: full FT


@pytest.mark.parametrize(("update", "match"), [
    ({"lora": {"rank": 0}}, "update.lora.rank"),
    ({"lora": {"rank": 4, "target_module": ["q_proj"]}}, "unknown key 'update.lora.target_module'"),
    ({"lora": {"rank": 4}, "distributed": {"strategy": "fsdp"}}, "not supported with update.distributed.strategy fsdp"),
    ({"distributed": {"strategy": "fsdp"}}, "set update.lora: null"),   # LoRA is on by default
    ({"rollout_correction": "is"}, r"update.rollout_correction: unknown name\(s\) \[.is.\]"),
    ({"rollout_correction_cap": 1.0}, "update.rollout_correction_cap"),
])
def test_variant_option_errors(tmp_path, update, match):
    with pytest.raises(ParamsError, match=match):
        load_params(write(tmp_path, {"update": update}), sections=("update",))
