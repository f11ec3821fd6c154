"""Authentication's cost on the parameter server: the demo's step and join times, and CURVE's throughput.

Three variants of the PS demo's run (``python -m gradcomp.ps``: async, int8
pushes, 1 server + 2 workers, the least-squares problem), interleaved
``--repeats`` times in fresh processes:

* ``baseline``: the library before connections authenticated (``--baseline``,
  default the parent of the commit that added ``gradcomp/ps/gatekeeper.py``),
  exported with ``git archive``, the built ``gradcomp/_C`` kernels copied over;
* ``plain``: this tree, the default (PLAIN: a handshake per connection);
* ``curve``: this tree with ``PSConfig(encrypt=True)`` (CURVE: every message encrypted).

Per run: the median step time over both workers (pull + compute + push,
the first ``--warmup`` steps left out), the join time (from the ranks'
barrier to the last worker's first step: roles built, handshakes done), each
worker's CPU seconds per step and the server's per push handled (the whole
run: CPU time moves less than wall time on a shared host). Printed: the
median over the repeats of each, and its ratio to the baseline's.
Then the one per-request cost of PLAIN (a server reads each message's
``User-Id``), and CURVE's throughput: 1 MiB messages from a PUSH to a PULL socket over
loopback (one context each), NULL against CURVE; CPU seconds of the process
(both ends, ZeroMQ's I/O threads included) give the cost of encryption plus
decryption per byte, and so the bytes per second one core can encrypt and decrypt.

    python benchmarks/ps_auth.py [--repeats 5] [--steps 300] [--dims 64,262144]
                                 [--link none|1gbit] [--baseline REV] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("baseline", "plain", "curve")


# ---- child: one run of the demo under one variant ------------------------------------
def _demo():
    """The demo's module (``gradcomp.lab.ps_demo`` once the lab moved, else ``gradcomp.ps.demo``)."""
    try:
        import gradcomp.lab.ps_demo as demo
    except ImportError:
        import gradcomp.ps.demo as demo
    return demo


def _rank(rank: int, world_size: int, spec: dict):
    import functools

    import torch
    import torch.distributed as dist

    from gradcomp.compressors import Int8Quantizer
    from gradcomp.ps import PSConfig, run

    demo = _demo()
    problem = demo.LeastSquares(spec["dim"], spec["rows"], world_size - 1, seed=0)
    extra = {"encrypt": True} if spec["variant"] == "curve" else {}
    config = PSConfig(mode="async", steps=spec["steps"], compressor=Int8Quantizer(),
                      optimizer=functools.partial(torch.optim.SGD, lr=demo.default_lr(spec["dim"], spec["rows"]),
                                                  momentum=0.5), **extra)
    stamps: list[tuple[float, float]] = []  # (wall, this process's CPU seconds) after each step
    dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    out = run(rank, world_size, problem.model, problem.loss, config,
              on_step=lambda *_: stamps.append((time.perf_counter(), time.process_time())))
    if rank == 0:  # the server's CPU per push handled, the whole run (roles, handshakes, teardown) included
        return {"cpu_per_push_s": (time.process_time() - cpu0) / out["stats"]["pushes"]}
    w = spec["warmup"]
    steps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])][w:]
    cpu = (stamps[-1][1] - stamps[w][1]) / (len(stamps) - 1 - w)
    return {"steps": steps, "cpu_per_step_s": cpu, "join_s": stamps[0][0] - t0}


def _child(spec: dict) -> None:
    import torch  # noqa: F401  first: gradcomp's import hook on torch must not start inside gradcomp._validate

    import gradcomp

    where = os.path.dirname(os.path.dirname(os.path.abspath(gradcomp.__file__)))
    assert os.path.samefile(where, spec["tree"]), f"imported gradcomp from {where}, not {spec['tree']}"
    from gradcomp.cluster import launch_on

    results, link = launch_on(spec["link"], _rank, 3, (spec,), timeout=600)
    steps = [s for r in results[1:] for s in r["steps"]]
    print(json.dumps({"step_s": statistics.median(steps), "join_s": max(r["join_s"] for r in results[1:]),
                      "worker_cpu_s": statistics.mean(r["cpu_per_step_s"] for r in results[1:]),
                      "server_cpu_s": results[0]["cpu_per_push_s"],
                      "link": {k: link.get(k) for k in ("name", "configured_bps", "achieved_bps")}}))


# ---- CURVE's throughput ------------------------------------------------------------------
def curve_throughput(total_mib: int = 256, repeats: int = 3) -> dict:
    """Bytes per CPU second of NULL and CURVE over loopback, and what
    CURVE's encryption plus decryption costs per core (medians of ``repeats``)."""
    out = {"null": [], "curve": []}
    for _ in range(repeats):
        for mechanism in out:
            out[mechanism].append(_stream(mechanism, total_mib))
    med = {m: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for m, runs in out.items()}
    crypto_cpu_s = med["curve"]["cpu_s"] - med["null"]["cpu_s"]
    nbytes = total_mib << 20
    return {"nbytes": nbytes, "null": med["null"], "curve": med["curve"],
            "crypto_bytes_per_cpu_s": nbytes / crypto_cpu_s if crypto_cpu_s > 0 else float("inf")}


def _stream(mechanism: str, total_mib: int) -> dict:
    import zmq

    from gradcomp.ps.auth import Credential, new_credential

    contexts = [zmq.Context(io_threads=1), zmq.Context(io_threads=1)]  # each end its own I/O thread
    pull, push = contexts[0].socket(zmq.PULL), contexts[1].socket(zmq.PUSH)
    if mechanism == "curve":  # no ZAP handler: CURVE then admits any client key, which is all this needs
        credential = Credential(new_credential(encrypt=True))
        for sock, options in ((pull, credential.server_options(0)), (push, credential.client_options(1, 0))):
            for option, value in options.items():
                sock.setsockopt(option, value)
    pull.bind("tcp://127.0.0.1:*")
    push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    message = os.urandom(1 << 20)
    for _ in range(4):  # the handshake and the buffers, before the clock
        push.send(message)
        pull.recv(copy=False)
    sender = threading.Thread(target=lambda: [push.send(message, copy=False) for _ in range(total_mib)])
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sender.start()
    for _ in range(total_mib):
        pull.recv(copy=False)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    sender.join()
    for sock in (pull, push):
        sock.close(linger=0)
    for ctx in contexts:
        ctx.term()
    return {"wall_s": wall, "cpu_s": cpu, "bytes_per_s": (total_mib << 20) / wall}


def user_id_cost(calls: int = 200_000) -> float:
    """Seconds of the one thing authentication adds to each request a server
    handles: reading the message's ``User-Id`` (the rank its connection proved)."""
    import zmq

    from gradcomp.ps.auth import Credential, new_credential
    from gradcomp.ps.gatekeeper import Gatekeeper

    credential = Credential(new_credential())
    ctx = zmq.Context()
    keeper = Gatekeeper(ctx, credential.verifier([1]), name="bench-gatekeeper")
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock, options in ((router, credential.server_options(0)), (dealer, credential.client_options(1, 0))):
        for option, value in options.items():
            sock.setsockopt(option, value)
    router.bind("tcp://127.0.0.1:*")
    keeper.watch(router)
    keeper.start()
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    dealer.send(b"x" * 80)
    frames = router.recv_multipart(copy=False)
    assert frames[-1].get("User-Id") == "w1"
    t0 = time.perf_counter()
    for _ in range(calls):
        frames[-1].get("User-Id")
    per_call = (time.perf_counter() - t0) / calls
    for sock in (router, dealer):
        sock.close(linger=0)
    keeper.stop()
    ctx.term()
    return per_call


# ---- parent ------------------------------------------------------------------------------
def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout.strip()


def baseline_tree(dest: str, rev: str | None) -> str:
    """The library at ``rev`` (None: the parent of the commit that added
    ``gradcomp/ps/gatekeeper.py``) exported to ``dest``; returns the commit."""
    if rev is None:
        added = _git("log", "--diff-filter=A", "--format=%H", "--", "gradcomp/ps/gatekeeper.py").split()
        if not added:
            raise SystemExit("gradcomp/ps/gatekeeper.py is in no commit: give --baseline")
        rev = added[-1] + "^"
    rev = _git("rev-parse", rev)
    if _git("ls-tree", rev, "gradcomp/ps/gatekeeper.py"):
        raise SystemExit(f"--baseline {rev[:10]} already authenticates: give a commit before it")
    archive = os.path.join(dest, "baseline.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "-o", archive, rev, "gradcomp"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    for name in os.listdir(os.path.join(ROOT, "gradcomp")):  # the built kernels: their sources are the same
        if name.startswith("_C.") and name.endswith(".so"):
            shutil.copy(os.path.join(ROOT, "gradcomp", name), os.path.join(dest, "gradcomp", name))
    return rev


def _run_child(spec: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=spec["tree"])
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], env=env,
                       cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"{spec['variant']} run failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--dims", default="64,262144", help="the demo's --dim values (float32 parameters)")
    p.add_argument("--rows", type=int, default=16, help="rows of A per worker")
    p.add_argument("--link", default="none", help="none (loopback) or a rate for the emulated cluster, e.g. 1gbit")
    p.add_argument("--throughput-mib", type=int, default=256)
    p.add_argument("--baseline", default=None,
                   help="the commit without authentication to compare against (default: the parent of "
                        "the commit that added gradcomp/ps/gatekeeper.py)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        _child(json.loads(args.child))
        return 0
    tmp = tempfile.mkdtemp(prefix="ps-auth-bench-")
    try:
        rev = baseline_tree(tmp, args.baseline)
        trees = {"baseline": tmp, "plain": ROOT, "curve": ROOT}
        runs = {}
        for dim in (int(d) for d in args.dims.split(",")):
            for _ in range(args.repeats):
                for variant in VARIANTS:
                    spec = {"variant": variant, "tree": trees[variant], "dim": dim, "rows": args.rows,
                            "steps": args.steps, "warmup": args.warmup, "link": args.link}
                    runs.setdefault((dim, variant), []).append(_run_child(spec))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = _report(runs, rev, args)
    report["throughput"] = curve_throughput(args.throughput_mib)
    report["user_id_s"] = user_id_cost()
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _report(runs: dict, rev: str, args) -> dict:
    rows = []
    for (dim, variant), rs in runs.items():
        base = runs[(dim, "baseline")]
        row = {"dim": dim, "variant": variant, "link": rs[0]["link"],
               "step_ms_runs": [1e3 * r["step_s"] for r in rs]}
        for key in ("step_s", "join_s", "worker_cpu_s", "server_cpu_s"):
            mine, theirs = statistics.median(r[key] for r in rs), statistics.median(r[key] for r in base)
            row[key.replace("_s", "_ms")], row[key.replace("_s", "_ratio")] = 1e3 * mine, mine / theirs
        rows.append(row)
    return {"baseline_commit": rev, "commit": _git("rev-parse", "HEAD"), "repeats": args.repeats,
            "steps": args.steps, "warmup": args.warmup, "rows_per_worker": args.rows, "link": args.link,
            "results": rows}


def _print(report: dict) -> None:
    print(f"baseline {report['baseline_commit'][:10]}, this tree {report['commit'][:10]}; link {report['link']}; "
          f"medians of {report['repeats']} runs of {report['steps']} steps (first {report['warmup']} left out)")
    cols = (("step", "step_ms", "step_ratio", 9, 3), ("join", "join_ms", "join_ratio", 8, 1),
            ("worker CPU/step", "worker_cpu_ms", "worker_cpu_ratio", 15, 3),
            ("server CPU/push", "server_cpu_ms", "server_cpu_ratio", 15, 3))
    print(f"{'dim':>8} {'variant':>9}" + "".join(f" {name + ' ms':>{w}} {'x base':>7}" for name, _, _, w, _ in cols))
    for r in report["results"]:
        print(f"{r['dim']:>8} {r['variant']:>9}"
              + "".join(f" {r[k]:>{w}.{d}f} {r[q]:>7.3f}" for _, k, q, w, d in cols))
    t = report["throughput"]
    print(f"loopback, 1 MiB messages, {t['nbytes'] >> 20} MiB: NULL {t['null']['bytes_per_s'] / 1e6:.0f} MB/s "
          f"({t['null']['cpu_s']:.2f} CPU s), CURVE {t['curve']['bytes_per_s'] / 1e6:.0f} MB/s "
          f"({t['curve']['cpu_s']:.2f} CPU s); CURVE encryption + decryption: "
          f"{t['crypto_bytes_per_cpu_s'] / 1e6:.0f} MB per CPU second")
    print(f"per request, a server reads its User-Id: {1e6 * report['user_id_s']:.2f} us")


if __name__ == "__main__":
    sys.exit(main())
