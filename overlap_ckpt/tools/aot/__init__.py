"""The ``overlap-ckpt aot`` command's own parts: the LM it compiles (``lm_step``), the run
over window sizes (``benchmark``), its report (``report``), and the checks that set the
prediction beside a measured run (``cpu_check`` here, ``device_check`` on a GPU, timed with
``calibrate``). What the library itself reads of a compiled program is :mod:`overlap_ckpt.aot`."""
