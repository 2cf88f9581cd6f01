import pytest
from threadpoolctl import threadpool_limits

from tests.models.conftest import model_backend  # noqa: F401  (the same backends as the model tests)


@pytest.fixture(autouse=True)
def one_blas_thread():
    """The session tests' GEMMs are a few rows wide: one BLAS thread is faster, and two cores
    shared by several test processes are not oversubscribed."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield
