# A docs/aot.md example that compiles for the h100 target, which needs jax's CUDA plugin
# registered without a GPU (JAX_PLATFORMS=cpu). CI's main job installs no plugin (it logs to
# stderr at every jax import), so there the example stops here, before the block; CI's h100
# job runs this same program with the plugin (tests/aot/test_user_step_report.py,
# test_h100_docs_examples_run), where the checks after the block hold.
import importlib.util
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
    print("jax's CUDA plugin is not installed here: this h100 example runs in CI's h100 job")
    sys.exit(0)
# <snippet>
assert report.ok, report.violations  # noqa: F821 - the block's
assert all(window.plain_is_users_program for window in report.windows.values())  # noqa: F821
assert report.k in report.windows  # noqa: F821
