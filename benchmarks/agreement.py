"""The agreement's cost: bytes and time of alternating calls, and the time to a named mismatch.

Three measurements, each rank a process of :func:`gradcomp.launch.launch`
(gloo over loopback unless run inside the emulated cluster):

1. bytes: a loop alternating between two calls (two tensor sizes) on one
   group, where every call agrees (its 56-byte signature to every peer and
   the previous call's disagreement envelopes), against the same calls each
   on a group of its own, where every call after the first skips the check.
   Per rank: meter bytes sent per call in both, their ratio (the target is at
   most 1.05 plus a fixed header) and the header, ``(one - two) / calls``.
2. latency: the same two loops timed round after round, back to back (so that
   load from other processes hits both alike); the median difference per
   call is what the agreement adds to a call that changed (one round trip of
   the signatures with the envelopes posted alongside). Also one settings
   agreement alone (:func:`gradcomp.comm.settings.agree_settings`).
3. mismatch: one rank alone changes its call (to 64 elements) after the group
   agreed; seconds from the earliest rank's start of that call to the last
   rank's ``ValueError`` (the ranks share one clock), per size, algorithm
   and world size.

Run from the repository root::

    nice -n 5 python benchmarks/agreement.py [--worlds 2,4] [--mismatch-worlds 2,4,8]
                                             [--rounds 15] [--link 1gbit] [--out agreement.json]

``--link RATE`` runs every rank in the emulated cluster (:class:`gradcomp.cluster.LocalCluster`,
one network namespace per rank, tbf-shaped links; needs root).

Prints three tables (bytes and milliseconds per call, per case) and writes
every figure to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

#: the call pairs of the alternating loop: (name, algorithm, compressor, size a, size b)
PAIRS = [
    ("int8 ring 2^10/2^11", "ring", "int8", 1 << 10, 1 << 11),  # latency-bound: the agreement's time shows
    ("int8 ring 2^16/2^18", "ring", "int8", 1 << 16, 1 << 18),
    ("int8 ring 2^20/2^22", "ring", "int8", 1 << 20, 1 << 22),  # pipelined
    ("fp16 two_phase 2^18/2^20", "two_phase", "fp16", 1 << 18, 1 << 20),
    ("topk 1% allgather 2^18/2^20", "allgather", "topk", 1 << 18, 1 << 20),
]
#: iterations of the alternating loop per round (two calls each)
ITERATIONS = 5
#: sizes and algorithms of the mismatch timings
MISMATCH_SIZES = (1 << 10, 1 << 16, 1 << 19, 1 << 20, 1 << 22)
MISMATCH_ALGORITHMS = (("ring", "int8"), ("two_phase", "fp16"), ("allgather", "topk"),
                       ("halving_doubling", "int8"), ("sparse_reduce_scatter", "topk"))


def _compressor(name):
    import gradcomp as gc

    return {"int8": gc.Int8Quantizer, "fp16": gc.FP16, "topk": lambda: gc.TopK(ratio=0.01)}[name]()


def _loop(xs, algorithm, comp, groups, meter):
    """ITERATIONS x (a, b) on ``groups`` (one group twice, or one group per size)."""
    import gradcomp as gc

    t0 = time.perf_counter()
    for _ in range(ITERATIONS):
        for x, group in zip(xs, groups):
            gc.allreduce(x, comp, algorithm=algorithm, group=group, meter=meter, timeout=60)
    return time.perf_counter() - t0


def _alternating(rank, world, rounds):
    import torch
    import torch.distributed as dist

    import gradcomp as gc
    from gradcomp.comm.settings import agree_settings

    out = []
    for name, algorithm, comp_name, na, nb in PAIRS:
        comp = _compressor(comp_name)
        g = torch.Generator().manual_seed(rank)
        xs = [torch.randn(na, generator=g), torch.randn(nb, generator=g)]
        one = dist.new_group(list(range(world)))
        two = [dist.new_group(list(range(world))) for _ in range(2)]
        _loop(xs, algorithm, comp, [one, one], None)  # warm-up: buffers, first agreements
        _loop(xs, algorithm, comp, two, None)
        times = {"one": [], "two": []}
        meters = {"one": gc.TrafficMeter(), "two": gc.TrafficMeter()}
        for r in range(rounds):
            for kind in (("one", "two") if r % 2 == 0 else ("two", "one")):
                dist.barrier()
                times[kind].append(_loop(xs, algorithm, comp, [one, one] if kind == "one" else two,
                                         meters[kind]))
        calls = 2 * ITERATIONS * rounds
        out.append({"case": name, "calls": calls,
                    "bytes_per_call": {k: m.bytes_sent / calls for k, m in meters.items()},
                    "agreement_bytes_per_call": {k: m.as_dict()["phases"].get("agreement", {})
                                                 .get("bytes_sent", 0) / calls for k, m in meters.items()},
                    "s_per_call": {k: [t / (2 * ITERATIONS) for t in v] for k, v in times.items()}})
    settings = []
    group = dist.new_group(list(range(world)))
    for r in range(rounds * 4):
        dist.barrier()
        t0 = time.perf_counter()
        agree_settings(group, "benchmark", {"round": r}, timeout=60)
        settings.append(time.perf_counter() - t0)
    return {"pairs": out, "settings_s": settings}


def _mismatch(rank, world, sizes):
    import torch
    import torch.distributed as dist

    import gradcomp as gc

    out = []
    for n in sizes:
        for algorithm, comp_name in MISMATCH_ALGORITHMS:
            group = dist.new_group(list(range(world)))
            comp = _compressor(comp_name)
            x = torch.full((n,), float(rank + 1))
            gc.allreduce(x, comp, algorithm=algorithm, group=group, timeout=60)  # agreed
            dist.barrier(group)
            t0 = time.time()
            try:
                gc.allreduce(torch.ones(64) if rank == world - 1 else x, comp, algorithm=algorithm,
                             group=group, timeout=60)
                outcome = "no error"
            except ValueError:
                outcome = "ValueError"
            out.append({"numel": n, "algorithm": algorithm, "compressor": comp_name, "t0": t0,
                        "t1": time.time(), "outcome": outcome})
            dist.destroy_process_group(group)
    return out


def _median(v):
    return statistics.median(v) if v else float("nan")


def _report_pairs(world, res, table):
    print(f"\nalternating calls, world {world}: bytes sent per call per rank (rank 0)")
    print(f"{'call pair':28} {'one group':>10} {'two groups':>10} {'ratio':>6} {'header B':>9} {'+ms/call':>8}")
    for k, p in enumerate(res[0]["pairs"]):
        one, two = p["bytes_per_call"]["one"], p["bytes_per_call"]["two"]
        # the agreement's time per call: the slowest rank's median difference of paired rounds
        extra = max(_median([a - b for a, b in zip(r["pairs"][k]["s_per_call"]["one"],
                                                   r["pairs"][k]["s_per_call"]["two"])]) for r in res)
        row = {"world": world, "case": p["case"], "one_group_bytes": one, "two_groups_bytes": two,
               "ratio": one / two, "header_bytes": one - two, "agreement_ms_per_call": 1e3 * extra,
               "one_group_ms_per_call": 1e3 * max(_median(r["pairs"][k]["s_per_call"]["one"]) for r in res),
               "two_groups_ms_per_call": 1e3 * max(_median(r["pairs"][k]["s_per_call"]["two"]) for r in res)}
        table.append(row)
        print(f"{p['case']:28} {one:10.0f} {two:10.0f} {one / two:6.4f} {one - two:9.0f} {1e3 * extra:8.2f}")
    agree = max(_median(r["settings_s"]) for r in res)
    print(f"one settings agreement alone: {1e3 * agree:.2f} ms (median, slowest rank)")
    return agree


def _report_mismatch(world, res, table):
    print(f"\none rank changes its call to 64 elements, world {world}: seconds to the last ValueError")
    print(f"{'numel':>8} {'algorithm':>21} {'compressor':>10} {'seconds':>8} {'every rank':>10}")
    for k, case in enumerate(res[0]):
        seconds = max(r[k]["t1"] for r in res) - min(r[k]["t0"] for r in res)
        every = all(r[k]["outcome"] == "ValueError" for r in res)
        table.append({"world": world, "numel": case["numel"], "algorithm": case["algorithm"],
                      "compressor": case["compressor"], "seconds": seconds, "value_error_everywhere": every})
        print(f"{case['numel']:8d} {case['algorithm']:>21} {case['compressor']:>10} {seconds:8.3f} "
              f"{'yes' if every else 'NO':>10}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4", help="world sizes of the alternating loops")
    parser.add_argument("--mismatch-worlds", default="2,4,8", help="world sizes of the mismatch timings")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of each loop (each ITERATIONS x 2 calls)")
    parser.add_argument("--link", default=None,
                        help="run in the emulated cluster at this link rate (e.g. 1gbit; needs root); "
                             "default: loopback")
    parser.add_argument("--out", default=None, help="JSON file for every figure")
    args = parser.parse_args(argv)
    import torch  # noqa: F401  (before gradcomp's modules: importing torch first from inside one fails)

    from gradcomp.cluster import launch_on  # the lab's runner: loopback, or the emulated cluster

    pairs, mismatches, settings, links = [], [], {}, {}
    for world in (int(w) for w in args.worlds.split(",") if w):
        res, link = launch_on(args.link, _alternating, world, (args.rounds,), timeout=3600)
        links[world] = link
        print(f"\nlink: {link}")
        settings[world] = 1e3 * _report_pairs(world, res, pairs)
    for world in (int(w) for w in args.mismatch_worlds.split(",") if w):
        res, _ = launch_on(args.link, _mismatch, world, (MISMATCH_SIZES,), timeout=3600)
        _report_mismatch(world, res, mismatches)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"iterations": ITERATIONS, "rounds": args.rounds, "links": links, "pairs": pairs,
                       "settings_agreement_ms": settings, "mismatch": mismatches}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
