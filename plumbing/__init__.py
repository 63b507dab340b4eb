"""What every script shares and no lesson teaches: you need not open this folder.

One concern per file: flags.py (the shared flags and their checks), compile.py (whether
--compile can work here), model_check.py (a model that would train silently differently, or a
cut that misses, refused), ranks.py (how a process becomes a rank),
checkpoints.py and sharded.py (checkpoint bookkeeping, a data-only loader), meter.py (log
lines, the meter, the profiler), diagnostics.py (`python -m plumbing.diagnostics`).
Copy the whole folder with a script; importing it does nothing but define things.
"""
