"""``ops.common.meta_call``: torch's own checks and output shapes on the meta
device, cached per signature. A repeated call is a cache hit and gives torch's
answer; arguments that only look alike (``2`` and ``2.0``, ``False`` and ``0``,
a list and a tuple) do not share an entry; errors are raised on every call; a
tensor with values or an unhashable argument is passed through uncached.
Serial: the helper is local."""
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import domainpar as dp
from domainpar.ops import common


@pytest.fixture(autouse=True)
def _empty_cache():
    common._meta_cached.cache_clear()
    yield
    common._meta_cached.cache_clear()


def _meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_a_repeated_call_hits_and_matches_torch():
    x = _meta(1, 4, 3, 5, 6)
    want = F.interpolate(x, size=(6, 10, 12), mode="trilinear", align_corners=False)
    first = common.meta_call(F.interpolate, x, size=(6, 10, 12), mode="trilinear",
                             align_corners=False)
    again = common.meta_call(F.interpolate, _meta(1, 4, 3, 5, 6), size=(6, 10, 12),
                             mode="trilinear", align_corners=False)
    info = common._meta_cached.cache_info()
    assert (info.hits, info.misses) == (1, 1)
    assert first.shape == again.shape == want.shape and first.dtype == want.dtype
    other = common.meta_call(F.interpolate, _meta(1, 4, 3, 5, 6, dtype=torch.float64),
                             size=(6, 10, 12), mode="trilinear", align_corners=False)
    assert other.dtype == torch.float64 and common._meta_cached.cache_info().misses == 2


def test_look_alike_arguments_do_not_share_an_entry():
    def kinds(*args, **kwargs):
        return [type(a).__name__ for a in args] + [f"{k}={type(v).__name__}"
                                                   for k, v in kwargs.items()]
    assert common.meta_call(kinds, 2, flag=False) == ["int", "flag=bool"]
    assert common.meta_call(kinds, 2.0, flag=0) == ["float", "flag=int"]
    assert common.meta_call(kinds, [1, 2]) == ["list"]
    assert common.meta_call(kinds, (1, 2)) == ["tuple"]
    assert common._meta_cached.cache_info().misses == 4


def test_errors_are_raised_on_every_call():
    for _ in range(2):
        with pytest.raises(ValueError, match="spatial dimensions"):
            common.meta_call(F.interpolate, _meta(1, 4, 5), size=(3, 3), mode="linear")
    assert common._meta_cached.cache_info().currsize == 0


def test_values_and_unhashable_arguments_pass_through_uncached():
    seen = []

    def record(*args, **kwargs):
        seen.append((args, kwargs))
        return len(seen)
    real = torch.ones(2)
    assert common.meta_call(record, real) == 1 and seen[0][0][0] is real
    assert common.meta_call(record, _meta(2), extra={"a": 1}) == 2
    assert common.meta_call(record, _meta(2), extra={"a": 1}) == 3
    assert common._meta_cached.cache_info().currsize == 0


def test_the_interpolate_rule_asks_torch_once_per_signature():
    grid = dp.ProcessGrid((1,), comm=MPI.COMM_SELF)
    x = dp.DomainTensor(torch.randn(1, 2, 4, 5), dp.Decomposition((1, 2, 4, 5), grid, {2: 0}))
    for _ in range(3):
        y = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    info = common._meta_cached.cache_info()
    assert (info.hits, info.misses) == (2, 1)
    torch.testing.assert_close(y.full_tensor(), F.interpolate(
        x._local, scale_factor=2, mode="bilinear", align_corners=False))
