import pytest


@pytest.fixture(params=["numpy", "simt"])
def model_backend(request):
    """The backends the model tests run on: the NumPy reference and the simt kernels."""
    name = {"numpy": "numpy_backend"}.get(request.param, request.param)
    return request.getfixturevalue(name)
