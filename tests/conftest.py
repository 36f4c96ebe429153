import os

import pytest

# Triton reads this when kernels are decorated: without a GPU, run them in the interpreter.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_src(tmp_path_factory):
    """A tiny synthetic BF16 checkpoint (all 48 layers, 4 experts), built once per session.
    Tests must not modify it: copy it first."""
    from inkling_quant.synth import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("src") / "tiny", "tiny", seed=0)
