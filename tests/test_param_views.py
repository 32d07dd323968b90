"""Views of a parameter, checked and reduced as the parameter (``tensor/params.py``):
which tensors count as one, and the parameter's gradient from a view's, against
torch's own backward of the view (slices, strides, permutes, reshapes, and views
that address an element more than once: expand, unfold)."""
import pytest
import torch

from domainpar.tensor.params import _overlapping, parameter_view_of, view_gradient

VIEWS = {
    "slice": lambda w: w[..., 1:4],
    "strided": lambda w: w[:, ::2].transpose(0, 1),
    "row": lambda w: w[1:2, :, 3],
    "permute": lambda w: w.permute(2, 0, 1),
    "reshape": lambda w: w.view(12, 5),
    "expand": lambda w: w[0].expand(2, 4, 5),
    "unfold": lambda w: w.unfold(2, 3, 1),
}


@pytest.mark.parametrize("name", sorted(VIEWS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_the_gradient_of_a_view_lands_where_its_elements_lie(name, dtype):
    w = torch.nn.Parameter(torch.randn(3, 4, 5, dtype=dtype))
    v = VIEWS[name](w)
    assert parameter_view_of(v) is w
    assert _overlapping(v.shape, v.stride()) == (name in ("expand", "unfold"))
    g = torch.randn(v.shape, dtype=dtype)
    expected, = torch.autograd.grad(v, w, g)
    assert torch.equal(view_gradient(v.detach(), w, g), expected)


def test_what_is_not_a_view_of_a_parameter():
    w = torch.nn.Parameter(torch.randn(3, 4))
    assert parameter_view_of(w) is None                      # the parameter itself
    assert parameter_view_of(w.detach()[1:]) is None         # a view of a plain tensor
    assert parameter_view_of(w[1:].double()) is None         # a copy in another dtype
    assert parameter_view_of(torch.randn(3, 4)[1:]) is None
    c = torch.nn.Parameter(torch.randn(3, 2))
    assert parameter_view_of(torch.view_as_complex(c)) is None  # complex_view_of's case
    t = torch.nn.Parameter(torch.randn(4, 3).t())               # a non-contiguous parameter
    assert parameter_view_of(t[1:]) is None
