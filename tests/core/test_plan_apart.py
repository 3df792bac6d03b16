"""Which leaves a plan's window steps update apart from where the state keeps them
(``CapturePlan.apart``, see ``overlap_ckpt.core.capture.updated_apart``), and that this is
part of the plan's value (run in a subprocess: it needs 4 simulated CPU devices)."""

import os

from conftest import REPO, run_python

CODE = r'''
import jax, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from overlap_ckpt.core.plan import make_plan
assert jax.device_count() == 4
mesh = Mesh(np.array(jax.devices()), ("a",))
tx = optax.adam(1e-2)

def state(moments):
    params = {"w": jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P(None, "a")))}
    opt_state = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, moments)) if x.ndim else x,
                             tx.init(params))
    return params, opt_state

# Moments replicated beside a kernel sharded on columns: captured on the kernel's columns,
# kept replicated, so the window steps compute them apart (mu and nu: flat indices 2 and 3,
# after the one params leaf and the count).
replicated = make_plan(tx, *state(P()), None, 2)
assert [(i, placed.spec) for i, placed in replicated.apart] == [(2, P()), (3, P())], replicated.apart
# Laid out like the kernel: nothing to compute apart.
alike = make_plan(tx, *state(P(None, "a")), None, 2)
assert alike.apart == ()
# Same capture layouts, other placements: other window programs, so unequal plans.
assert alike.params == replicated.params and alike.state == replicated.state
assert alike != replicated
print("APART-OK")
'''


def test_leaves_kept_in_another_layout_are_updated_apart_and_distinguish_plans():
    code = "import sys; sys.path.insert(0, %r)\n" % os.path.join(REPO, "tests") + CODE
    result = run_python(code, devices=4)
    assert "APART-OK" in result.stdout, result.stdout[-3000:] + result.stderr[-5000:]
