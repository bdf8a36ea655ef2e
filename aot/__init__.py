"""Ahead-of-time compiles for a target we do not have (train.py --compile_for): does a
config fit a TPU slice or a GPU box, and how fast would its step run.

    fit.py       compile the train and eval steps on abstract devices; the JSON report
    hardware.py  TPU slices and GPU boxes: chips, topologies, compilers
    hlo.py       what the compiled HLO holds: collectives, matmul types
    roofline.py  a per-kernel time estimate of a compiled GPU program
    report.py    the report's table and advice

Sits beside training/, whose steps it compiles; nothing below imports it.
"""
