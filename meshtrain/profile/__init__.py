"""Device traces of training steps and the time-by-category table read from them.

  window.py    StepTrace: the trace of the steps in run.profile_steps, which the trainer opens and closes
  trace.py     reading a jax.profiler trace: kernels, executions, step markers, each kernel in a category
  timeline.py  the accounting: every instant of the window to exactly one category
  table.py     the report of a trace (profile_report) and its table (format_table)
  __main__.py  the command: python -m meshtrain.profile TRACE [--json] [--steps N] [--program HLO]

Nothing is imported here: trace.py, timeline.py and table.py need only the standard library, so the
table can be read where jax is not installed.
"""
