"""Pipeline parallelism as a step strategy: schedules as data (schedules.py, builders.py), compiled into
tick tables (ticks.py), run by the executor (executor.py) over the per-chunk ops (ops.py)."""
