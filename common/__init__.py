"""What every layer may import: the user-error type, logging, and XLA's set-up.

    errors.py  `UserError`: what a user can fix, printed by the CLIs as one line
    log.py     the project's one logger (`[train]`, `[data]`, ... lines on stderr)
    xla.py     XLA flags for the platform and the persistent compilation cache
    cpus.py    the CPU cores this process may use
    distributed.py  several processes: start-up, small collectives, stopping together,
               the peer watchdog (train.py and decode.py)

Imports nothing of the project outside common/.
"""
