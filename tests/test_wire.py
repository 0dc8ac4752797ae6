"""A rank's answer crosses the pipe with its tensors as their storages' bytes
(tpdp_verify.ranks.wire): loaded by plain pickle, every tensor has the values, dtype, shape,
stride and offset it had, tensors that shared a storage still share one, and what the format
does not take goes as pickle sends it."""

import pickle

import pytest
import torch

from tpdp_verify.ranks import wire

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int64, torch.int8,
          torch.uint8, torch.bool]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset() and a.requires_grad == b.requires_grad
            and torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a,
                            b.view(torch.uint8) if b.dtype == torch.bool else b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_tensor_comes_back_with_its_values_and_layout(dtype):
    whole = (torch.randn(6, 4) * 10).to(dtype)
    views = {"whole": whole, "transposed": whole.t(), "rows": whole[2:5], "strided": whole[::2, 1::2],
             "element": whole[3, 1], "empty": whole[:0], "scalar": torch.tensor(7).to(dtype)}
    back = pickle.loads(wire.dumps(views))
    assert {k: _same(v, back[k]) for k, v in views.items()} == dict.fromkeys(views, True)


def test_tensors_that_shared_a_storage_share_one_and_its_bytes_go_once():
    base = torch.arange(1000.0)
    out = {"a": base[:10], "b": base[500:], "c": base.view(10, 100)}
    data = wire.dumps(out)
    assert len(data) < 2 * base.nbytes  # the storage once, not three times
    back = pickle.loads(data)
    assert back["a"].untyped_storage().data_ptr() == back["c"].untyped_storage().data_ptr()
    back["c"][0, 0] = -1.0
    assert back["a"][0] == -1.0 and _same(out["b"], back["b"])


def test_what_the_format_does_not_take_goes_as_pickle_sends_it():
    leaf = torch.ones(3, requires_grad=True)
    param = torch.nn.Parameter(torch.ones(2))
    sparse = torch.eye(3).to_sparse()
    back = pickle.loads(wire.dumps([leaf, param, sparse, torch.tensor([1 + 2j]).conj()]))
    assert back[0].requires_grad and torch.equal(back[0].detach(), leaf.detach())
    assert type(back[1]) is torch.nn.Parameter
    assert torch.equal(back[2].to_dense(), torch.eye(3)) and back[3].item() == 1 - 2j


def test_an_observation_sized_answer_comes_back_whole_and_smaller():
    """Hundreds of small tensors, as a training step's observation holds (their speed:
    bench/bench_wire.py)."""
    obs = {f"p{i}:{k}": (torch.randn(8, 4), torch.arange(32).view(8, 4)) for i in range(20) for k in range(6)}
    ours = wire.dumps(obs)
    assert len(ours) < len(pickle.dumps(obs))
    back = pickle.loads(ours)
    assert {k: all(_same(a, b) for a, b in zip(v, back[k])) for k, v in obs.items()} == dict.fromkeys(obs, True)
