"""The lab: what measures, plans and demonstrates gradcomp, never imported by the library.

``gradcomp train | plan | bench`` (:mod:`gradcomp.lab.cli`), the training study
(:mod:`gradcomp.lab.study`), the step-time model (:mod:`gradcomp.lab.plan`), the
benchmarks (:mod:`gradcomp.lab.bench`), the emulated cluster (:mod:`gradcomp.lab.cluster`),
the parameter-server demo (:mod:`gradcomp.lab.ps_demo`) and the one parser of counts and link
rates (:mod:`gradcomp.lab.units`). The lab imports the library; the library never imports the lab.
"""

__all__ = ()
