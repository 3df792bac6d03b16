"""The ``overlap-ckpt aot`` command's own parts: the LM it compiles (``lm_step``), the run
over window sizes (``benchmark``), a user's step named on the command line (``step_cli``),
and the checks that set the prediction beside a measured run (``cpu_check`` here,
``device_check`` on a GPU, timed with ``calibrate``). What the library itself reads of a
compiled program, and the report's markdown, is :mod:`overlap_ckpt.aot`."""
