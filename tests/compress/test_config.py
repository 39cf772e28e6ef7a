import pytest

from compress.config import QuantizeConfig, list_recipes, load_recipe


def test_awq_rounding_by_gptq_takes_the_gptq_fields():
    cfg = QuantizeConfig(method="awq", rounding="gptq", act_order=True, static_groups=True, mse=True)
    assert cfg.rounding == "gptq" and cfg.act_order


@pytest.mark.parametrize("bad, match", [
    (dict(method="awq", rounding="nearest"), "rounding='nearest' is unknown"),
    (dict(method="gptq", rounding="gptq"), "applies to method awq only"),
    (dict(method="awq", act_order=True), "applies to method gptq"),
    (dict(method="rtn", mse=True), "applies to method gptq"),
    (dict(method="gptq", rotate="spin"), "rotate='spin' is unknown; use one of"),
    (dict(method="rtn", weighted_range=True), "weighted_range needs calibration statistics"),
    (dict(method="gptq", mse=True, weighted_range=True), "weighted_range and mse both pick gptq's grid"),
])
def test_bad_fields_name_the_value(bad, match):
    with pytest.raises(ValueError, match=match):
        QuantizeConfig(**bad)


def test_every_shipped_recipe_loads():
    for name in list_recipes():
        assert load_recipe(name).method
