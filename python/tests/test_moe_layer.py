"""Runs examples/moe_layer.py (forward and backward through dispatch/combine on 2
processes, checked against a dense computation)."""

import importlib.util
import os

import _dist

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "moe_layer.py")


def moe_worker(rank, world):
    spec = importlib.util.spec_from_file_location("moe_layer", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.check(rank, world)


def test_moe_layer_2_ranks():
    _dist.run(2, moe_worker)
