"""The emulated cluster's old import path, kept so that ``from gradcomp.cluster import
LocalCluster`` works: the module is :mod:`gradcomp.lab.cluster`, and this name is that module."""

import importlib
import sys

# an alias, not a copy: ``gradcomp.cluster`` and ``gradcomp.lab.cluster`` are one module object
sys.modules[__name__] = importlib.import_module("gradcomp.lab.cluster")
