"""The process's runtime, which every layer may import: the user-error type, logging,
XLA's set-up, the CPUs, several processes, and the flags train.py and decode.py share.

    errors.py  `UserError`: what a user can fix, printed by the CLIs as one line
    log.py     the project's one logger (`[train]`, `[data]`, ... lines on stderr)
    xla.py     XLA flags for the platform and the persistent compilation cache
    cpus.py    the CPU cores this process may use
    distributed.py  several processes: start-up, small collectives, stopping together,
               the peer watchdog (train.py and decode.py)
    process_flags.py  the flags of the process both CLIs declare (cache, processes)

Imports nothing of the project outside runtime/.
"""
