import pytest

from compress.config import FIELDS, GPTQOptions, QuantizeConfig, list_recipes, load_recipe


def test_awq_rounding_by_gptq_takes_the_gptq_fields():
    cfg = QuantizeConfig.from_flat(method="awq", rounding="gptq", act_order=True, static_groups=True, mse=True)
    assert cfg.awq.rounding == "gptq" and cfg.gptq.act_order and cfg.gptq_rounding


@pytest.mark.parametrize("bad, match", [
    (dict(method="awq", rounding="nearest"), "rounding='nearest' is unknown"),
    (dict(method="gptq", rounding="gptq"), "applies to method awq only"),
    (dict(method="awq", act_order=True), "applies to method gptq"),
    (dict(method="rtn", mse=True), "applies to method gptq"),
    (dict(method="gptq", rotate="spin"), "rotate='spin' is unknown; use one of"),
    (dict(method="rtn", weighted_range=True), "weighted_range needs calibration statistics"),
    (dict(method="gptq", mse=True, weighted_range=True), "weighted_range and mse both pick gptq's grid"),
    (dict(method="qat", weighted_range=True), "applies to qat's AWQ or GPTQ init only"),
    (dict(method="qat", init="gptq", cd_passes=2), "starts from the weights before rounding"),
    (dict(method="awq", cd_passes=2), "cd_passes applies to method gptq"),
])
def test_bad_fields_name_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        QuantizeConfig.from_flat(**bad)


def test_every_shipped_recipe_loads():
    for name in list_recipes():
        assert load_recipe(name).method


@pytest.mark.parametrize("name", sorted(list_recipes()))
def test_a_recipe_is_flat_and_round_trips_through_the_groups(name):
    cfg = load_recipe(name)
    flat = cfg.to_dict()
    assert set(flat) == FIELDS and QuantizeConfig.from_flat(**flat) == cfg
    assert cfg.replace(damp=0.2, grid=7).gptq.damp == 0.2 and cfg.replace(grid=7).awq.grid == 7


def test_groups_hold_their_fields_and_unknown_names_are_errors():
    cfg = QuantizeConfig.from_flat(method="gptq", damp=0.05, act_order=True, search_tokens=64, steps=3)
    assert cfg.gptq == GPTQOptions(damp=0.05, act_order=True) and cfg.awq.search_tokens == 64 and cfg.qat.steps == 3
    with pytest.raises(ValueError, match="unknown field.*'dampening'"):
        QuantizeConfig.from_flat(method="gptq", dampening=0.05)
    with pytest.raises(ValueError, match="unknown field"):
        load_recipe("gptq4").replace(dampening=0.05)
    with pytest.raises(ValueError, match="damp=1.5 must be in"):
        load_recipe("gptq4").replace(damp=1.5)


def test_unknown_recipe_key_is_an_error(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("method: gptq\nbits: 4\ndampening: 0.1\n")
    with pytest.raises(ValueError, match="unknown key"):
        load_recipe(str(p))


def test_recipe_floats_written_without_a_dot_load_as_numbers(tmp_path):
    p = tmp_path / "r.yaml"  # YAML 1.1 reads 2e-4 as the string '2e-4'
    p.write_text("method: qat\nlr: 2e-4\nscale_lr: 0\nlearn_zero: true\n")
    cfg = load_recipe(str(p))
    assert cfg.qat.lr == 2e-4 and cfg.qat.scale_lr == 0.0 and type(cfg.qat.scale_lr) is float and cfg.qat.learn_zero is True


@pytest.mark.parametrize("line,msg", [
    ("bits: four", "bits: 'four' is str, expected int"),
    ("sym: 1", "sym: 1 is int, expected bool"),
    ("bits: true", "bits: True is bool, expected int"),
    ("lr: fast", "lr: 'fast' is str, expected float"),
])
def test_recipe_value_of_the_wrong_type_is_a_clear_error(tmp_path, line, msg):
    p = tmp_path / "r.yaml"
    p.write_text(f"method: qat\n{line}\n")
    with pytest.raises(ValueError, match=msg):
        load_recipe(str(p))
