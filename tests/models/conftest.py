import pytest


@pytest.fixture(params=["numpy", "simt", "cuda"])
def model_backend(request):
    """The backends the model tests run on: the NumPy reference, the simt kernels, and the GPU
    when one works (skipped otherwise)."""
    name = {"numpy": "numpy_backend"}.get(request.param, request.param)
    return request.getfixturevalue(name)
