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


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """case (tests.models.fp8_models) -> its FP8 directory, built (transformers) and quantized (the
    recipe) once a module."""
    from tests.models.fp8_models import build_fp8
    made = {}

    def get(case):
        if case.name not in made:
            made[case.name] = tmp_path_factory.mktemp(case.name)
            build_fp8(case, made[case.name])
        return made[case.name]
    return get
