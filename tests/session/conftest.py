from tests.models.conftest import model_backend  # noqa: F401  (the same backends as the model tests)
