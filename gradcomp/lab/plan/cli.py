"""``gradcomp plan``: project, recommend, calibrate, validate.

::

    gradcomp plan [--nodes 16,64,256,1024] [--link 10gbit,100gbit] [--params 25M,1B,7B]
                  [--compute-ms T] [--straggler-cv CV] [--out DIR]        # projection table + plot
    gradcomp plan recommend --nodes N --link RATE --params P --compute-ms T
                  [--straggler-cv CV] [--max-gap PTS]
    gradcomp plan calibrate [--link none|RATE] [--out FILE] | gradcomp plan validate RESULTS_DIR

Every subcommand but ``calibrate`` takes ``--profile FILE`` (default: this machine's
kernels, measured on first use and cached, see :mod:`.machine`), ``--alpha-us``,
``--kernel-gbps`` and ``--kernels-json`` (docs/planning.md). Bad values exit with status 2
and one line on stderr, before any work.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time

from gradcomp.lab.plan.codecs import parse_plan_names
from gradcomp.lab.plan.machine import SHIPPED_PROFILE
from gradcomp.lab.plan.tier_args import tier_kw, tier_options

__all__ = ["main", "DEFAULT_PROFILE"]

#: the reference profile shipped with gradcomp (its development machine's; used only when this
#: machine cannot be measured)
DEFAULT_PROFILE = SHIPPED_PROFILE
SUBCOMMANDS = ("recommend", "calibrate", "validate")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit status 2."""

    def error(self, message):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _arg(parse, what: str):
    def conv(text):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    conv.__name__ = what
    return conv


def _positive(text: str) -> float:
    v = float(text)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"expected a finite number > 0, got {text!r}")
    return v


def _nonneg(text: str) -> float:
    v = float(text)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"expected a finite number >= 0, got {text!r}")
    return v


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise ValueError(f"expected an integer >= 0, got {text!r}")
    return v


def _int_pos(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise ValueError(f"expected an integer >= 1, got {text!r}")
    return v


def _lists():
    from gradcomp.lab.units import parse_count, parse_list, parse_rate

    def nodes(t):
        return parse_list(t, lambda s, name: _int_pos(s), "--nodes")

    def links(t):
        names = parse_list(t, lambda s, name: s.lower(), "--link")
        return [(n, parse_rate(n, "--link") / 8) for n in names]  # (name, bytes/s): the model prices bytes

    def params(t):
        return parse_list(t, parse_count, "--params")
    return nodes, links, params


def _model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model inputs")
    g.add_argument("--profile", help="profile JSON from gradcomp plan calibrate (default: this machine's "
                                     "kernels, measured on first use and cached)")
    g.add_argument("--recalibrate", action="store_true",
                   help="measure this machine's kernel rates again (some seconds) and replace the cached profile")
    g.add_argument("--alpha-us", type=_arg(_positive, "alpha"),
                   help="latency of one message between two workers in microseconds (default: the "
                        "profile's; a measured-here profile assumes 20, TCP within one data centre)")
    g.add_argument("--kernel-gbps", type=_arg(_positive, "gbps"),
                   help="every codec op at this memory bandwidth in GB/s (roofline; e.g. a GPU's)")
    g.add_argument("--kernels-json", help="kernel rates from gradcomp bench kernels' kernels.json")
    g.add_argument("--kernels-device", default="cpu", help="device of the kernels.json rows (default cpu)")
    g.add_argument("--servers", type=_arg(_int_pos, "servers"),
                   help="parameter-server shards (default: one per 8 workers)")
    g.add_argument("--bucket-mb", type=_arg(_positive, "mb"), default=25.0,
                   help="DDP bucket cap in MiB (default 25, DDP's)")
    g.add_argument("--straggler-cv", type=_arg(_nonneg, "cv"), default=None,
                   help="coefficient of variation of each worker's compute time")
    g.add_argument("--straggler-factor", type=_arg(lambda t: _at_least_one(t), "factor"), default=1.0,
                   help="one worker's compute takes this many times as long (default 1)")


def _at_least_one(text: str) -> float:
    v = float(text)
    if not (math.isfinite(v) and v >= 1):
        raise ValueError(f"expected a finite number >= 1, got {text!r}")
    return v


def _check_inputs(args) -> None:
    """The files the model options name, read before any work (ValueError naming the option)."""
    for opt, path in (("--profile", args.profile), ("--kernels-json", args.kernels_json)):
        if path is not None and not os.path.isfile(path):
            why = "is a directory" if os.path.isdir(path) else "No such file"
            raise ValueError(f"{opt} {path}: {why}")


def _profile(args):
    """The profile the model prices with (see :func:`_resolve`)."""
    return _resolve(args)[0]


def _resolve(args):
    """The profile the model prices with, and a sentence saying where its inputs came from:
    measured on this machine (date), given, a default, or the shipped reference profile."""
    from gradcomp.lab.plan.machine import this_machine
    from gradcomp.lab.plan.profile import Profile

    given = args.kernels_json or args.kernel_gbps
    if args.profile:
        try:
            prof = Profile.load(args.profile)
        except (OSError, ValueError) as e:
            raise ValueError(f"--profile {args.profile}: {getattr(e, 'strerror', None) or e}") from None
        machine = prof.source.get("machine")
        on = f" (measured on {machine}, {prof.source.get('measured')})" if machine else ""
        kernels, latency = f"kernels from --profile {args.profile}{on}", f"from --profile {args.profile}"
    elif given:
        prof, kernels, latency = Profile(), "", "a default (TCP within one data centre)"
    else:
        prof, origin = this_machine(args.recalibrate, _measuring_bar())
        if origin.kind == "measured":
            kernels = (f"kernels measured on this machine ({origin.when}; cached in {origin.path}; "
                       "--recalibrate measures again)")
            latency = "a default (TCP within one data centre)"
        else:
            kernels = (f"kernels from the shipped reference profile of another machine (gradcomp's "
                       f"development host), as this one could not be measured ({origin.why}); "
                       "`gradcomp plan calibrate` measures yours")
            latency = "from the shipped reference profile"
    # other kernels replace the measured rates and their per-call costs together
    if args.kernels_json:
        k = Profile.from_kernels_json(args.kernels_json, device=args.kernels_device)
        prof.kernels, prof.call_s, prof.source = k.kernels, k.call_s, {**prof.source, **k.source}
        kernels = f"kernels given (--kernels-json {args.kernels_json})"
    if args.kernel_gbps:
        k = Profile.roofline(args.kernel_gbps)
        prof.kernels, prof.call_s, prof.source = k.kernels, k.call_s, {**prof.source, **k.source}
        kernels = f"kernels given (--kernel-gbps {args.kernel_gbps:g}, every op at that memory bandwidth)"
    if args.alpha_us:
        prof.alpha_s = args.alpha_us * 1e-6
        prof.source = {**prof.source, "alpha": "--alpha-us"}
        latency = "given (--alpha-us)"
    where = (f"inputs: {kernels}; latency {prof.alpha_s * 1e6:,.1f} us per message, {latency}"
             + ("" if args.alpha_us else "; --alpha-us sets yours") + "; link rates as given.")
    return prof, where


def _measuring_bar():
    """A progress callback on stderr for the first-use measurement (a line when not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    console = Console(stderr=True)
    state = {}

    def on_progress(done: int, total: int) -> None:
        if "bar" not in state:
            console.print("measuring this machine's kernel rates once (cached for later runs)", highlight=False)
            state["bar"] = Progress(TextColumn("kernels"), BarColumn(), MofNCompleteColumn(), console=console,
                                    transient=True)
            state["bar"].start()
            state["task"] = state["bar"].add_task("", total=total)
        state["bar"].update(state["task"], completed=done)
        if done >= total:
            state["bar"].stop()
    return on_progress


def _build(sub: str | None) -> argparse.ArgumentParser:
    nodes, links, params = _lists()
    if sub is None:
        p = _Parser(prog="gradcomp plan", description=(
            "Project the step time of data-parallel training over node counts, links and model sizes "
            "with gradcomp's alpha-beta model (subcommands: recommend, calibrate, validate; "
            "gradcomp plan SUBCOMMAND --help)."))
        p.add_argument("--nodes", type=_arg(nodes, "nodes"), default=[16, 64, 256, 1024],
                       help="data-parallel worker counts (default 16,64,256,1024)")
        p.add_argument("--link", type=_arg(links, "link"), default=links("10gbit,100gbit"),
                       help="link rates (default 10gbit,100gbit)")
        p.add_argument("--params", type=_arg(params, "params"), default=[25_000_000, 10**9, 7 * 10**9],
                       help="model sizes in parameters, suffixes k M B (default 25M,1B,7B)")
        p.add_argument("--compute-ms", type=_arg(_positive, "ms"),
                       help="one worker's forward + backward per step in ms (default: 6 params samples / flops)")
        p.add_argument("--samples", type=_arg(_int_pos, "samples"), default=8192,
                       help="samples (tokens) per worker step for the derived compute time (default 8192)")
        p.add_argument("--flops", type=_arg(_positive, "flops"), default=4e14,
                       help="sustained FLOP/s per worker for the derived compute time (default 4e14)")
        p.add_argument("--out", default="plan-results",
                       help="directory for plan.json and plan.png (default plan-results)")
        _model_options(p)
        tier_options(p, _arg(_int_pos, "ranks"), _arg(_positive, "alpha"))
        return p
    p = _Parser(prog=f"gradcomp plan {sub}")
    if sub == "recommend":
        p.description = "Name the mode, compressor and algorithm the model expects to train fastest."
        p.add_argument("--nodes", type=_arg(_int_pos, "nodes"), required=True, metavar="N",
                       help="data-parallel workers (GPUs or processes), each computing a gradient per step")
        p.add_argument("--link", type=_arg(lambda t: links(t)[0], "link"), required=True, metavar="RATE",
                       help="the network rate between workers: 100mbit, 1gbit, 10gbit, 100gbit, ...")
        p.add_argument("--params", type=_arg(lambda t: _parse_one(params, t), "params"), required=True,
                       metavar="P", help="model size in parameters, suffixes k M B (e.g. 25M, 1B)")
        p.add_argument("--compute-ms", type=_arg(_positive, "ms"), required=True, metavar="MS",
                       help="one worker's forward + backward per step in milliseconds (its step time "
                            "when it trains alone)")
        p.add_argument("--max-gap", type=_arg(_nonneg, "gap"), default=0.5,
                       help="largest accuracy gap in points a compressor may cost (default 0.5)")
        p.add_argument("--max-staleness", type=_arg(_nonneg, "staleness"), default=None,
                       help="largest mean staleness accepted for async (default: no bound, as the "
                            "parameter server's own default)")
        p.add_argument("--compressors", type=_arg(parse_plan_names, "compressors"), default=None, metavar="LIST",
                       help="compressors to rank (default: those whose accuracy gap was measured)")
        _model_options(p)
        tier_options(p, _arg(_int_pos, "ranks"), _arg(_positive, "alpha"))
    elif sub == "calibrate":
        p.description = "Measure alpha, beta and the kernel rates here; write a JSON profile."
        p.add_argument("--link", default="none", help="none (loopback) or a shaped rate such as 1gbit")
        p.add_argument("--topology", type=_arg(_topology, "topology"), default=None, metavar="HxR",
                       help="a two-tier emulated cluster of H hosts of R ranks (H >= 2, a shaped --link): "
                            "the link is measured between two hosts, the intra-host tier between two "
                            "ranks of one host (R >= 2), each with its configured and achieved rate")
        p.add_argument("--intra-link", default="none",
                       help="with --topology: the intra-host rate (default none: unshaped)")
        p.add_argument("--out", default="gradcomp-profile.json",
                       help="profile file to write (default gradcomp-profile.json)")
        p.add_argument("--repeats", type=_arg(_int_pos, "repeats"), default=9,
                       help="timed rounds per message size and kernel (medians; default 9)")
        p.add_argument("--kernel-numel", type=_arg(_int_pos, "numel"), default=2**22,
                       help="float32 elements each kernel is timed on (default 2**22)")
        p.add_argument("--timeout", type=_arg(_positive, "timeout"), default=300.0,
                       help="seconds allowed for the measurement (default 300)")
    else:
        p.description = "Predicted vs measured step time and idle share of a time study's runs."
        p.add_argument("results", help="directory holding results.json (or the file)")
        p.add_argument("--json", help="also write the comparison to this file")
        p.add_argument("--save-profile", help="write the profile used, with the median errors recorded in "
                                              "its fit (recommend then states them), to this file")
        p.add_argument("--breakdown", action="store_true",
                       help="also print, per scenario, mode and compressor, the measured phases against "
                            "the model's terms (compute, wait, codec, comm, apply)")
        p.add_argument("--fit-seeds", type=_arg(lambda t: [_nonneg_int(x) for x in t.split(",")], "seeds"),
                       help="fit the host's scheduling constants on the runs of these seeds (e.g. 0) and "
                            "report the error on the other runs")
        p.add_argument("--host-cores", type=_arg(_int_pos, "cores"),
                       help="cores of the host the runs shared (default: the results' or the profile's)")
        p.add_argument("--no-host", action="store_true",
                       help="leave out the shared-host terms (every rank priced as if it had a core to itself)")
        _model_options(p)
    return p


def _parse_one(parse_many, text):
    if len(values := parse_many(text)) != 1:
        raise ValueError(f"expected one value, got {text!r}")
    return values[0]


def _console():
    """Standard output: in a terminal, sentences wrap at its width; in a pipe each stays one line
    (for grep). Tables are printed with ``soft_wrap=False``: at most 80 columns either way."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=not sys.stdout.isatty())


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _setting_kw(args) -> dict:
    return {"straggler_cv": args.straggler_cv or 0.0, "straggler_factor": args.straggler_factor,
            "bucket_bytes": int(args.bucket_mb * 2**20), **tier_kw(args)}


# ---- subcommands ---------------------------------------------------------------------

def _project(args) -> int:
    from gradcomp._validate import writable_dir
    from gradcomp.lab.plan import tables
    from gradcomp.lab.plan.project import plot, project

    writable_dir("--out", args.out)
    prof, where = _resolve(args)
    cv = 0.2 if args.straggler_cv is None else args.straggler_cv
    compute = args.compute_ms / 1e3 if args.compute_ms else None
    rows = project(args.nodes, args.link, args.params, prof, compute_s=compute, samples=args.samples,
                   flops=args.flops, straggler_cv=cv, servers=args.servers,
                   straggler_factor=args.straggler_factor, bucket_bytes=int(args.bucket_mb * 2**20),
                   **tier_kw(args))
    con = _console()
    con.print(where)
    for t in tables.projection_tables(rows, cv):
        con.print(t, soft_wrap=False)
    con.print(tables.PROJECTION_LEGEND, style="dim")
    con.print(tables.speedup_table(rows), soft_wrap=False)
    with open(os.path.join(args.out, "plan.json"), "w") as f:
        json.dump({"profile": prof.to_dict(), "rows": rows}, f, indent=1)
    plot(rows, os.path.join(args.out, "plan.png"))
    con.print(f"wrote {os.path.join(args.out, 'plan.json')}, {os.path.join(args.out, 'plan.png')}")
    return 0


def _recommend(args) -> int:
    from gradcomp.lab.plan.model import Setting
    from gradcomp.lab.plan.recommend import recommend
    from gradcomp.lab.units import format_count

    prof, where = _resolve(args)
    name, beta = args.link
    s = Setting(nodes=args.nodes, link_bytes_per_s=beta, params=args.params, compute_s=args.compute_ms / 1e3,
                servers=args.servers or max(1, args.nodes // 8), **_setting_kw(args))
    try:
        rec = recommend(s, prof, max_gap=args.max_gap, max_staleness=args.max_staleness, compressors=args.compressors)
    except ValueError as e:
        print(f"gradcomp plan recommend: error: {e}", file=sys.stderr)
        return 2
    con = _console()
    strag = (f"; compute varies between workers with CV {s.straggler_cv:g}" if s.straggler_cv else "") + (
        f"; one worker computes {s.straggler_factor:g}x as long" if s.straggler_factor != 1 else "")
    con.print(f"setting: {args.nodes} workers on {name} links ({beta / 1e6:,.1f} MB/s), a "
              f"{format_count(args.params)}-parameter model, {args.compute_ms:g} ms of compute per worker "
              f"step{strag}.")
    con.print(where)
    _say(con, rec, prof)
    return 0


def _how_long(p) -> str:
    """How long the choice takes to apply one gradient from every worker, in words."""
    from gradcomp.lab.plan.tables import duration

    if p.mode == "sync":
        return f"{duration(p.step_s)} per step"
    return (f"{duration(p.nodes / p.throughput)} to apply one gradient from each of the {p.nodes} workers "
            f"({p.throughput:,.1f} gradients/s)")


def _say(con, rec, prof) -> None:
    """The recommendation as sentences a user acts on, then its runner-up, baseline and uncertainty."""
    from gradcomp.lab.plan.tables import duration

    best, t = rec.best, rec.seconds  # t(p): seconds to apply one gradient from every worker

    def what(p):
        return f"{p.mode} {p.compressor} on {p.algorithm}"
    stale = f", gradients {best.staleness_mean:.1f} updates stale on average" if best.mode == "async" else ""
    gain = ("no compression is the fastest here" if (best.compressor, best.algorithm) == ("none", "ring")
            else f"{t(rec.baseline) / t(best):.2f}x faster than no compression")
    con.print(f"[bold]recommended: {what(best)}[/bold]: {_how_long(best)}, {gain}; communication not hidden "
              f"by compute takes "
              f"{_pct(best.comm_share)} of a step, waiting for slower workers {_pct(best.idle_share)}, and each "
              f"worker sends {best.bytes_sent / 1e6:,.2f} MB per step{stale}.")
    if rec.runner_up is not None:
        gain = t(rec.runner_up) / t(best) - 1
        con.print(f"runner-up: {what(rec.runner_up)}: {_how_long(rec.runner_up)} ({100 * gain:.1f}% slower)")
    con.print(f"no compression: {what(rec.baseline)}: {_how_long(rec.baseline)} "
              f"({t(rec.baseline) / t(best):.2f}x the recommended time)")
    lo, hi = rec.time_range_s
    con.print(f"uncertainty: with latency x0.5..x2, bandwidth x0.8..x1.2, kernel rates x0.5..x2 and compute "
              f"x0.8..x1.2 the recommended choice takes {duration(lo)} to {duration(hi)} and stays first in "
              f"{rec.stays_best} of {rec.cases} cases")
    val = prof.fit.get("validation_step_mdape_pct")
    if val is not None:
        con.print(f"the profile's validation: median step-time error {val:.1f}% over "
                  f"{prof.fit.get('validation_runs')} measured runs ({prof.fit.get('validation_results')})")
    else:
        con.print("the profile carries no validation against measured runs "
                  "(gradcomp plan validate DIR --save-profile FILE records one)")
    if best.mode == "async":
        con.print("note: accuracy at that staleness is not modelled; bound it with --max-staleness")
    for p, why in rec.excluded:
        con.print(f"excluded: {what(p)}: {why}")


def _topology(text: str) -> tuple[int, int]:
    from gradcomp.lab.units import parse_topology

    hosts, per = parse_topology(text)
    if hosts < 2:
        raise ValueError(f"topology needs at least 2 hosts to measure a link between them, got {text!r}")
    return hosts, per


def _calibrate(args) -> int:
    from gradcomp.lab.plan import calibrate as C
    from gradcomp.lab.units import parse_rate

    _writable_file("--out", args.out)
    link = args.link.strip().lower()
    sizes = C.sizes_for(None)
    intra, cluster = None, None
    if link != "none":
        try:
            sizes = C.sizes_for(parse_rate(link, "--link") / 8)
            intra_rate = None if args.intra_link.strip().lower() == "none" else parse_rate(args.intra_link,
                                                                                            "--intra-link") / 8
        except ValueError as e:
            print(f"gradcomp plan calibrate: error: {e}", file=sys.stderr)
            return 2
        try:
            from gradcomp.lab.cluster import LocalCluster
        except ImportError:
            print("gradcomp plan calibrate: error: --link needs gradcomp.lab.cluster (the emulated cluster), "
                  "which is not available in this installation; use --link none for loopback",
                  file=sys.stderr)
            return 2
        hosts, per = args.topology or (2, 1)
        shape = dict(hosts=hosts, ranks_per_host=per) if args.topology else dict(world_size=2)
        if per > 1 and intra_rate is not None:
            shape["intra_rate"] = args.intra_link.strip().lower()
        with LocalCluster(**shape, rate=link) as c:
            # a pair on two hosts: the link, then (its first rank) the kernels
            results = c.run_on(C.measure, [0, per], sizes, args.repeats, args.timeout, args.kernel_numel,
                               timeout=args.timeout * 2 + 600)
            if per > 1:  # a pair on one host: the intra-host tier
                tier = c.run_on(C.measure_link, [0, 1], C.sizes_for(intra_rate),
                                args.repeats, args.timeout, timeout=args.timeout * 2 + 60)
                name = args.intra_link.strip().lower()
                intra = {**C.link_profile(tier, name), "link": name}
            cluster = c.describe()
    elif args.topology is not None or args.intra_link.strip().lower() != "none":
        print("gradcomp plan calibrate: error: --topology and --intra-link need a shaped --link "
              "(e.g. --link 100mbit)", file=sys.stderr)
        return 2
    else:
        from gradcomp.launch import launch

        results = launch(C.measure, 2, (sizes, args.repeats, args.timeout, args.kernel_numel),
                         timeout=args.timeout * 2 + 600)
    _write_profile(args, C.link_profile(results, link), results[0]["kernels"], link, intra, cluster)
    return 0


def _write_profile(args, fitted: dict, kern: dict, link: str, intra: dict | None, cluster: dict | None) -> None:
    from gradcomp.lab.plan.host import Host
    from gradcomp.lab.plan.profile import Profile

    source = {**kern["source"], "link": f"ping-pong over gradcomp p2p, link {link}",
              "machine": socket.gethostname(), "measured": time.strftime("%Y-%m-%d %H:%M")}
    if cluster is not None:
        source["cluster"] = cluster  # configured and achieved rates of both tiers
    prof = Profile(alpha_s=fitted["alpha_s"], beta_bytes_per_s=fitted["beta_bytes_per_s"], link=link,
                   kernels=kern["kernels"], call_s=kern["call_s"], fit=fitted["fit"],
                   host=Host(os.cpu_count() or 1), source=source, intra=intra,
                   topology=cluster["topology"] if cluster is not None and intra is not None else None)
    prof.save(args.out)
    print(f"alpha {prof.alpha_s * 1e6:.1f} us, beta {prof.beta_bytes_per_s / 1e9:.3f} GB/s "
          f"({8 * prof.beta_bytes_per_s / 1e9:.2f} Gbit/s), r2 {fitted['fit']['r2']:.4f}; "
          f"int8 compress {prof.kernels['int8.compress'] / 1e6:.0f} M elements/s; wrote {args.out}")
    if intra is not None:
        print(f"intra-host ({prof.topology}): alpha {intra['alpha_s'] * 1e6:.1f} us, beta "
              f"{intra['beta_bytes_per_s'] / 1e9:.3f} GB/s ({8 * intra['beta_bytes_per_s'] / 1e9:.2f} Gbit/s)")


def _writable_file(name: str, path: str) -> str:
    """ValueError naming ``name`` unless a file can be written at ``path`` (its folder is
    created if needed); checked before any work."""
    from gradcomp._validate import writable_dir

    if os.path.isdir(path):
        raise ValueError(f"{name} {path} is a directory; give a file name")
    writable_dir(name, os.path.dirname(os.path.abspath(path)))
    return path


def _validation_profile(args, data: dict, base: str):
    """The profile ``plan validate`` prices the runs with: the one given, else the results'
    own, else the shipped reference profile (said to be another machine's)."""
    from gradcomp.lab.plan.validate import results_profile

    if args.profile or args.kernels_json or args.kernel_gbps:
        return _profile(args)
    if "profile" in data:
        return results_profile(data, base)
    # the runs' own latency is a loopback's: a measured-here profile's default would not fit it
    from gradcomp.lab.plan.profile import Profile

    prof = Profile.load(DEFAULT_PROFILE)
    if args.alpha_us:
        prof.alpha_s = args.alpha_us * 1e-6
    print(f"profile: the shipped reference profile of another machine ({DEFAULT_PROFILE}); "
          "`gradcomp plan calibrate --out p.json` measures this one, --profile p.json uses it")
    return prof


def _validate(args) -> int:
    from gradcomp.lab.plan.host import Host
    from gradcomp.lab.plan import tables
    from gradcomp.lab.plan.validate import (TERMS, summary, breakdown, fit_host, load_results,
                                        validate_runs)

    data = load_results(args.results)
    base = args.results if os.path.isdir(args.results) else os.path.dirname(args.results)
    prof = _validation_profile(args, data, base)
    if args.no_host:  # neither the profile's host nor the one the runs recorded
        prof.host = None
        data = {**data, "host": None, "runs": [{**r, "host": None} for r in data["runs"]]}
    elif args.host_cores:
        h = prof.host
        prof.host = Host(args.host_cores, h.slice_s if h else 0.0, h.sched_cv if h else 0.0)
    con, fit = _console(), None
    if args.fit_seeds is not None and not args.no_host:
        prof.host, fit = fit_host(data, prof, args.fit_seeds)
        prof.fit = {**prof.fit, "host": {**fit, "results": os.path.abspath(args.results)}}
        con.print(f"host fitted on seeds {fit['seeds']} ({fit['runs']} runs): {prof.host.cores} cores, "
                  f"slice {1e3 * prof.host.slice_s:.2f} ms, hand-off CV {prof.host.sched_cv:.2f} per unit "
                  f"of oversubscription; on those runs: step {fit['step_mdape_pct']:.1f}%, "
                  f"idle {fit['idle_mdae_pts']:.1f} points")
    out = validate_runs(data, prof)
    for t in tables.validation_tables(out, args.results):
        con.print(t, soft_wrap=False)
    if args.breakdown:
        con.print(tables.breakdown_table(breakdown(out), TERMS), soft_wrap=False)
    for label, why in out["skipped"]:
        con.print(f"skipped {label}: {why}")
    if out["step_mdape_pct"] is None:
        print("gradcomp plan validate: error: no run could be validated", file=sys.stderr)
        return 2
    for name, sc in out["by_scenario"].items():
        con.print(f"  {name}: step {sc['step_mdape_pct']:.1f}%, idle {sc['idle_mdae_pts']:.1f} points "
                  f"({sc['runs']} runs)")
    con.print(f"median absolute error: step time {out['step_mdape_pct']:.1f}% over {len(out['rows'])} runs, "
              f"idle share {out['idle_mdae_pts']:.1f} points")
    if fit is not None:
        held = [r for r in out["rows"] if r["seed"] not in fit["seeds"]]
        step, idle = summary(held)
        if step is not None:
            con.print(f"on the runs not fitted ({len(held)}): step time {step:.1f}%, idle share {idle:.1f} points")
            out["held_out"] = {"runs": len(held), "step_mdape_pct": step, "idle_mdae_pts": idle}
    out["host"] = prof.host.to_dict() if prof.host is not None else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.save_profile:
        prof.fit = {**prof.fit, "validation_step_mdape_pct": out["step_mdape_pct"],
                    "validation_idle_mdae_pts": out["idle_mdae_pts"], "validation_runs": len(out["rows"]),
                    "validation_results": os.path.abspath(args.results)}
        prof.save(args.save_profile)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``gradcomp plan`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    args = _build(sub).parse_args(argv[1:] if sub else argv)
    run = {None: _project, "recommend": _recommend, "calibrate": _calibrate, "validate": _validate}[sub]
    try:
        if sub != "calibrate":
            _check_inputs(args)
        return run(args)
    except (OSError, ValueError) as e:
        print(f"gradcomp plan{' ' + sub if sub else ''}: error: {e}".replace("\n", " "), file=sys.stderr)
        return 2
