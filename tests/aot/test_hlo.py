"""Reading a scheduled HLO module (text as XLA:GPU prints it) and a buffer assignment,
without any plugin."""

import jax
import jax.numpy as jnp

from overlap_ckpt.aot.hlo import device_copies, device_temp_bytes, entry_instructions, host_copies
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
