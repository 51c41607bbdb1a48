"""Hand-built CostGraphs: random chains and DAGs for tests, a GPT-like graph for benchmarks.

Pure Python like the rest of ``solvers/``, so solver tests run without torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from planner.solvers.costgraph import CostGraph, Node, Tensor
from planner.solvers.op_classes import op_class_tags, short_op_name


@dataclass
class GraphBuilder:
    """Adds nodes in execution order; each allocates storages that later nodes read or save."""

    nodes: list[Node] = field(default_factory=list)
    tensors: list[dict] = field(default_factory=list)
    by_name: dict[str, int] = field(default_factory=dict)

    def add(
        self,
        name: str,
        reads: tuple[str, ...] = (),
        saves: tuple[str, ...] = (),
        out_bytes: int = 0,
        extra: dict[str, int] | None = None,
        op: str = "",
        module_path: str = "",
        fwd_flops: int = 0,
        param_grad_bytes: int = 0,
        grad: bool = True,
        fwd_temp_bytes: int = 0,
        bwd_temp_bytes: int = 0,
        writes: tuple[str, ...] = (),
    ) -> str:
        """Node ``name`` reading ``reads`` and saving ``saves`` (storage names; "name" is its
        own output) and allocating an output of ``out_bytes`` plus ``extra`` storages.
        ``writes``: storages among ``reads`` it writes in place (an in-place op allocates
        nothing: give it ``out_bytes=0``)."""
        i = len(self.nodes)
        outs = {name: out_bytes, **(extra or {})}
        for t_name, size in outs.items():
            if size > 0:
                self.by_name[t_name] = len(self.tensors)
                self.tensors.append(
                    dict(
                        name=t_name,
                        size_bytes=size,
                        producer=i,
                        users=[],
                        saved_by=[],
                        grad_bytes=size if grad else 0,
                        written_by=[],
                    )
                )
        in_idx = []
        for r in reads:
            t = self.tensors[self.by_name[r]]
            t["users"].append(i)
            in_idx.append(t["producer"])
        for s in saves:
            self.tensors[self.by_name[s]]["saved_by"].append(i)
        for w in writes:
            self.tensors[self.by_name[w]]["written_by"].append(i)
        moved = sum(self.tensors[self.by_name[r]]["size_bytes"] for r in reads) + out_bytes
        self.nodes.append(
            Node(
                name=name,
                op=op,
                inputs=tuple(sorted(set(in_idx))),
                module_path=module_path,
                fwd_flops=fwd_flops,
                bwd_flops=2 * fwd_flops,
                fwd_bytes_accessed=moved,
                bwd_bytes_accessed=2 * moved,
                fwd_temp_bytes=fwd_temp_bytes,
                bwd_temp_bytes=bwd_temp_bytes,
                param_grad_bytes=param_grad_bytes,
                tags=frozenset(op_class_tags(short_op_name(op))),  # as the estimators tag
                draws_random="dropout" in op,  # the estimators read torch's op tags
            )
        )
        return name

    def build(
        self, outputs: tuple[str, ...] = (), held_to_end: tuple[str, ...] = (), **rates
    ) -> CostGraph:
        tensors = tuple(
            Tensor(
                t["name"],
                t["size_bytes"],
                t["producer"],
                tuple(t["users"]),
                tuple(t["saved_by"]),
                t["grad_bytes"],
                t["name"] in outputs,
                held_to_end=t["name"] in held_to_end,
                written_by=tuple(t["written_by"]),
            )
            for t in self.tensors
        )
        return CostGraph(tuple(self.nodes), tensors, **rates)


def gpt_like_graph(
    n_layer: int = 12,
    d_model: int = 256,
    n_head: int = 4,
    seq_len: int = 256,
    batch: int = 8,
    vocab: int = 1024,
    fp_bytes: int = 4,
) -> CostGraph:
    """A GPT-ref-shaped CostGraph (explicit softmax attention, dropout, LayerNorm, residuals).

    Sizes and FLOPs follow the real shapes; saved tensors follow what autograd keeps
    (linear saves its input, softmax its output, dropout its mask, GELU its input).
    """
    g = GraphBuilder()
    bs, d = batch * seq_len, d_model
    x_b = bs * d * fp_bytes
    att_b = batch * n_head * seq_len * seq_len * fp_bytes
    mask_b = att_b // fp_bytes
    lin = lambda din, dout: 2 * bs * din * dout  # noqa: E731
    g.add(
        "emb",
        out_bytes=x_b,
        op="aten.embedding.default",
        module_path="tok_emb",
        param_grad_bytes=vocab * d * fp_bytes,
        grad=True,
    )
    g.add(
        "drop",
        reads=("emb",),
        saves=("drop.mask",),
        out_bytes=x_b,
        extra={"drop.mask": x_b // fp_bytes},
        op="aten.native_dropout.default",
        module_path="drop",
    )
    x = "drop"
    for j in range(n_layer):
        p = f"blocks.{j}"
        a = lambda n, p=p, **kw: g.add(f"{p}.{n}", **kw)  # noqa: E731
        ln1 = a(
            "ln_1",
            reads=(x,),
            saves=(x,),
            out_bytes=x_b,
            op="aten.layer_norm.default",
            module_path=f"{p}.ln_1",
            fwd_flops=5 * bs * d,
            param_grad_bytes=2 * d * 4,
        )
        qkv = a(
            "qkv",
            reads=(ln1,),
            saves=(ln1,),
            out_bytes=3 * x_b,
            op="aten.linear.default",
            module_path=f"{p}.attn.qkv",
            fwd_flops=lin(d, 3 * d),
            param_grad_bytes=(3 * d * d + 3 * d) * fp_bytes,
        )
        s = a(
            "scores",
            reads=(qkv,),
            saves=(qkv,),
            out_bytes=att_b,
            op="aten.matmul.default",
            module_path=f"{p}.attn",
            fwd_flops=2 * batch * seq_len * seq_len * d,
        )
        sc = a("scale", reads=(s,), out_bytes=att_b, op="aten.mul.Tensor", module_path=f"{p}.attn")
        mf = a(
            "mask",
            reads=(sc,),
            out_bytes=att_b,
            op="aten.masked_fill.Scalar",
            module_path=f"{p}.attn",
        )
        sm = a(
            "softmax",
            reads=(mf,),
            out_bytes=att_b,
            op="aten.softmax.int",
            module_path=f"{p}.attn",
            fwd_flops=0,
        )
        g.tensors[g.by_name[sm]]["saved_by"].append(len(g.nodes) - 1)
        dr = a(
            "attn_drop",
            reads=(sm,),
            saves=(f"{p}.attn_drop.mask",),
            out_bytes=att_b,
            extra={f"{p}.attn_drop.mask": mask_b},
            op="aten.native_dropout.default",
            module_path=f"{p}.attn.attn_drop",
        )
        av = a(
            "av",
            reads=(dr, qkv),
            saves=(dr, qkv),
            out_bytes=x_b,
            op="aten.matmul.default",
            module_path=f"{p}.attn",
            fwd_flops=2 * batch * seq_len * seq_len * d,
        )
        y = a("merge", reads=(av,), out_bytes=x_b, op="aten.clone.default", module_path=f"{p}.attn")
        pr = a(
            "proj",
            reads=(y,),
            saves=(y,),
            out_bytes=x_b,
            op="aten.linear.default",
            module_path=f"{p}.attn.proj",
            fwd_flops=lin(d, d),
            param_grad_bytes=(d * d + d) * fp_bytes,
        )
        rd = a(
            "resid_drop",
            reads=(pr,),
            saves=(f"{p}.resid_drop.mask",),
            out_bytes=x_b,
            extra={f"{p}.resid_drop.mask": x_b // fp_bytes},
            op="aten.native_dropout.default",
            module_path=f"{p}.attn.resid_drop",
        )
        x1 = a("add_1", reads=(x, rd), out_bytes=x_b, op="aten.add.Tensor", module_path=p)
        ln2 = a(
            "ln_2",
            reads=(x1,),
            saves=(x1,),
            out_bytes=x_b,
            op="aten.layer_norm.default",
            module_path=f"{p}.ln_2",
            fwd_flops=5 * bs * d,
            param_grad_bytes=2 * d * 4,
        )
        fc = a(
            "fc",
            reads=(ln2,),
            saves=(ln2,),
            out_bytes=4 * x_b,
            op="aten.linear.default",
            module_path=f"{p}.mlp.fc",
            fwd_flops=lin(d, 4 * d),
            param_grad_bytes=(4 * d * d + 4 * d) * fp_bytes,
        )
        ge = a(
            "gelu",
            reads=(fc,),
            saves=(fc,),
            out_bytes=4 * x_b,
            op="aten.gelu.default",
            module_path=f"{p}.mlp",
        )
        mp = a(
            "mlp_proj",
            reads=(ge,),
            saves=(ge,),
            out_bytes=x_b,
            op="aten.linear.default",
            module_path=f"{p}.mlp.proj",
            fwd_flops=lin(4 * d, d),
            param_grad_bytes=(4 * d * d + d) * fp_bytes,
        )
        md = a(
            "mlp_drop",
            reads=(mp,),
            saves=(f"{p}.mlp_drop.mask",),
            out_bytes=x_b,
            extra={f"{p}.mlp_drop.mask": x_b // fp_bytes},
            op="aten.native_dropout.default",
            module_path=f"{p}.mlp.drop",
        )
        x = a("add_2", reads=(x1, md), out_bytes=x_b, op="aten.add.Tensor", module_path=p)
    lnf = g.add(
        "ln_f",
        reads=(x,),
        saves=(x,),
        out_bytes=x_b,
        op="aten.layer_norm.default",
        module_path="ln_f",
        fwd_flops=5 * bs * d,
        param_grad_bytes=2 * d * 4,
    )
    logits_b = bs * vocab * fp_bytes
    head = g.add(
        "head",
        reads=(lnf,),
        saves=(lnf,),
        out_bytes=logits_b,
        op="aten.linear.default",
        module_path="head",
        fwd_flops=lin(d, vocab),
        param_grad_bytes=d * vocab * fp_bytes,
    )
    lsm = g.add("log_softmax", reads=(head,), out_bytes=logits_b, op="aten._log_softmax.default")
    g.tensors[g.by_name[lsm]]["saved_by"].append(len(g.nodes) - 1)
    g.add("nll", reads=(lsm,), saves=(lsm,), out_bytes=fp_bytes, op="aten.nll_loss_forward.default")
    return g.build(outputs=("nll",), flops_per_s=1e11, bytes_per_s=1e10)


def _random_costs(rng: random.Random, max_bytes: int, fwd_temp: bool = True) -> dict:
    """A random node's output size, FLOPs, parameter gradients and working sets."""
    costs = dict(
        out_bytes=rng.randint(1, max_bytes),
        fwd_flops=rng.randint(0, 100),
        param_grad_bytes=rng.choice((0, 0, rng.randint(1, 8))),
    )
    if fwd_temp:
        costs["fwd_temp_bytes"] = rng.choice((0, rng.randint(0, 8)))
    costs["bwd_temp_bytes"] = rng.choice((0, rng.randint(0, 8)))
    return costs


def random_chain(rng: random.Random, n: int, max_bytes: int = 64) -> CostGraph:
    """A chain: node i reads node i-1's output; random sizes, saves, FLOPs and temporaries."""
    g = GraphBuilder()
    prev: str | None = None
    for i in range(n):
        reads = (prev,) if prev else ()
        saves = tuple(s for s in reads if rng.random() < 0.7)
        if rng.random() < 0.3:
            saves += (f"n{i}",)
        g.add(
            f"n{i}",
            reads=reads,
            saves=saves,
            **_random_costs(rng, max_bytes),
        )
        prev = f"n{i}"
    return g.build(outputs=(prev,), flops_per_s=1.0, bytes_per_s=1e9)


def random_dag(rng: random.Random, n: int, max_bytes: int = 64, skip_p: float = 0.3) -> CostGraph:
    """A chain plus random skip edges: node i also reads some earlier outputs (skips); some
    nodes also allocate a storage held to the end of the step (like autocast's weight copies)."""
    g = GraphBuilder()
    held: list[str] = []
    for i in range(n):
        reads: tuple[str, ...] = ()
        if i:
            reads = (f"n{i - 1}",) + tuple(f"n{j}" for j in range(i - 1) if rng.random() < skip_p)
        saves = tuple(s for s in reads if rng.random() < 0.6)
        if rng.random() < 0.3:
            saves += (f"n{i}",)
        g.add(
            f"n{i}",
            reads=reads,
            saves=saves,
            **_random_costs(rng, max_bytes),
            extra={f"h{i}": rng.randint(1, 16)} if rng.random() < 0.2 else None,
        )
        if f"h{i}" in g.by_name:
            held.append(f"h{i}")
    return g.build(
        outputs=(f"n{n - 1}",), held_to_end=tuple(held), flops_per_s=1.0, bytes_per_s=1e9
    )


def random_inplace_chain(rng: random.Random, n: int, max_bytes: int = 64) -> CostGraph:
    """A chain in which about a third of the nodes are in-place ops (``relu_``): they allocate
    nothing and write the storage the chain last allocated, as ``x = relu_(linear(x))`` does."""
    g = GraphBuilder()
    current: str | None = None  # the storage the chain's value lives in
    for i in range(n):
        reads = (current,) if current else ()
        if current and rng.random() < 0.35:
            g.add(f"n{i}", reads=reads, saves=reads, writes=reads)  # writes, allocates nothing
            continue
        saves = tuple(s for s in reads if rng.random() < 0.7)
        g.add(
            f"n{i}",
            reads=reads,
            saves=saves,
            **_random_costs(rng, max_bytes, fwd_temp=False),
        )
        current = f"n{i}"
    return g.build(outputs=(current,), flops_per_s=1.0, bytes_per_s=1e9)


def with_saves(rng: random.Random, graph: CostGraph) -> CostGraph:
    """``graph`` as the estimator describes it: every node says whether its forward saves
    anything for backward (those saving a storage do; about a third of the others save only a
    weight), and about half the outputs of saving nodes are allocated after their last save (a
    linear's output). Recomputations then stop early (simulate's Rule 5)."""
    saving = {s for t in graph.tensors for s in t.saved_by}
    nodes = tuple(
        replace(nd, saves_for_backward=i in saving or rng.random() < 0.35)
        for i, nd in enumerate(graph.nodes)
    )
    tensors = tuple(
        replace(t, after_last_save=nodes[t.producer].saves_for_backward and rng.random() < 0.5)
        for t in graph.tensors
    )
    return replace(graph, nodes=nodes, tensors=tensors)


def with_quiet_nodes(rng: random.Random, graph: CostGraph) -> CostGraph:
    """:func:`with_saves`, and then about a third of the nodes save nothing at all (a cat, an
    add, a view) and have a heavy backward: regions that save nothing, or save only after some
    of their nodes, whose checkpoint frame dies before their backward ends (simulate's Rule
    2). Random graphs seldom put such a backward at the peak; these often do."""
    graph = with_saves(rng, graph)
    quiet = {i for i in range(len(graph.nodes)) if rng.random() < 0.35}
    nodes = tuple(
        replace(
            nd,
            saves_for_backward=False,
            bwd_temp_bytes=nd.bwd_temp_bytes + rng.randint(0, 96),
        )
        if i in quiet
        else nd
        for i, nd in enumerate(graph.nodes)
    )
    tensors = tuple(
        replace(
            t,
            saved_by=tuple(s for s in t.saved_by if s not in quiet),
            # a node that saves its own output allocates it before its last save
            after_last_save=t.after_last_save
            and t.producer not in quiet
            and t.producer not in t.saved_by,
        )
        for t in graph.tensors
    )
    return replace(graph, nodes=nodes, tensors=tensors)
