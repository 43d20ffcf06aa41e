"""kvoffload.profile: a traced decode step's device time by the runtime's named scopes (the CLO paper's Fig. 11 parts
from the real step). On the CPU the trace's events are XLA's thunks; the same reader serves a GPU's kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvoffload.profile import _common, part_of, scope_breakdown, scope_path, trace_programs


def test_scope_paths_and_parts_from_op_names():
    assert scope_path("jit(layer_body)/pool_attention/retrieval/while/body/jit(choose)/sort") == \
        "pool_attention/retrieval"
    assert scope_path("jit(f)/dot_general") == ""
    assert [part_of(p) for p in ("pool_attention/retrieval", "pool_attention/transfer", "pool_attention/cache",
                                 "pool_attention/attention", "pool_attention", "tail_attention", "qkv", "out_mlp",
                                 "embed", "logits", "")] == \
        ["retrieval", "transfer", "cache management", "attention", "attention", "attention",
         "projections and MLP", "projections and MLP", "embedding and logits", "embedding and logits", "other"]
    assert _common({"pool_attention/retrieval", "pool_attention/transfer"}) == "pool_attention"
    assert _common({"qkv", "out_mlp"}) == "?"


def test_a_fusion_without_an_op_name_takes_its_fused_instructions_scope():
    """XLA makes some fusions without metadata (a GEMM fusion of an H200 step, a concatenation of two weights): such
    a kernel takes the common scope of the instructions inside its fused computation, not "other"."""
    from kvoffload.profile import ProgramScopes

    text = """HloModule jit_layer_body

%fused_dot (p0: bf16[1,64], p1: bf16[64,64]) -> bf16[1,64] {
  %p0 = bf16[1,64]{1,0} parameter(0)
  %p1 = bf16[64,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[1,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_type="dot_general" op_name="jit(layer_body)/out_mlp/jit(linear)/dot_general"}
}

%fused_mixed (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %a = f32[8]{0} exp(%p0), metadata={op_name="jit(layer_body)/qkv/exp"}
  ROOT %b = f32[8]{0} log(%a), metadata={op_name="jit(layer_body)/out_mlp/log"}
}

ENTRY %main (x: bf16[1,64], w: bf16[64,64], y: f32[8]) -> (bf16[1,64], f32[8]) {
  %x = bf16[1,64]{1,0} parameter(0)
  %w = bf16[64,64]{1,0} parameter(1)
  %y = f32[8]{0} parameter(2)
  %gemm_fusion_dot.14 = bf16[1,64]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot
  %loop_fusion = f32[8]{0} fusion(%y), kind=kLoop, calls=%fused_mixed
  ROOT %t = (bf16[1,64]{1,0}, f32[8]{0}) tuple(%gemm_fusion_dot.14, %loop_fusion)
}
"""
    prog = ProgramScopes("jit_layer_body", text)
    assert prog.scope_of("gemm_fusion_dot.14", "gemm_fusion_dot_14") == "out_mlp"
    assert prog.scope_of(None, "gemm_fusion_dot_14") == "out_mlp"  # inside a command buffer: by kernel name
    assert prog.scope_of("loop_fusion", "loop_fusion") == "?"  # two scopes inside, none in common: unattributed


@pytest.mark.slow  # slow only: no default test traces a program and splits it by scope
def test_a_traced_program_splits_by_its_named_scopes(tmp_path):
    @jax.jit
    def f(x, w):
        with jax.named_scope("pool_attention"):
            with jax.named_scope("retrieval"):
                s = jnp.tanh(x @ w)
            with jax.named_scope("attention"):
                s = jnp.sort(s, axis=0)
        with jax.named_scope("out_mlp"):
            return jnp.exp(s).sum(0) * 3

    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)), jnp.float32)
    f(x, x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            f(x, x).block_until_ready()
    names = [name for name, _ in trace_programs(str(tmp_path)).values()]
    assert "jit_f" in names
    got = scope_breakdown(str(tmp_path), steps=2)
    prog = got["programs"]["jit_f"]
    assert set(prog["scopes"]) <= {"pool_attention/retrieval", "pool_attention/attention", "out_mlp"}
    assert prog["scopes"].get("pool_attention/retrieval", 0) > 0  # the matmul (XLA may fuse the rest into it)
    assert got["unattributed_s"] == 0 and abs(sum(prog["scopes"].values()) - prog["seconds"]) < 1e-12


@pytest.mark.slow  # slow only: no default test checks a clo step's fig. 11 parts
def test_a_clo_decode_step_has_every_fig11_part(tmp_path):
    """A clo step (Quest, one program per layer): its trace has time under retrieval, transfer,
    cache management and attention, and under the layers' projections and MLP; every kernel is attributed to
    a scope (on the CPU; on a GPU at least 90% of the time)."""
    from test_offload import QUEST
    from test_tokenselect import _decode

    from kvoffload.models import tiny_random_model

    model = tiny_random_model("llama", seed=1, num_hidden_layers=3)
    pol, _, state = _decode(model, "clo", 2, **QUEST)
    tok = jnp.zeros((state.batch,), jnp.int32)
    _, state = pol.decode_step(model, state, tok)  # compiled
    with jax.profiler.trace(str(tmp_path)):
        logits, state = pol.decode_step(model, state, tok)
        logits.block_until_ready()
    got = scope_breakdown(str(tmp_path))
    for part in ("retrieval", "transfer", "cache management", "attention", "projections and MLP",
                 "embedding and logits"):
        assert got["parts"].get(part, 0) > 0, (part, got["parts"])
    total = sum(got["parts"].values())
    # the CPU's thunks are all XLA's instructions; a GPU's library kernels inside a command buffer that spans
    # several scopes have no scope of their own
    assert got["unattributed_s"] <= (0 if jax.default_backend() == "cpu" else 0.1 * total), got


def test_plot_of_a_bench_result_with_scope_breakdowns(tmp_path, capsys):
    """plot_scope_breakdown.py: the mean layer's bar of each bench_selection result's traced run."""
    import json

    from script_loader import script_module

    b = {"per_layer": {"retrieval": 2e-6, "attention": 5e-6, "other": 1e-6}}
    doc = {"meta": {"device": "cpu", "shape": "tiny"},
           "runs": [{"variant": "clo_quest", "context": 131072, "batch": 1, "scope_breakdown": b},
                    {"variant": "full", "context": 131072, "batch": 1}]}  # no trace: no bar
    (tmp_path / "sel.json").write_text(json.dumps(doc))
    with script_module("plot_scope_breakdown") as ps:
        assert ps.main([str(tmp_path / "sel.json"), "--out", str(tmp_path / "b.png")]) == 0
    out = capsys.readouterr().out
    assert "| clo_quest 128K b1: mean layer | 2.0 | 0.0 | 0.0 | 5.0 |" in out and "full" not in out
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_gpu_command_buffer_kernels_are_attributed_from_a_recorded_h200_trace():
    """The GPU's naming, from a recorded H200 trace (JAX 0.11.2; `tests/data/h200_clo_loop_trace`: a tiny
    llama's looped clo Quest step, the programs' HLO with its op_names and the kernel events): inside a command
    buffer every event names the buffer, fusions' kernels are "loop_add_fusion_1" for "loop_add_fusion.1", a
    sort's kernel is named after the sort inside its wrapper fusion, Pallas kernels by their pallas_call name
    ("kvo_stacked_linear__1": Triton's second kernel of one name), copies "memcpy32_post". Every kernel is
    attributed; one Pallas kernel used in two scopes (the stacked linear: qkv, then out_mlp) follows the
    schedule."""
    import gzip
    import json
    import pathlib

    from kvoffload.profile import Cursor, ProgramScopes, attribute

    data = pathlib.Path(__file__).parent / "data" / "h200_clo_loop_trace"
    progs = {}
    for f in sorted(data.glob("jit_*.txt.gz")):
        name = f.name[:-len(".txt.gz")]
        progs[len(progs)] = ProgramScopes(name, gzip.open(f, "rt").read())
    events = json.loads(gzip.open(data / "events.json.gz", "rt").read())  # [stream, kernel, start ns, ns, stats]
    events.sort(key=lambda e: e[2])
    tuples = [(None, e[4]["hlo_module"], e[4].get("hlo_op"), e[1], e[2], e[3]) for e in events]
    got = attribute(tuples, progs)
    assert got["unattributed_s"] == 0, got["unattributed_kernels"]
    loop = got["programs"]["jit_loop_layers"]["parts"]
    for part in ("retrieval", "transfer", "cache management", "attention", "projections and MLP"):
        assert loop.get(part, 0) > 0, (part, loop)
    # the looped layers' Pallas kernels, in order, against their scopes (2 looped layers)
    loop_prog = next(p for p in progs.values() if p.name == "jit_loop_layers")
    cursor, seen = Cursor(loop_prog), []
    for _, module, hlo_op, kernel, _, _ in tuples:
        if module == "jit_loop_layers":
            scope = loop_prog.scope_of(hlo_op, kernel, cursor)
            if kernel.startswith("kvo_"):
                seen.append((kernel, scope))
    layer = seen[:len(seen) // 2]
    assert seen == layer * 2 and layer[0] == ("kvo_stacked_linear", "qkv")
    assert ("kvo_refill_rows", "pool_attention/transfer") in layer
    assert ("kvo_sparse_attention", "pool_attention/attention") in layer
    assert [s for k, s in layer if k.startswith("kvo_stacked_linear")][1:] == ["out_mlp"] * 4
