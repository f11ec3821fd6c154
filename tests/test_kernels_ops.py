"""The kernel ops as torch.library custom ops: schemas, fake kernels, dispatch,
torch.compile, and the one-schema rule for backends."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gradcomp.kernels as K
from gradcomp.errors import BackendUnavailable
from gradcomp.kernels import ops, registry
from gradcomp.kernels import reference as R


def _data(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _pipeline(x, residual, acc, u, v):
    """Every op once, as a compressor and a collective would chain them."""
    q, s = K.quantize_int8_ef(x, residual, 64, "stochastic", 7, 3)
    out = K.dequantize_int8(q, s, 64, check_int8=True)
    K.dequantize_int8_add_(acc, q, s, 64)
    q2, s2 = K.reduce_quantize_int8(acc, q, s, 64, 2, decode=True)
    qn, sn = K.quantize_int8(x, 128)
    i1, v1 = K.topk(x, 37)
    i2, v2 = K.threshold(x, 4.0)
    i3, v3 = K.approx_topk(x, 50)
    dense = torch.zeros_like(x)
    K.scatter_add_(dense, i1, v1)
    K.scatter_add_(dense, i2, v2)
    i4, v4 = K.dgc_topk_(x, u, v, 0.9, 1.0, 20)
    K.dgc_accumulate_(x, u, v, 0.5)
    return (q, s, out, q2, s2, qn, sn, i1, v1, i3.numel(), (i3.long() * 3 + 1).sum(), v3.abs().sum(),
            i2.numel(), i4, v4, dense, residual, acc, u, v)


def _inputs(n):
    x = _data(n, 1)
    return x, _data(n, 2) * 0.01, _data(n, 3), torch.zeros(n), torch.zeros(n)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_equals_eager(dynamic):
    """The public functions trace into one graph of gradcomp ops (no graph break)
    and give bit for bit the eager results, data-dependent sizes included."""
    torch._dynamo.reset()
    eager = _pipeline(*_inputs(3000))
    compiled = torch.compile(_pipeline, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    got = compiled(*_inputs(3000))
    assert len(got) == len(eager)
    for i, (a, b) in enumerate(zip(got, eager)):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, i
            assert torch.equal(_bits(a), _bits(b)), f"output {i} differs"
        else:
            assert a == b, i


def test_torch_compile_inductor_equals_eager():
    """With inductor (CPU codegen around the ops) as well; the mutated inputs
    (residual, acc) are updated in place as in eager."""
    torch._dynamo.reset()

    def step(x, residual, acc):
        q, s = K.quantize_int8_ef(x * 2.0, residual, 64)
        K.dequantize_int8_add_(acc, q, s, 64)
        idx, vals = K.topk(acc, 10)
        return q, s, idx, vals + 1.0

    x = _data(2000, 4)
    r1, r2 = _data(2000, 5) * 0.1, _data(2000, 5) * 0.1
    a1, a2 = torch.zeros(2000), torch.zeros(2000)
    want = step(x, r1, a1)
    got = torch.compile(step, fullgraph=True)(x, r2, a2)
    for a, b in zip(got, want):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(r1), _bits(r2)) and torch.equal(_bits(a1), _bits(a2))


def test_fake_kernels_give_shapes_and_dtypes():
    """On meta tensors (the fake kernels) the ops give the outputs' metadata."""
    x = torch.empty(1000, device="meta")
    i, v = torch.ops.gradcomp.topk(x, 10)
    assert i.shape == (10,) and i.dtype == torch.int32 and v.dtype == torch.float32 and i.is_meta
    q = torch.empty(1000, dtype=torch.int8, device="meta")
    s = torch.empty(4, device="meta")
    torch.ops.gradcomp.quantize_int8(x, 256, False, 0, q, s)  # mutates, returns nothing
    i, v = torch.ops.gradcomp.dgc_topk_(x, x, x, 0.9, 1.0, 2000)
    assert i.shape == (1000,)


def test_schemas_and_dispatch_keys():
    for name, schema in ops.SCHEMAS.items():
        op = getattr(torch.ops.gradcomp, name).default
        assert op is ops.op[name]
        assert str(op._schema).startswith(f"gradcomp::{name}(")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gradcomp::{name}", "CompositeExplicitAutograd")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gradcomp::{name}", "Meta")
    registry.prepare("cpu")
    native = K.available_backends()["cpu"] is None
    for name in ops.SCHEMAS:  # the native kernel of every op is registered under CPU when built
        assert ops.registered(name, "CPU") == ("cpu" if native else None), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gradcomp::{name}", "CPU") == native


def test_a_kernel_must_take_the_schema_arguments():
    with pytest.raises(TypeError, match="schema's arguments"):
        @ops.kernel("cpu")
        def quantize_int8(x, block_size, rounding, seed, counter, q, scales):  # the old, drifted signature
            pass

    with pytest.raises(ValueError, match="op must be one of"):
        ops.kernel("cpu", "quantise_int8")(lambda x: None)
    assert ops.kernels("cpu").get("quantize_int8") is None or \
        ops.kernels("cpu")["quantize_int8"].__module__ == "gradcomp.kernels.cpu"


def test_every_backend_declares_the_same_ops():
    """reference: all ops; cpu: all (fused ones included); triton / cuda: the
    unfused ones (their fused ops compose their kernels)."""
    assert set(ops.kernels("reference")) == set(ops.SCHEMAS)
    if K.available_backends()["cpu"] is None:
        assert set(ops.kernels("cpu")) == set(ops.SCHEMAS)
    import gradcomp.kernels.cuda  # noqa: F401  (importable without CuPy or a GPU)

    assert set(ops.kernels("cuda")) == set(ops.OPS)


def test_forced_reference_is_the_reference_on_views_with_offsets():
    """Public calls on slices of a larger tensor (non-zero storage offset),
    automatic and forced, give the reference's results."""
    base = _data(5000, 9)
    x = base[1000:3500]
    acc_base = torch.zeros(6000)
    acc = acc_base[500:3000]
    q, s = K.quantize_int8(x, 64, "stochastic", 1, 2)
    rq, rs = R.quantize_int8(x.clone(), 64, "stochastic", 1, 2)
    assert torch.equal(q, rq) and torch.equal(_bits(s), _bits(rs))
    for backend in (None, "reference"):
        acc.zero_()
        K.dequantize_int8_add_(acc, q, s, 64, backend=backend)
        assert torch.equal(acc, R.dequantize_int8(rq, rs, 64))
        assert acc_base[:500].eq(0).all() and acc_base[3000:].eq(0).all()
        qo_base = torch.zeros(3000, dtype=torch.int8)
        so_base = torch.zeros(50)
        K.quantize_int8(x, 64, "stochastic", 1, 2, out_q=qo_base[100:2600], out_scales=so_base[3:43], backend=backend)
        assert torch.equal(qo_base[100:2600], rq) and qo_base[:100].eq(0).all() and qo_base[2600:].eq(0).all()
        assert torch.equal(_bits(so_base[3:43]), _bits(rs))
        i, v = K.topk(x, 20, backend=backend)
        assert torch.equal(i, R.topk(x.clone(), 20)[0])


def test_forced_unavailable_backend_fails_with_the_reason(monkeypatch):
    reasons = K.available_backends()
    for name, reason in reasons.items():
        if reason is None:
            continue
        with pytest.raises(BackendUnavailable, match=f"backend '{name}' is unavailable: .+"):
            K.quantize_int8(torch.randn(64), backend=name)
        monkeypatch.setenv("GRADCOMP_BACKEND", name)
        with pytest.raises(BackendUnavailable, match="unavailable"):
            K.topk(torch.randn(64), 3)
        monkeypatch.delenv("GRADCOMP_BACKEND")
    if reasons["cpu"] is None:
        with pytest.raises(BackendUnavailable, match="does not run on 'meta'"):
            K.topk(torch.empty(8, device="meta"), 3, backend="cpu")


_CUDA_PATH = textwrap.dedent("""
    import torch
    from gradcomp.kernels import cuda, ops, registry
    reason = cuda.unavailable_reason()
    print("reason:", reason)
    registry.prepare("cuda")
    print("registered:", sorted(n for n in ops.SCHEMAS if ops.registered(n, "CUDA")))
    # the registration path, with the backend made usable (no CUDA tensor is ever made here)
    cuda.unavailable_reason = lambda: None
    cuda.devices = lambda: frozenset({"cuda"})
    registry.reset()
    registry.CUDA_OP_PREFERENCE["topk"] = ("triton", "cuda", "reference")
    registry._prepared.discard("cuda")
    registry.prepare("cuda")
    for n in ops.SCHEMAS:
        print(n, ops.registered(n, "CUDA"), torch._C._dispatch_has_kernel_for_dispatch_key("gradcomp::" + n, "CUDA"))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the absence of a GPU")
def test_cuda_registration_path_without_a_gpu():
    """Without a GPU: a reason, nothing under the CUDA key; made usable, the
    CUDA backend's kernels are registered under CUDA (the unfused ops), in a
    fresh process."""
    r = subprocess.run([sys.executable, "-c", _CUDA_PATH], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TRITON_INTERPRET": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("reason: ") and ("cupy" in lines[0] or "CUDA device" in lines[0]), lines[0]
    assert lines[1] == "registered: []"
    got = {ln.split()[0]: ln.split()[1:] for ln in lines[2:]}
    for n in ops.OPS:  # topk's own order tries triton first: unavailable (no GPU, no interpreter), then cuda
        assert got[n] == ["cuda", "True"], (n, got[n])
    for n in ops.FUSED:  # composed through the dispatcher from the CUDA kernels
        assert got[n] == ["None", "False"], (n, got[n])
