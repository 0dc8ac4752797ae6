"""The reference transform's errors say which path, which module and what was expected."""

import pytest
from torch import nn

from tpdp_verify.impls import transform


def model():
    return nn.Sequential(nn.Linear(2, 2), nn.ModuleDict({"head": nn.Linear(2, 1)}))


def test_a_path_resolves_to_its_owner_at_depth():
    m = model()
    owner, attr = transform.get_submodule_n_params(m, "1.head.bias")
    assert owner is m[1]["head"] and attr == "bias"


@pytest.mark.parametrize(
    "path, message",
    [("1.tail.weight", "parameter '1.tail.weight': ModuleDict has no attribute `tail`"),
     ("0.scale", "parameter '0.scale': Linear at '0' has no parameter 'scale' (it has weight, bias)"),
     ("weight", "parameter 'weight': Sequential at '<root>' has no parameter 'weight' (it has none)")],
)
def test_a_bad_path_names_the_path_the_module_and_what_it_has(path, message):
    with pytest.raises(LookupError) as info:
        transform.get_submodule_n_params(model(), path)
    assert str(info.value) == message


def test_replacing_a_slot_that_is_not_a_parameter_is_refused():
    m = model()
    with pytest.raises(LookupError, match="Linear has no parameter 'scale' to replace"):
        transform.update_module_param([(m[0], "scale", nn.Parameter(m[0].weight.detach()))])


def test_replacement_keeps_the_order():
    m = model()
    transform.update_module_param([(m[0], "weight", nn.Parameter(m[0].weight.detach().clone()))])
    assert [n for n, _ in m.named_parameters()] == ["0.weight", "0.bias", "1.head.weight", "1.head.bias"]
