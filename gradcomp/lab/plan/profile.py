"""A machine profile: link latency and bandwidth, and kernel rates.

The step-time model (:mod:`gradcomp.lab.plan.model`) needs, besides the
workload, three kinds of numbers, all kept in a :class:`Profile`:

* ``alpha_s``: seconds per point-to-point message (latency plus per-message
  software cost), and ``beta``: the link's bytes per second, both fitted by
  :mod:`gradcomp.lab.plan.calibrate` (``t(m) = alpha + m / beta``);
* kernel rates: **elements per second** of every codec operation the
  transports call (:data:`OPS`), measured by ``gradcomp plan calibrate``
  through the compressors' own methods, read from the kernel benchmark's
  ``kernels.json`` (:meth:`Profile.from_kernels_json`), or derived from one
  memory bandwidth (:meth:`Profile.roofline`, e.g. a GPU's) with the bytes
  each operation reads and writes per element (:data:`BYTES_PER_ELEMENT`).

JSON form (``gradcomp plan calibrate`` writes it, ``--profile FILE`` reads it)::

    {"version": 1, "alpha_s": 5.1e-05, "beta_bytes_per_s": 1.2e9 | null,
     "link": "none" | "1gbit" | ..., "kernels": {"int8.compress": 2.4e8, ...},
     "fit": {...}, "source": {...}, "call_s": {"int8.compress": 2e-05, ...},   # optional
     "host": {"cores": 2, "slice_s": 0.003, "sched_cv": 0.5}}   # optional
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from gradcomp.lab.plan.host import Host

__all__ = ["OPS", "BYTES_PER_ELEMENT", "Profile", "DEFAULT_ALPHA_S", "KERNELS_JSON_OPS"]

#: int8 block size the byte counts assume (gc.Int8Quantizer's default)
_B = 256

#: Bytes each operation reads + writes per element it processes, float32 input
#: (the kernel benchmark's accounting, ``gradcomp.lab.bench.kernels``; int8 adds one
#: float32 absmax scale per block of 256). Used to turn one memory bandwidth
#: into rates (roofline) and to fill the operations ``kernels.json`` lacks.
#: ``*.select`` counts the n scanned elements, ``sparse.decompress_add`` the k
#: kept ones (4-byte index, 4-byte value, float32 accumulator read + written).
BYTES_PER_ELEMENT = {
    "raw.compress": 8.0, "raw.decompress": 8.0, "raw.decompress_add": 12.0, "raw.reduce_compress": 12.0,
    "fp16.compress": 6.0, "fp16.decompress": 6.0, "fp16.decompress_add": 10.0, "fp16.reduce_compress": 12.0,
    "bf16.compress": 6.0, "bf16.decompress": 6.0, "bf16.decompress_add": 10.0, "bf16.reduce_compress": 12.0,
    "int8.compress": 5 + 4 / _B, "int8.decompress": 5 + 4 / _B, "int8.decompress_add": 9 + 4 / _B,
    "int8.reduce_compress": 14 + 8 / _B, "int8.compress_ef": 13 + 4 / _B,
    "topk.select": 4.0, "threshold.select": 4.0, "sparse.decompress_add": 16.0,
    "sparse.payload_decompress_add": 10.0,
    "ef.update": 16.0, "sgd.apply": 20.0,
}


def _blockwise_bytes(kind: str, code_bytes: float, block: int) -> dict:
    """:data:`BYTES_PER_ELEMENT` rows of a blockwise codec of ``code_bytes`` per element and
    ``block`` elements per float32 scale, counted as int8's are (a 1-byte code there)."""
    c, s = code_bytes, 4 / block
    return {f"{kind}.compress": 4 + c + s, f"{kind}.decompress": 4 + c + s,
            f"{kind}.decompress_add": 8 + c + s, f"{kind}.reduce_compress": 12 + 2 * c + 2 * s,
            f"{kind}.compress_ef": 12 + c + s}


# the sub-8-bit and fp8 codecs at the catalog's block sizes (gradcomp.catalog.BLOCK, SIGN_BLOCK)
for _kind, _code, _block in (("int4", 0.5, _B), ("int2", 0.25, _B), ("sign", 0.125, 1024),
                             ("fp8e4m3", 1.0, _B), ("fp8e5m2", 1.0, _B)):
    BYTES_PER_ELEMENT.update(_blockwise_bytes(_kind, _code, _block))
#: ``sparse.payload_decompress_add`` is the transports' whole call on a top-k payload with int8
#: values and compact indices (header checks, index decoding, dequantizing, scatter-add), per
#: kept element: what a rank pays per payload received, beyond the scatter-add alone
#: every operation a profile rates (elements per second)
OPS = tuple(BYTES_PER_ELEMENT)

#: kernel benchmark op -> profile op (rows of ``kernels.json``)
KERNELS_JSON_OPS = {
    "quantize_int8": "int8.compress", "dequantize_int8": "int8.decompress",
    "dequantize_int8_add_": "int8.decompress_add", "quantize_int8_ef": "int8.compress_ef",
    "topk": "topk.select", "threshold": "threshold.select", "scatter_add_": "sparse.decompress_add",
    "quantize_packed": "int4.compress", "dequantize_packed": "int4.decompress",
    "dequantize_packed_add_": "int4.decompress_add", "quantize_packed_ef": "int4.compress_ef",
    "quantize_packed_2bit": "int2.compress",
    "quantize_sign": "sign.compress", "dequantize_sign": "sign.decompress",
    "dequantize_sign_add_": "sign.decompress_add", "quantize_sign_ef": "sign.compress_ef",
    "quantize_fp8": "fp8e4m3.compress", "dequantize_fp8": "fp8e4m3.decompress",
    "dequantize_fp8_add_": "fp8e4m3.decompress_add", "quantize_fp8_ef": "fp8e4m3.compress_ef",
}

#: density whose sparse rows ``from_kernels_json`` prefers (the top-k menu's 1%)
SPARSE_DENSITY = 0.01

#: message latency of a profile that measured none (``Profile()``, ``Profile.roofline``):
#: 20 us, TCP between hosts of one data centre (an assumption, not a measurement;
#: ``gradcomp plan calibrate`` measures yours, ``--alpha-us`` sets it)
DEFAULT_ALPHA_S = 20e-6


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass
class Profile:
    """Latency, bandwidth and kernel rates of one machine and link.

    Attributes:
        alpha_s: seconds per point-to-point message (> 0).
        beta_bytes_per_s: measured link bandwidth in bytes per second, or None
            (the model then uses the link rate it is given).
        kernels: ``{op: elements per second}`` for ops of :data:`OPS`; an op
            left out costs nothing (say so in ``source``).
        link: the link the profile was measured on (``"none"``: loopback).
        fit: the calibration's fit details (sizes, residuals), for the record.
        source: where the numbers come from (free-form, JSON-ready).
        call_s: ``{op: seconds}`` fixed cost of one call of ``op`` (dispatch,
            allocation, Python), on top of ``elements / rate``; an op left out costs none.
        host: the host's cores and scheduling constants
            (:class:`~gradcomp.lab.plan.host.Host`), or None (not measured).
        intra: the intra-host tier of a two-tier calibration (``gradcomp plan
            calibrate --topology HxR``): ``{"alpha_s", "beta_bytes_per_s",
            "link", "fit"}`` between two ranks of one host; None: not measured
            (``alpha_s`` and ``beta_bytes_per_s`` are always the inter-host link's).
        topology: ``"HxR"`` the calibration ran on, or None (one rank per host).

    Raises:
        ValueError: a non-positive or non-finite number, or an unknown op.
    """

    alpha_s: float = DEFAULT_ALPHA_S
    beta_bytes_per_s: float | None = None
    kernels: dict = field(default_factory=dict)
    link: str | None = None
    fit: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)
    host: Host | None = None
    call_s: dict = field(default_factory=dict)
    intra: dict | None = None
    topology: str | None = None

    def __post_init__(self):
        self.alpha_s = _positive("alpha_s", self.alpha_s)
        if self.beta_bytes_per_s is not None:
            self.beta_bytes_per_s = _positive("beta_bytes_per_s", self.beta_bytes_per_s)
        unknown = sorted(set(self.kernels) - set(OPS))
        if unknown:
            raise ValueError(f"unknown kernel op(s) {unknown}; allowed: {', '.join(OPS)}")
        self.kernels = {op: _positive(f"kernels[{op!r}]", r) for op, r in self.kernels.items()}
        unknown = sorted(set(self.call_s) - set(OPS))
        if unknown:
            raise ValueError(f"unknown call_s op(s) {unknown}; allowed: {', '.join(OPS)}")
        for op, t in self.call_s.items():
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
                raise ValueError(f"call_s[{op!r}] must be a finite number >= 0, got {t!r}")
        self.call_s = {op: float(t) for op, t in self.call_s.items()}
        if self.intra is not None:
            if not isinstance(self.intra, dict):
                raise ValueError(f"intra must be None or an object, got {type(self.intra).__name__}")
            self.intra = dict(self.intra)
            self.intra["alpha_s"] = _positive("intra alpha_s", self.intra.get("alpha_s"))
            self.intra["beta_bytes_per_s"] = _positive("intra beta_bytes_per_s", self.intra.get("beta_bytes_per_s"))

    def seconds(self, op: str, elements: float, calls: int = 1) -> float:
        """Time of ``calls`` calls of ``op`` over ``elements`` elements in all:
        ``calls * call_s[op] + elements / rate`` (0 when the op has no rate
        or there is nothing to do)."""
        if op not in BYTES_PER_ELEMENT:
            raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
        rate = self.kernels.get(op)
        if rate is None or elements <= 0:
            return 0.0
        return calls * self.call_s.get(op, 0.0) + elements / rate

    # ---- constructors ------------------------------------------------------------
    @classmethod
    def roofline(cls, gbps: float, alpha_s: float = DEFAULT_ALPHA_S, **kw) -> "Profile":
        """Every op at one memory bandwidth ``gbps`` (1e9 bytes/s): rate =
        bandwidth / :data:`BYTES_PER_ELEMENT` (an upper bound on speed: real
        kernels reach a fraction of it)."""
        bw = _positive("gbps", gbps) * 1e9
        kernels = {op: bw / b for op, b in BYTES_PER_ELEMENT.items()}
        source = {"kernels": f"roofline at {gbps:g} GB/s"}
        source.update(kw.pop("source", {}))
        return cls(alpha_s=alpha_s, kernels=kernels, source=source, **kw)

    @classmethod
    def from_kernels_json(cls, path: str, device: str = "cpu", threads: str | None = None,
                          alpha_s: float = DEFAULT_ALPHA_S) -> "Profile":
        """Kernel rates from the kernel benchmark's ``kernels.json``.

        For each benchmark op (:data:`KERNELS_JSON_OPS`) it takes the float32
        rows of ``device`` (and ``threads``, default: ``"all"`` when present,
        else the first setting found) at the largest size measured, and the
        fastest backend there (``kind == "backend"``; sparse ops: the density
        nearest 1%): rate = ``n / median_s``
        (``k / median_s`` for ``scatter_add_``; the packed ops time 4-bit codes, and
        ``quantize_packed_2bit`` 2-bit ones). ``<codec>.reduce_compress`` is
        rated as dequantize-add followed by quantize (the sum of their times:
        the fused kernel is faster, so this errs slow); ops the benchmark does
        not time (casts, raw copies, error-feedback update, SGD) come from its
        ``copy`` baseline's bandwidth and :data:`BYTES_PER_ELEMENT`.

        Raises:
            OSError: the file cannot be read. ValueError: no usable row.
        """
        with open(path) as f:
            data = json.load(f)
        rows = [r for r in data.get("rows", []) if r.get("device") == device and r.get("dtype") == "float32"
                and r.get("median_s")]
        if not rows:
            raise ValueError(f"{path}: no float32 rows for device {device!r}")
        settings = [r["threads"] for r in rows]
        if threads is None:
            threads = "all" if "all" in settings else settings[0]
        rows = [r for r in rows if r["threads"] == threads]
        if not rows:
            raise ValueError(f"{path}: no rows with threads {threads!r}; found {sorted(set(settings))}")
        kernels, picked = {}, {}
        for bench_op, op in KERNELS_JSON_OPS.items():
            cand = [r for r in rows if r["op"] == bench_op and r.get("kind") == "backend"]
            if not cand:
                continue
            n_max = max(r["n"] for r in cand)
            cand = [r for r in cand if r["n"] == n_max]
            if bench_op in ("topk", "threshold", "scatter_add_"):  # the density nearest the menu's 1%
                dens = min({r["density"] for r in cand}, key=lambda d: abs(math.log(d / SPARSE_DENSITY)))
                cand = [r for r in cand if r["density"] == dens]
            best = min(cand, key=lambda r: r["median_s"])
            count = best["k"] if bench_op == "scatter_add_" else best["n"]
            kernels[op] = count / best["median_s"]
            picked[op] = f"{bench_op} {best['name']} n={best['n']}" + (
                f" density={best['density']}" if best.get("density") else "")
        for kind in ("int8", "int4", "sign", "fp8e4m3"):
            if f"{kind}.compress" in kernels and f"{kind}.decompress_add" in kernels:
                kernels[f"{kind}.reduce_compress"] = 1.0 / (1.0 / kernels[f"{kind}.compress"]
                                                            + 1.0 / kernels[f"{kind}.decompress_add"])
        copies = [r for r in rows if r["name"] == "copy" and r.get("gbps")]
        if copies:
            copy = max(copies, key=lambda r: r["n"])
            bw = copy["gbps"] * 1e9
            for op, b in BYTES_PER_ELEMENT.items():
                kernels.setdefault(op, bw / b)
            picked["others"] = f"copy baseline {copy['gbps']:.2f} GB/s n={copy['n']}"
        if not kernels:
            raise ValueError(f"{path}: no kernel row usable for device {device!r}, threads {threads!r}")
        return cls(alpha_s=alpha_s, kernels=kernels,
                   source={"kernels": f"{path} (device {device}, threads {threads})", "rows": picked})

    # ---- JSON --------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"version": 1, "alpha_s": self.alpha_s, "beta_bytes_per_s": self.beta_bytes_per_s,
             "link": self.link, "kernels": dict(self.kernels), "fit": self.fit, "source": self.source}
        if self.call_s:
            d["call_s"] = dict(self.call_s)
        if self.host is not None:
            d["host"] = self.host.to_dict()
        if self.intra is not None:
            d["intra"] = dict(self.intra)
        if self.topology is not None:
            d["topology"] = self.topology
        return d

    def save(self, path: str) -> None:
        """Write the profile as JSON to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        """A profile from its JSON form.

        Raises:
            ValueError: not a version-1 profile, or bad numbers.
        """
        if not isinstance(d, dict) or d.get("version") != 1:
            raise ValueError("not a gradcomp plan profile (expected a JSON object with \"version\": 1)")
        kernels = d.get("kernels") or {}
        if not isinstance(kernels, dict):
            raise ValueError("profile 'kernels' must be an object {op: elements per second}")
        return cls(alpha_s=d.get("alpha_s", DEFAULT_ALPHA_S), beta_bytes_per_s=d.get("beta_bytes_per_s"),
                   kernels=kernels, link=d.get("link"), fit=d.get("fit") or {}, source=d.get("source") or {},
                   host=Host.from_dict(d["host"]) if d.get("host") is not None else None,
                   call_s=d.get("call_s") or {}, intra=d.get("intra"), topology=d.get("topology"))

    @classmethod
    def load(cls, path: str) -> "Profile":
        """Read a profile written by :meth:`save` (or ``gradcomp plan calibrate``).

        Raises:
            OSError: unreadable file. ValueError: not valid JSON or not a profile.
        """
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d)
