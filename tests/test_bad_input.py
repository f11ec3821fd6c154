"""Hostile and careless input to the public API: clear TypeError / ValueError
naming the argument, never another exception, a silent fix-up or corruption.

Single process only (the argument checks run before any communication); the
wire format's own hostile-bytes tests live in test_wire.py.
"""

from __future__ import annotations

import pytest
import torch

import gradcomp as gc
from gradcomp import kernels as K


# ---------------------------------------------------------------- compressors
ALL = [gc.NoCompression, gc.FP16, gc.BF16, gc.Int8Quantizer, lambda: gc.TopK(k=2),
       lambda: gc.Threshold(0.5), lambda: gc.ErrorFeedback(gc.TopK(k=2))]


@pytest.mark.parametrize("make", ALL)
@pytest.mark.parametrize("t", [
    torch.randn(3, 3).to_sparse(),
    torch.nested.nested_tensor([torch.randn(2), torch.randn(3)], layout=torch.jagged),
])
def test_non_strided_tensors_are_type_errors(make, t):
    with pytest.raises(TypeError, match="t must be a dense"):
        make().compress(t)


@pytest.mark.parametrize("make", ALL)
def test_meta_tensor_is_a_value_error(make):
    with pytest.raises(ValueError, match="t must hold data"):
        make().compress(torch.empty(10, device="meta"))


@pytest.mark.parametrize("make", ALL)
def test_requires_grad_input_leaves_no_autograd_graph(make):
    x = torch.randn(100, requires_grad=True)
    c = make()
    p = c.compress(x)
    y = c.decompress(p)
    assert not y.requires_grad and y.grad_fn is None
    for t in (p.data, p.scales, p.codes, p.indices):
        assert t is None or not t.requires_grad
    if isinstance(c, gc.ErrorFeedback):
        c.compress(x * 2)  # a second step must not chain onto the first one's graph
        assert not c.residual(None).requires_grad


@pytest.mark.parametrize("make", [gc.Int8Quantizer, lambda **kw: gc.TopK(k=1, **kw),
                                  lambda **kw: gc.Threshold(0.1, **kw)])
@pytest.mark.parametrize("backend", ["bogus", "CPU", 5, ["cpu"]])
def test_unknown_backend_rejected_at_construction(make, backend):
    with pytest.raises(ValueError, match="backend must be None or one of"):
        make(backend=backend)


def test_decompress_add_names_non_contiguous_acc():
    p = gc.FP16().compress(torch.randn(10))
    with pytest.raises(ValueError, match="non-contiguous"):
        gc.FP16().decompress_add_(p, torch.zeros(20)[::2])


# ---------------------------------------------------------------- error feedback state
def test_ef_load_state_dict_flattens_shaped_residuals():
    """A residual shaped like its tensor (same numel) used to broadcast against
    the flat input: a (6, 1) residual made a 36-element "tensor" and a
    Threshold payload with indices past numel."""
    for inner in (gc.Threshold(0.1), gc.TopK(k=2), gc.FP16(), gc.Int8Quantizer(block_size=32)):
        ef = gc.ErrorFeedback(inner)
        ef.load_state_dict({"residuals": {"a": torch.ones(6, 1)}})
        p = ef.compress(torch.zeros(6), key="a")
        assert ef.residual("a").shape == (6,)
        q = gc.decode(p.wire)  # a well-formed payload of 6 elements
        assert q.shape == (6,)
        torch.testing.assert_close(ef.decompress(q) + ef.residual("a"), torch.ones(6))


@pytest.mark.parametrize("state, exc, words", [
    (None, TypeError, "state must be a mapping"),
    ({}, TypeError, "state\\['residuals'\\] must be a mapping"),
    ({"residuals": [1, 2]}, TypeError, "state\\['residuals'\\] must be a mapping"),
    ({"residuals": {"a": 3}}, TypeError, "must be a floating tensor"),
    ({"residuals": {"a": torch.arange(3)}}, TypeError, "must be a floating tensor"),
    ({"residuals": {"a": torch.zeros(3, dtype=torch.complex64)}}, TypeError, "must be a floating tensor"),
    ({"residuals": {"a": torch.tensor([1.0, float("nan")])}}, ValueError, "NaN or Inf"),
    # a meta tensor failed inside the finite check (RuntimeError: Tensor.item() on meta)
    ({"residuals": {"a": torch.zeros(3, device="meta")}}, TypeError,
     "state\\['residuals'\\]\\['a'\\] must be a floating tensor holding data, got a meta torch.float32"),
    # finite in float64, Inf once stored as the float32 residual
    ({"residuals": {"a": torch.tensor([1e300], dtype=torch.float64)}}, ValueError, "NaN or Inf \\(in float32\\)"),
    ({"residuals": {}, "nonfinite_resets": "x"}, TypeError, "nonfinite_resets"),
    ({"residuals": {}, "compressor": {"counter": "abc"}}, TypeError, "state\\['counter'\\] must be an int"),
    ({"residuals": {}, "compressor": {"counter": -5}}, ValueError, "state\\['counter'\\] must be >= 0"),
    ({"residuals": {}, "compressor": {"counter": 1.7}}, TypeError, "state\\['counter'\\] must be an int"),
])
def test_ef_load_state_dict_rejects_garbage_without_changing_anything(state, exc, words):
    ef = gc.ErrorFeedback(gc.Int8Quantizer())
    ef.compress(torch.randn(10), key="k")
    before = ef.state_dict()
    with pytest.raises(exc, match=words):
        ef.load_state_dict(state)
    after = ef.state_dict()
    assert after["compressor"] == before["compressor"]
    assert list(after["residuals"]) == ["k"]
    assert torch.equal(after["residuals"]["k"], before["residuals"]["k"])


def test_ef_state_without_compressor_entry_loads():
    """The default for a missing "compressor" entry ({}) used to raise KeyError
    for an Int8Quantizer."""
    ef = gc.ErrorFeedback(gc.Int8Quantizer())
    ef.load_state_dict({"residuals": {"k": torch.zeros(4)}})
    assert ef.wraps.counter == 0 and ef.residual("k").shape == (4,)


# ---------------------------------------------------------------- kernels
@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("bad", [-1, 10, 2**40])
def test_scatter_add_out_of_range_is_a_value_error_on_every_backend(backend, bad):
    """The reference raised IndexError and Triton / CUDA dropped the value silently."""
    reason = K.available_backends()[backend]
    if reason is not None:
        pytest.skip(reason)
    acc = torch.zeros(10)
    with pytest.raises(ValueError, match="out of bounds|must be in \\[0, 10\\)"):
        K.scatter_add_(acc, torch.tensor([3, bad]), torch.ones(2), backend=backend)
    assert torch.equal(acc, torch.zeros(10))  # nothing written


# ---------------------------------------------------------------- collectives, DDP, launch
@pytest.mark.parametrize("timeout, exc", [(float("inf"), ValueError), (1e300, ValueError),
                                          (9e9, ValueError), (0, ValueError),
                                          (float("nan"), ValueError), ("5", TypeError)])
def test_allreduce_timeout_must_be_finite_and_bounded(timeout, exc):
    """inf raised OverflowError after the exchange was posted; ~1e10 s made every
    gloo wait fail at once and 9e9 s made it hang."""
    with pytest.raises(exc, match="timeout must be"):
        gc.allreduce(torch.ones(4), gc.FP16(), timeout=timeout)


def test_allreduce_rejects_bad_meter_and_meta_before_sending():
    with pytest.raises(TypeError, match="meter must be a gradcomp.TrafficMeter"):
        gc.allreduce(torch.ones(4), gc.FP16(), meter=5)
    with pytest.raises(ValueError, match="tensor must hold data"):
        gc.allreduce(torch.empty(4, device="meta"), gc.FP16())


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(timeout=float("inf")), ValueError, "timeout must be > 0"),
    (dict(timeout=1e12), ValueError, "timeout must be > 0"),
    (dict(process_group="world"), TypeError, "process_group must be a torch.distributed ProcessGroup"),
])
def test_gradcompstate_bad_settings(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        gc.ddp.GradCompState(**kwargs)


def test_hook_with_a_non_state_is_a_type_error():
    with pytest.raises(TypeError, match="state must be a gradcomp.ddp.GradCompState"):
        gc.ddp.compressed_allreduce_hook(None, None)


@pytest.mark.parametrize("timeout", [float("inf"), 0, -1, 1e300])
def test_launch_timeout_checked_before_starting(timeout):
    from gradcomp.launch import launch

    with pytest.raises(ValueError, match="timeout must be"):
        launch(print, 1, timeout=timeout)


@pytest.mark.parametrize("field, value", [("timeout", float("inf")), ("worker_timeout", 1e12)])
def test_ps_config_timeouts_bounded(field, value):
    with pytest.raises(ValueError, match=f"{field} must be > 0"):
        gc.ps.PSConfig(**{field: value})
