import pytest


@pytest.fixture(params=["numpy", "simt", "cuda"])
def model_backend(request):
    """The backends the model tests run on: the NumPy reference, the simt kernels, and the GPU
    when one works (skipped otherwise)."""
    name = {"numpy": "numpy_backend"}.get(request.param, request.param)
    return request.getfixturevalue(name)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny torch forwards are many times faster on one thread on a shared CPU (a module's peers'
    tests use it: pytestmark = pytest.mark.usefixtures("one_torch_thread"))."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
