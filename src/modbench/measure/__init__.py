"""Measurement of models and machines, no training and no judging: analytic and counted FLOPs
(:mod:`~modbench.measure.flops`), saved-activation memory (:mod:`~modbench.measure.memory`), the
memory plan (:mod:`~modbench.measure.plan`, ``modbench plan``), throughput and MFU
(:mod:`~modbench.measure.bench`, ``modbench bench``) and the compile check
(:mod:`~modbench.measure.compile_check`, ``modbench bench --compile-check``).

Judging results (the verdict rule, scaling fits, power) is :mod:`modbench.analysis`'s.
"""

from modbench.measure.flops import FlopReport, flop_report, measure_flops

__all__ = ["FlopReport", "flop_report", "measure_flops"]
