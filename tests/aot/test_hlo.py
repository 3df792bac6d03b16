"""Reading a scheduled HLO module (text as XLA:GPU prints it) and a buffer assignment,
without any plugin."""

import jax
import jax.numpy as jnp

from overlap_ckpt.aot.hlo import device_copies, device_temp_bytes, entry_instructions, host_copies, scheduled_flops
from overlap_ckpt.aot.programs import compile_program, fingerprint

from conftest import run_python

SCHEDULED = r'''HloModule jit_step, is_scheduled=true

FileNames
1 "/home/user/train.py"

%fused_computation (p: f32[1024,1024]) -> f32[1024,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  ROOT %n = f32[1024,1024]{1,0} negate(%p)
}

ENTRY %main.3 (w.1: f32[1024,1024], b.1: f32[8]) -> (f32[1024,1024], f32[1024,1024], f32[8], f32[1024,1024]) {
  %w.1 = f32[1024,1024]{1,0} parameter(0), metadata={op_name="state.params['w']"}
  %b.1 = f32[8]{0} parameter(1), metadata={op_name="state.params['b']"}
  %copy-start.2 = (f32[1024,1024]{1,0:S(5)}, f32[1024,1024]{1,0}, u32[]) copy-start(%w.1), backend_config={"operation_queue_id":"1"}
  %gemm_fusion = f32[1024,1024]{1,0} fusion(%w.1), kind=kCustom, calls=%fused_computation
  %copy-done.2 = f32[1024,1024]{1,0:S(5)} copy-done(%copy-start.2)
  %copy-start.3 = (f32[8]{0:S(5)}, f32[8]{0}, u32[]) copy-start(%b.1), backend_config={"operation_queue_id":"1"}
  %copy-done.3 = f32[8]{0:S(5)} copy-done(%copy-start.3)
  %copy.4 = f32[1024,1024]{1,0} copy(%w.1), metadata={op_name="jit(step)/copy" source_line=12}
  ROOT %tuple = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0:S(5)}, f32[8]{0:S(5)}, f32[1024,1024]{1,0}) tuple(%gemm_fusion, %copy-done.2, %copy-done.3, %copy.4)
}
'''


def test_host_copies_overlap_queue_and_leaf():
    copies = host_copies(entry_instructions(SCHEDULED))
    assert [(c.leaf, c.nbytes, c.asynchronous, c.queue, c.compute_between) for c in copies] == [
        ("state.params['w']", 4 << 20, True, "1", 1),
        ("state.params['b']", 32, True, "1", 0),
    ]
    assert [c.overlapped for c in copies] == [True, False]


# A window phase as the GPU plan compiles it, reduced: a state copy whose done reaches the
# outputs through the optimization barrier before the update, a per-leaf gradient copy whose
# operands lead back to the parameter (the backward pass reads it), and a packed copy behind
# a bitcast of the concatenation.
LABELLED = r'''HloModule jit_step, is_scheduled=true

ENTRY %main.3 (w.1: f32[256], g.1: f32[256]) -> (f32[256], f32[256], f32[256], f32[512]) {
  %w.1 = f32[256]{0} parameter(0), metadata={op_name="params['w']"}
  %g.1 = f32[256]{0} parameter(1), metadata={op_name="params['v']"}
  %copy-start.1 = (f32[256]{0:S(5)}, f32[256]{0}, u32[]) copy-start(%w.1)
  %grad = f32[256]{0} fusion(%w.1), kind=kLoop, calls=%f
  %concatenate.1 = f32[512]{0} concatenate(%w.1, %g.1), dimensions={0}
  %bitcast.1 = f32[512]{0} bitcast(%concatenate.1)
  %copy-start.2 = (f32[512]{0:S(5)}, f32[512]{0}, u32[]) copy-start(%bitcast.1)
  %copy-start.3 = (f32[256]{0:S(5)}, f32[256]{0}, u32[]) copy-start(%grad)
  %gemm = f32[256]{0} fusion(%grad), kind=kCustom, calls=%f
  %copy-done.1 = f32[256]{0:S(5)} copy-done(%copy-start.1)
  %tuple.1 = (f32[256]{0:S(5)}, f32[256]{0}) tuple(%copy-done.1, %w.1)
  %opt-barrier.1 = (f32[256]{0:S(5)}, f32[256]{0}) opt-barrier(%tuple.1)
  %get-tuple-element.1 = f32[256]{0:S(5)} get-tuple-element(%opt-barrier.1), index=0
  %get-tuple-element.2 = f32[256]{0} get-tuple-element(%opt-barrier.1), index=1
  %copy-done.3 = f32[256]{0:S(5)} copy-done(%copy-start.3)
  %copy-done.2 = f32[512]{0:S(5)} copy-done(%copy-start.2)
  %bitcast.2 = f32[512]{0:S(5)} bitcast(%copy-done.2)
  ROOT %tuple = (f32[256]{0}, f32[256]{0:S(5)}, f32[256]{0:S(5)}, f32[512]{0:S(5)}) tuple(%get-tuple-element.2, %get-tuple-element.1, %copy-done.3, %bitcast.2)
}
'''


def test_copies_are_named_by_the_outbox_output_they_land_in():
    """With the program's outputs labelled (overlap_ckpt.aot.outbox), a gradient copy is a
    gradient even though its operands lead to a parameter, the state copy is found through
    the optimization barrier, and a packed copy says so; without, the operand chain's guess
    names the gradient after the parameter and still calls the packed copy packed."""
    instructions = entry_instructions(LABELLED)
    outputs = [("", ""), ("state", "params['w']"), ("gradients", "gradient of params['w']"),
               ("state", "a packed outbox of the state (2 items, 32-bit)")]
    named = {c.name: (c.kind, c.leaf) for c in host_copies(instructions, outputs=outputs)}
    assert named == {"copy-start.1": ("state", "params['w']"),
                     "copy-start.2": ("state", "a packed outbox of the state (2 items, 32-bit)"),
                     "copy-start.3": ("gradients", "gradient of params['w']")}
    guessed = {c.name: (c.kind, c.leaf) for c in host_copies(instructions)}
    assert guessed == {"copy-start.1": ("", "params['w']"),
                       "copy-start.2": ("", "a packed outbox (params['w'], ...)"),
                       "copy-start.3": ("", "params['w']")}


def test_device_copy_of_an_argument_is_named():
    assert [(c.leaf, c.nbytes) for c in device_copies(entry_instructions(SCHEDULED))] == [
        ("state.params['w']", 4 << 20)]


def test_fingerprint_ignores_python_names_only():
    renamed = SCHEDULED.replace("HloModule jit_step", "HloModule jit_other").replace(
        "/home/user/train.py", "/elsewhere.py").replace("source_line=12", "source_line=99")
    assert fingerprint(renamed) == fingerprint(SCHEDULED)
    assert fingerprint(SCHEDULED.replace("negate", "abs")) != fingerprint(SCHEDULED)


# As XLA:TPU dumps it: device memory has no color; VMEM is color 1, host memory color 5.
BUFFER_ASSIGNMENT = """BufferAssignment:
allocation 0: size 303104, color 5, maybe-live-out:
 value: <4 copy-start.1{0} @0> (size=303104,offset=0): u32[75661]{0:T(1024)S(5)}
allocation 1: size 40960, parameter 5, shape |f32[20,4,20]| at ShapeIndex {}, maybe-live-out:
allocation 2: size 5571072, preallocated-temp:
 value: <7 fusion.3{} @0> (size=512,offset=0): (f32[20], f32[20])
allocation 3: size 3887616, color 1, preallocated-temp:
allocation 4: size 4096, color 4, preallocated-temp:
allocation 5: size 1024, color 0, preallocated-temp:
allocation 6: size 262293024, page 0, preallocated-temp:
allocation 7: size 2048, page 0, color 1, preallocated-temp:
"""


def test_device_temporaries_are_the_preallocated_temp_in_device_memory_only():
    # allocations 6 and 7 as XLA of jax 0.11 writes them (a page before the color), read off
    # a real H200's dump, where memory_analysis gave the same 262293024 bytes of temporaries
    assert device_temp_bytes(BUFFER_ASSIGNMENT) == 5571072 + 1024 + 262293024


def test_temporaries_from_the_buffer_assignment_agree_with_memory_analysis_on_the_cpu():
    """On the CPU (as on GPU) ``memory_analysis`` reports the buffer assignment's
    temporaries: the independent reference for reading the dump (on TPU it does not)."""
    def step(w, x):
        return jnp.tanh(x @ w) @ w.T, jnp.sin(x).sum()

    args = (jax.ShapeDtypeStruct((256, 512), jnp.float32), jax.ShapeDtypeStruct((64, 256), jnp.float32))
    report, compiled = compile_program("toy", jax.jit(step).lower(*args))
    assert report.memory.temp == compiled.memory_analysis().temp_size_in_bytes > 0


def test_a_program_the_persistent_cache_answers_is_refused_with_the_fix(tmp_path):
    """The compiler dumps only what it compiles: a program loaded from JAX's persistent
    compilation cache has no buffer assignment to read, which is said with the fix."""
    code = f"""
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", {str(tmp_path)!r})
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
from overlap_ckpt.aot.programs import compile_program
lowered = jax.jit(lambda x: jnp.sin(x) @ x).lower(jax.ShapeDtypeStruct((64, 64), jnp.float32))
compile_program("first", lowered)
try:
    compile_program("second", lowered)
except RuntimeError as e:
    print(e)
"""
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "second was not compiled but loaded from JAX's persistent compilation cache" in proc.stdout
    assert "jax.config.update('jax_enable_compilation_cache', False)" in proc.stdout


# A step as XLA:GPU schedules it: a copy started after the first matmul (a fusion calling a
# dot), a library GEMM and a scanned layer (a loop of known trip count) run while it
# transfers, then one elementwise fusion after its done.
MATMULS = r'''HloModule jit_step, is_scheduled=true

%gemm_fusion_dot.1_computation (parameter_0: bf16[256,64], parameter_1: bf16[64,240]) -> bf16[256,240] {
  %parameter_0 = bf16[256,64]{1,0} parameter(0)
  %parameter_1 = bf16[64,240]{1,0} parameter(1)
  ROOT %dot.106 = bf16[256,240]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (p: (s32[], f32[16,32,32])) -> (s32[], f32[16,32,32]) {
  %p = (s32[], f32[16,32,32]{2,1,0}) parameter(0)
  %x = f32[16,32,32]{2,1,0} get-tuple-element(%p), index=1
  %i = s32[] get-tuple-element(%p), index=0
  %y = f32[16,32,32]{2,1,0} dot(%x, %x), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
  ROOT %t = (s32[], f32[16,32,32]{2,1,0}) tuple(%i, %y)
}

%cond (q: (s32[], f32[16,32,32])) -> pred[] {
  %q = (s32[], f32[16,32,32]{2,1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%neg (a: f32[256,240]) -> f32[256,240] {
  %a = f32[256,240]{1,0} parameter(0)
  ROOT %n = f32[256,240]{1,0} negate(%a)
}

ENTRY %main.9 (w.1: bf16[256,64], v.1: bf16[64,240], s.1: (s32[], f32[16,32,32]), g.1: f32[512,128], h.1: f32[128,96]) -> (bf16[256,240], f32[256,240], f32[512,96], (s32[], f32[16,32,32])) {
  %w.1 = bf16[256,64]{1,0} parameter(0), metadata={op_name="params['w']"}
  %v.1 = bf16[64,240]{1,0} parameter(1), metadata={op_name="params['v']"}
  %s.1 = (s32[], f32[16,32,32]{2,1,0}) parameter(2)
  %g.1 = f32[512,128]{1,0} parameter(3)
  %h.1 = f32[128,96]{1,0} parameter(4)
  %gemm_fusion_dot.1 = bf16[256,240]{1,0} fusion(%w.1, %v.1), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %copy-start.1 = (bf16[256,64]{1,0:S(5)}, bf16[256,64]{1,0}, u32[]) copy-start(%w.1), backend_config={"operation_queue_id":"1"}
  %custom-call.2 = (f32[512,96]{1,0}, s8[4194304]{0}) custom-call(%g.1, %h.1), custom_call_target="__cublas$gemm", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %while.3 = (s32[], f32[16,32,32]{2,1,0}) while(%s.1), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %copy-done.1 = bf16[256,64]{1,0:S(5)} copy-done(%copy-start.1)
  %f32.4 = f32[256,240]{1,0} convert(%gemm_fusion_dot.1)
  %fusion.5 = f32[256,240]{1,0} fusion(%f32.4), kind=kLoop, calls=%neg
  %gte.6 = f32[512,96]{1,0} get-tuple-element(%custom-call.2), index=0
  ROOT %tuple = (bf16[256,240]{1,0}, f32[256,240]{1,0}, f32[512,96]{1,0}, (s32[], f32[16,32,32]{2,1,0})) tuple(%gemm_fusion_dot.1, %fusion.5, %gte.6, %while.3)
}
'''


def test_scheduled_flops_are_the_matmuls_loops_included_and_place_each_copy():
    """Hand arithmetic (2 x output elements x contracted size per matmul) is the reference:
    the fused dot, the library GEMM read from its dimension numbers, the loop's batched dot
    three times; elementwise work counts nothing."""
    fused, gemm, loop = 2 * 256 * 240 * 64, 2 * 512 * 96 * 128, 3 * 2 * 16 * 32 * 32 * 32
    flops = scheduled_flops(MATMULS)
    by_name = dict(zip((i.name for i in entry_instructions(MATMULS)), flops))
    assert (by_name["gemm_fusion_dot.1"], by_name["custom-call.2"], by_name["while.3"]) == (fused, gemm, loop)
    assert sum(flops) == fused + gemm + loop
    (copy,) = host_copies(entry_instructions(MATMULS), flops)
    assert (copy.leaf, copy.flops_before, copy.flops_between) == ("params['w']", fused, gemm + loop)


def test_scheduled_flops_of_a_cpu_program_are_its_matmuls():
    """A program compiled here: the flops of a scanned matmul (XLA's cost analysis counts a
    loop's body once, so hand arithmetic is the reference there) and, without the loop,
    XLA's own cost analysis."""
    def scanned(x, w1, w2):
        y, _ = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x @ w1, jnp.stack([w2, w2, w2]))
        return y

    args = (jax.ShapeDtypeStruct((32, 64), jnp.float32), jax.ShapeDtypeStruct((64, 128), jnp.float32),
            jax.ShapeDtypeStruct((128, 128), jnp.float32))
    text = jax.jit(scanned).lower(*args).compile().as_text()
    assert sum(scheduled_flops(text)) == 2 * 32 * 64 * 128 + 3 * 2 * 32 * 128 * 128

    compiled = jax.jit(lambda x, w1, w2: (x @ w1) @ w2).lower(*args).compile()
    assert sum(scheduled_flops(compiled.as_text())) == compiled.cost_analysis()["flops"] == (
        2 * 32 * 64 * 128 + 2 * 32 * 128 * 128)
