"""`import gradcomp` stays light: no native module, Triton, CuPy or CUDA init."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_import_is_light():
    code = (
        "import sys, gradcomp, torch\n"
        "import gradcomp as gc\n"
        "x = gc.Int8Quantizer()\n"
        "bad = [m for m in ('gradcomp._C', 'triton', 'cupy') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_public_names():
    import gradcomp as gc

    for name in ["NoCompression", "FP16", "BF16", "Int8Quantizer", "TopK", "Threshold",
                 "ErrorFeedback", "TrafficMeter", "PayloadError", "decode", "kernels"]:
        assert hasattr(gc, name), name
    assert issubclass(gc.PayloadError, ValueError)


def test_every_exported_name_resolves():
    import gradcomp as gc

    for name in gc.__all__:
        assert getattr(gc, name) is not None, name
        assert name in dir(gc)
    assert gc.Int8Quantizer.__module__.startswith("gradcomp.compressors")
    assert gc.ddp.__name__ == "gradcomp.ddp" and callable(gc.allreduce)
    try:
        gc.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("gc.no_such_name resolved")


def test_dir_of_the_kernels_lists_the_public_api_only():
    import gradcomp as gc

    assert dir(gc.kernels) == sorted(gc.kernels.__all__)
    for name in gc.kernels.__all__:
        assert callable(getattr(gc.kernels, name)), name
