"""experiments/count_layer_kernels.py (kernels per layer program, from an XLA dump) on the CPU."""

import json
import sys

import jax
import pytest
from script_loader import script_module


def test_count_layer_kernels_counts_the_launches_of_a_dumped_program(tmp_path):
    """experiments/count_layer_kernels.py --run: a program under XLA's dump flags, then its entry computation's
    launching instructions counted by opcode and by scope (the named scope and the Pallas-like inner name)."""
    prog = tmp_path / "prog.py"
    prog.write_text(
        "import jax, jax.numpy as jnp\n"
        "@jax.jit\n"
        "def layer_body(x, w):\n"
        "    with jax.named_scope('mixing'):\n"
        "        y = jnp.tanh(x @ w)\n"
        "    return jax.lax.sort(y[0]) + jnp.exp(y).sum(0)\n"
        "layer_body(jnp.ones((8, 8)), jnp.ones((8, 8))).block_until_ready()\n"
        "jax.jit(lambda a: a + 1)(jnp.ones(3))\n")
    with script_module("count_layer_kernels") as ck:
        recs = ck.main([str(tmp_path / "dump"), "--run", f"{sys.executable} {prog}", "--out", str(tmp_path / "k.json")])
        assert [r["module"] for r in recs] == ["jit_layer_body"]  # the other jit's module is not a layer's
        r = recs[0]
        assert r["launches"] == sum(r["by_opcode"].values()) >= 2
        if jax.default_backend() == "cpu":  # XLA:GPU may fold the sort into a fusion or a library call
            assert r["by_opcode"].get("sort") == 1
        assert "parameter" not in r["by_opcode"] and any(s.startswith("mixing") for s in r["by_scope"])
        assert json.loads((tmp_path / "k.json").read_text())["modules"][0]["launches"] == r["launches"]
        # every launch listed, with the program's source lines (a fusion's: of the ops fused into it)
        assert len(r["launch_list"]) == r["launches"]
        lines = {src for launch in r["launch_list"] for src in launch["sources"]}
        assert "prog.py:5 (layer_body)" in lines and "prog.py:6 (layer_body)" in lines
        assert all(launch["shape"] for launch in r["launch_list"])
        assert "prog.py:5" in ck.table(recs, listing=True)
        assert ck.scope_of("jit(layer_body)/kvo_select_count/pallas_call") == "kvo_select_count"
        with pytest.raises(SystemExit, match="no optimized module"):
            ck.main([str(tmp_path / "dump"), "--modules", "nothing"])


def test_hlo_text_reads_an_instruction_and_its_array_bytes():
    from kvoffload.hlo_text import array_bytes, computations, entry_lines, instruction

    line = "  ROOT %fusion.3 = bf16[1,8,64]{2,1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_computation.3"
    assert instruction(line) == ("fusion.3", "bf16[1,8,64]{2,1,0}", "fusion")
    assert instruction("HloModule jit_f") is None
    assert array_bytes("bf16[1,8,64]{2,1,0}") == (1024, "bf16[1,8,64]")
    assert array_bytes("pred[4,4]{1,0}") == (16, "pred[4,4]")
    assert array_bytes("f32[]") == (4, "f32[]")
    assert array_bytes("(f32[2]{0}, s32[])") is None
    text = ("HloModule m\n\n%fused_computation.3 (p: f32[2]) -> f32[2] {\n  %p = f32[2]{0} parameter(0)\n}\n\n"
            "ENTRY %main (a: f32[2]) -> f32[2] {\n  %a = f32[2]{0} parameter(0)\n  ROOT %n = f32[2]{0} negate(%a)\n}\n")
    assert list(computations(text)) == ["fused_computation.3"]
    assert [instruction(x)[2] for x in entry_lines(text)] == ["parameter", "negate"]


def test_large_writes_reads_the_entry_and_loop_bodies_not_fused_kernels():
    """A compiled loop over a stacked array that copies each layer's slice out (a slice an opaque consumer needs
    as its own buffer): the copy is in the while body and is listed; an array under the bound is not; a fused
    computation's insides are not read (they never reach memory)."""
    import jax
    import jax.numpy as jnp

    from kvoffload.hlo_text import computations, control_computations, large_writes

    def f(st, x):
        def body(i, acc):
            w = jax.lax.dynamic_index_in_dim(st, i, keepdims=False)
            return acc + jnp.sort(w, axis=0)[0] * x  # sort takes the slice as a buffer of its own
        return jax.lax.fori_loop(0, st.shape[0], body, jnp.zeros_like(x))

    text = jax.jit(f).lower(jnp.ones((3, 512, 1024), jnp.float32), jnp.ones((1024,), jnp.float32)).compile().as_text()
    ctrl = control_computations(text)
    assert "ENTRY" in ctrl and any("body" in n or "region" in n or "while" in n for n in ctrl if n != "ENTRY")
    assert not any(n.startswith("fused") for n in ctrl if n != "ENTRY")
    assert set(ctrl) - {"ENTRY"} <= set(computations(text))
    big = large_writes(text, 1 << 20)  # the [512, 1024] f32 slice (2 MiB) or its sort, in the loop
    # the CPU writes it as [512,1024]; the GPU keeps the sliced axis ([1,512,1024])
    assert big and all("MiB" in b for b in big) and any("512,1024]" in b for b in big)
    assert large_writes(text, 64 << 20) == []
    # only the opcodes asked for: the loop's large write is a `sort` on the CPU, on the GPU XLA may make it a
    # fusion or cub's radix-sort custom call (a GPU suite run failed on "sort" here)
    op = next(b.split()[0] for b in big if "512,1024]" in b)
    only = large_writes(text, 1 << 10, {op})
    assert only and all(b.split()[0] == op for b in only)
    assert set(only) <= set(large_writes(text, 1 << 10)) and large_writes(text, 1 << 10, {"no-such-op"}) == []
    if jax.default_backend() == "cpu":  # each with the jax op it came from where XLA kept one
        assert all(b.endswith("/sort") for b in large_writes(text, 1 << 10, {"sort"}))
