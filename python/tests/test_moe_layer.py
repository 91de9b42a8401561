"""Runs examples/moe_layer.py on the host backend: the training step (HT forward and
backward) and the decode step (LL forward) on 2 and 3 processes, and the training step
across 2 gin-ep nodes of 2 processes, each checked against a dense computation."""

import importlib.util
import os

import _dist

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "moe_layer.py")


def _example():
    spec = importlib.util.spec_from_file_location("moe_layer", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def moe_worker(rank, world):
    _example().check(rank, world)


def decode_worker(rank, world):
    _example().decode_check(rank, world)


def test_moe_layer_2_ranks():
    _dist.run(2, moe_worker)


def test_moe_layer_decode_3_ranks():
    _dist.run(3, decode_worker)


def test_moe_layer_across_nodes(monkeypatch):
    """The training step with HT across 2 gin-ep nodes of 2 ranks on the host backend (rail
    forward, node-first combine), checked against the same dense computation."""
    monkeypatch.setenv("GIN_EP_NODE_SIZE", "2")
    _dist.run(4, moe_worker)
