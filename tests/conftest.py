import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; it
# must be chosen before Triton is first imported by any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    """Tests choose backends explicitly; a GRADCOMP_BACKEND in the caller's
    environment must not leak into them."""
    monkeypatch.delenv("GRADCOMP_BACKEND", raising=False)


@pytest.fixture(autouse=True, scope="session")
def _private_profile_cache(tmp_path_factory):
    """``gradcomp plan`` caches this machine's measured profile in the user's cache directory;
    tests keep theirs in a directory of their own (one measurement per session at most)."""
    os.environ["GRADCOMP_CACHE_DIR"] = str(tmp_path_factory.mktemp("gradcomp-cache"))
    yield
    os.environ.pop("GRADCOMP_CACHE_DIR", None)
