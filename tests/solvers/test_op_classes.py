"""The op-class table: convolutions are named exactly, so that casts are not weight matmuls."""

from __future__ import annotations

import pytest

from planner.solvers.op_classes import (
    CONVOLUTION_OPS,
    MATMUL,
    WEIGHT_MATMUL,
    op_class_tags,
    out_bytes,
    short_op_name,
    worth_keeping,
)
from tests.solvers.synthetic import GraphBuilder


@pytest.mark.parametrize(
    "op",
    [
        "aten.convolution.default",
        "aten.conv2d.default",
        "aten.cudnn_convolution.default",
        "conv_transpose2d",  # an fx graph's functional target
    ],
)
def test_convolutions_are_weight_matmuls(op):
    assert op_class_tags(short_op_name(op)) == {WEIGHT_MATMUL, MATMUL}


@pytest.mark.parametrize(
    "op",
    [
        "aten.convert_element_type.default",
        "prims.convert_element_type.default",
        "aten._convert_indices_from_coo_to_csr.default",
        "aten.convolution_backward.default",
        "aten.mkldnn_reorder_conv2d_weight.default",
    ],
)
def test_ops_named_conv_that_multiply_nothing_are_no_matmuls(op):
    """A substring rule ("conv" in the name) tagged these weight matmuls."""
    assert op_class_tags(short_op_name(op)) == set()
    assert short_op_name(op) not in CONVOLUTION_OPS


def test_selective_recomputes_a_cast_and_keeps_the_matmul_it_feeds():
    """Under autocast a cast sits before each matmul; selective keeps the matmul's output
    only (keeping the cast too would hold a second copy of the activation)."""
    g = GraphBuilder()
    g.add("x", out_bytes=4096, op="aten.embedding.default")
    g.add("cast", reads=("x",), out_bytes=2048, op="prims.convert_element_type.default")
    g.add("lin", reads=("cast",), saves=("cast",), out_bytes=2048, op="aten.mm.default")
    g.add("act", reads=("lin",), saves=("lin",), out_bytes=2048, op="aten.gelu.default")
    graph = g.build(outputs=("act",))
    produced = out_bytes(graph)
    kept = {n.name for i, n in enumerate(graph.nodes) if worth_keeping(graph, i, produced)}
    assert kept == {"lin"}
