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
        i, v = K.threshold(x, 2.5)  # a data-dependent size through inductor
        dense = torch.zeros_like(x)
        K.scatter_add_(dense, i, v * 2.0)
        return q, s, idx, vals + 1.0, dense

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
    native = K.available_backends()["cpu"] is None
    for name in ops.SCHEMAS:  # under CPU: the native kernel of every op when built, else the reference
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"gradcomp::{name}", "CPU")
        assert registry.auto_kernel(name, "cpu") is ops.kernels("cpu" if native else "reference")[name], name


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
    import importlib

    import gradcomp.kernels.cuda as cuda  # importable without CuPy or a GPU, with its kernel modules

    for module in cuda.KERNEL_MODULES:
        importlib.import_module(module)
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

    def show():
        for n in ops.SCHEMAS:
            fn = registry.auto_kernel(n, "cuda")
            print(n, fn.__module__, torch._C._dispatch_has_kernel_for_dispatch_key("gradcomp::" + n, "CUDA"))

    print("reason:", cuda.unavailable_reason())
    show()
    # the choice made when the backend is usable (no CUDA tensor is ever made here)
    cuda.unavailable_reason = lambda: None
    cuda.devices = lambda: frozenset({"cuda"})
    registry.CUDA_OP_PREFERENCE["topk"] = ("triton", "cuda", "reference")
    registry.reset()
    show()
""")


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the absence of a GPU")
def test_cuda_registration_path_without_a_gpu():
    """Under the CUDA key every op has its kernel. Without a GPU the CUDA
    backend gives its reason and the reference runs; made usable, its kernels
    are chosen for the unfused ops (the fused ones compose them through the
    dispatcher; a per-op order is followed), in a fresh process."""
    r = subprocess.run([sys.executable, "-c", _CUDA_PATH], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "TRITON_INTERPRET": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0].startswith("reason: ") and ("cupy" in lines[0] or "CUDA device" in lines[0]), lines[0]
    n = len(ops.SCHEMAS)
    before = {ln.split()[0]: ln.split()[1:] for ln in lines[1:1 + n]}
    after = {ln.split()[0]: ln.split()[1:] for ln in lines[1 + n:]}
    for name in ops.SCHEMAS:
        assert before[name] == ["gradcomp.kernels.reference_backend", "True"], (name, before[name])
    # the CUDA backend's kernels live in two modules (int8 / selection, and the low-bit codecs)
    cuda_modules = ("gradcomp.kernels.cuda", "gradcomp.kernels.cuda_lowbit")
    for name in ops.OPS:  # topk's own order tries triton first: unavailable (no GPU, no interpreter), then cuda
        assert after[name][0] in cuda_modules and after[name][1] == "True", (name, after[name])
    for name in ops.FUSED:
        assert after[name] == ["gradcomp.kernels.reference_backend", "True"], (name, after[name])


_COMPILE_FIRST = textwrap.dedent("""
    import torch
    import gradcomp.kernels as K
    from gradcomp.kernels import ops, reference as R, registry

    def f(x):
        q, s = K.quantize_int8(x, 64, "stochastic", 3, 4)
        return q, s, K.threshold(x, 2.0)[0]

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 2
    q, s, i = torch.compile(f, fullgraph=True, backend="aot_eager")(x)  # the first gradcomp call here
    rq, rs = R.quantize_int8(x, 64, "stochastic", 3, 4)
    assert torch.equal(q, rq) and torch.equal(s, rs) and torch.equal(i, R.threshold(x, 2.0)[0])
    native = K.available_backends()["cpu"] is None
    chosen = ops.kernels("cpu" if native else "reference")["quantize_int8"]
    print(registry.auto_kernel("quantize_int8", "cpu") is chosen)
""")


@pytest.mark.slow  # a fresh interpreter
def test_compiled_before_any_eager_call():
    """A function compiled before any eager gradcomp call traces (the choice of
    backend is the dispatcher's, at run time) and runs the device's kernels."""
    r = subprocess.run([sys.executable, "-c", _COMPILE_FIRST], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "True"
