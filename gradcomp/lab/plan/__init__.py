"""Planning: a step-time model of data-parallel training, calibrated and validated.

``gradcomp.lab.plan`` predicts where one training step's time goes at a scale we
cannot run here (16 to 1024 nodes) from a few measured numbers, and uses the
prediction to recommend a mode, compressor and algorithm:

* :mod:`~gradcomp.lab.plan.costs`: one allreduce per algorithm: exact wire bytes,
  messages, quantizations, seconds (alpha-beta, kernel time from measured rates);
* :mod:`~gradcomp.lab.plan.model`: the step: the parameter server's bytes, overlap
  of buckets with backward, stragglers, async throughput and staleness, the bubble;
* :mod:`~gradcomp.lab.plan.lognormal`: the expected maximum of lognormal compute times;
* :mod:`~gradcomp.lab.plan.host`: ranks sharing a host's cores (processor sharing,
  scheduling delay per exchange step, scattered hand-offs);
* :mod:`~gradcomp.lab.plan.profile`: alpha, beta and kernel rates (JSON);
* :mod:`~gradcomp.lab.plan.calibrate`: measuring them (ping-pong fit, kernel timings);
* :mod:`~gradcomp.lab.plan.validate`: predicted vs measured runs of the time study;
* :mod:`~gradcomp.lab.plan.project`, :mod:`~gradcomp.lab.plan.recommend`: the grid and the choice;
* :mod:`~gradcomp.lab.plan.cli`: ``gradcomp plan``.

Example::

    from gradcomp.lab.plan import Profile, Setting, predict
    prof = Profile.roofline(1000, alpha_s=20e-6)          # 1 TB/s kernels, 20 us messages
    s = Setting(nodes=64, link_bytes_per_s=100e9 / 8, params=10**9, compute_s=0.25)
    p = predict("sync", "int8", "ring", s, prof)
    print(p.step_s, p.comm_share, p.bytes_sent)
"""

from gradcomp._lazy import lazy_attributes

# loaded on first use: the model imports torch, and `gradcomp plan --help` must not wait for it
_EXPORTS = {
    "expected_max": "gradcomp.lab.plan.lognormal",
    "Host": "gradcomp.lab.plan.host",
    "Profile": "gradcomp.lab.plan.profile",
    **{name: "gradcomp.lab.plan.model" for name in (
        "ALGORITHMS", "CODECS", "MODES", "PlanCodec", "Prediction", "Setting", "allreduce_bytes",
        "allreduce_seconds", "async_throughput", "bubble_fraction", "pipeline_step", "predict",
        "ps_bytes")},
}
__getattr__, __dir__ = lazy_attributes(__name__, globals(), _EXPORTS)

__all__ = ["ALGORITHMS", "CODECS", "MODES", "PlanCodec", "Host", "Prediction", "Profile", "Setting", "allreduce_bytes",
           "allreduce_seconds", "async_throughput", "bubble_fraction", "expected_max", "pipeline_step",
           "predict", "ps_bytes"]
